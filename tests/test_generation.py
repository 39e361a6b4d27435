"""HF generation on ZeRO-3 shards: gathered once per rollout, same tokens as the plain model, EOS masking;
stop strings on both backends."""
import json

import pytest
from conftest import needs_vllm, torchrun

from grpo_recipe.generation import finish


class FakeTok:
    """Token i decodes to " i"."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(f" {i}" for i in ids)

    def batch_decode(self, ids, skip_special_tokens=True):
        return [self.decode(x) for x in ids]


def test_finish_cuts_after_first_eos_and_masks():
    c = finish([[5, 6, 0, 9, 9], [5, 6, 7, 8, 9], [0, 1, 1, 1, 1]], eos_id=0, tokenizer=FakeTok(), max_len=5)
    assert c.ids == [[5, 6, 0], [5, 6, 7, 8, 9], [0]]
    assert c.mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]
    assert c.truncated.tolist() == [False, True, False]


def test_hf_stop_criterion_stops_a_row_when_its_newest_token_completes_a_stop_string():
    """transformers' criterion (one copy of the newest tokens per decoding step): a row is done when its completion
    ends in a stop string, never for one inside the prompt, and whatever the completion's length so far."""
    import torch

    from grpo_recipe.generation.hf import stop_criteria

    (stop,) = stop_criteria(["7 8", "XX"], FakeTok(), prompt_width=3)
    ids = torch.tensor([[7, 8, 1, 5, 7, 8],  # the completion ends in "7 8"
                        [7, 8, 1, 5, 6, 7],  # "7 8" in the prompt only
                        [1, 1, 7, 8, 9, 9],  # "7 8" spanning prompt and completion: not the completion's
                        [1, 1, 1, 2, 7, 8]])
    assert stop(ids, None).tolist() == [True, False, False, True]
    assert stop(ids[:, :4], None).tolist() == [False, False, False, False]  # one completion token so far
    assert stop_criteria([], FakeTok(), prompt_width=3) is None


def test_finish_cuts_at_the_token_that_completes_a_stop_string():
    raw = [[5, 6, 7, 8, 9], [7, 0, 7, 8, 1], [1, 2, 3, 4, 5], [1, 27, 80, 4, 4], [1, 2, 3]]
    c = finish(raw, eos_id=0, tokenizer=FakeTok(), max_len=5, stops=["7 8", "XX"])
    # row 1: EOS comes first; row 3: the text decides, not the ids (" 27 80" holds "7 8" across two tokens)
    assert c.ids == [[5, 6, 7, 8], [7, 0], [1, 2, 3, 4, 5], [1, 27, 80], [1, 2, 3]]
    assert c.mask.sum(-1).tolist() == [4, 2, 5, 3, 3]
    # neither EOS nor stop: truncated only at max_len (row 4: vLLM may end a sample by its own stop check)
    assert c.truncated.tolist() == [False, False, True, False, False]
    assert c.texts[0] == " 5 6 7 8"  # the stop string stays in the text, as in the trained tokens


@pytest.mark.slow
def test_zero3_generation_matches_plain_model_and_gathers_once(tmp_path):
    out = tmp_path / "gen.json"
    torchrun(2, ["tests/dist_generation.py", str(out)])
    r = json.loads(out.read_text())
    assert r["match"], "tokens sampled from gathered ZeRO-3 weights differ from the plain model's"
    assert r["partitioned"], "parameters were not released back to their shards after generation"
    assert r["grads_released"], "the gradient partition kept its memory while generating, or came back not zeroed"
    assert r["trace_kept"], "generation discarded ZeRO-3's recorded module trace"
    assert r["plain_linear"], "generation did not run torch's own linear, or did not put ZeRO-3's back"
    with_trace, without = r["micro_batch_gathers"]
    assert 0 < with_trace < without / 2, f"a micro-batch after generation did not prefetch: {with_trace} vs {without}"
    assert r["gathers_12"] > 0 and r["gathers_12"] == r["gathers_24"], \
        f"all-gathers grew with decoding steps ({r['gathers_12']} vs {r['gathers_24']}): not gathered once"
    for ids, m, t in zip(r["ids"], r["mask_sum"], r["truncated"]):
        assert len(ids) == m and (t == (r["eos"] not in ids))
    # generation failed on rank 1 only: both ranks raised its message (none was left waiting in a collective)
    assert r["raised"][0] == r["raised"][1] and r["raised"][0].startswith("test generation failed (rank 1): "
                                                                          "IndexError: index out of range"), r["raised"]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["hf", pytest.param("vllm", marks=needs_vllm)])
def test_stop_strings_end_completions(tmp_path, backend):
    out = tmp_path / "stop.json"
    torchrun(1, ["tests/dist_stop.py", str(out), backend], timeout=900)
    r = json.loads(out.read_text())[backend]
    assert not r["bad"], f"completions that do not end at EOS, a stop string or max length: {r['bad']}"
    assert r["stopped"] >= r["n"] // 2, f"only {r['stopped']} of {r['n']} samples ended at a stop string"


def test_sampler_logps_are_the_picked_tokens_under_the_trainers_scoring(tiny_model_dir):
    """A generation rank's copy reports, per sampled token, log softmax(logits / T) of the model at that position
    (what the trainer computes in one forward over prompt + completion), and 0 past a sample's end."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo_recipe.algo.buffer import left_pad
    from grpo_recipe.config.load import load_config
    from grpo_recipe.generation.hf import HFGenerator

    cfg = load_config(["--config", "grpo_recipe/configs/quickstart.yaml", "--model_name_or_path",
                       str(tiny_model_dir), "--temperature", "0.7", "--max_completion_length", "12"], world_size=1)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    prompts = [tok("Summarize: the cat sat on the mat.")["input_ids"], tok("Hello there")["input_ids"]]
    comp = HFGenerator(cfg, None, tok, model=model, with_logps=True).generate(prompts, seed=3)
    assert comp.logps.shape == comp.mask.shape and comp.mask.sum() > len(prompts)
    n = cfg.num_generations
    for i, ids in enumerate(comp.ids):
        prompt = prompts[i // n]
        full, attn = left_pad([prompt + ids], tok.pad_token_id)
        with torch.no_grad():
            logits = model(input_ids=full, attention_mask=attn).logits[0, -len(ids) - 1:-1].float()
        want = torch.log_softmax(logits / 0.7, dim=-1).gather(-1, torch.tensor(ids)[:, None]).squeeze(-1)
        torch.testing.assert_close(comp.logps[i, :len(ids)], want, rtol=1e-4, atol=1e-4)
        assert (comp.logps[i, len(ids):] == 0).all()
