"""A whole GRPO update equals TRL 1.16's own GRPOTrainer from the same weights on the same rollout: the optimizer
steps of one generation, 2 ranks, ZeRO-3, AdamW, gradient clipping, mu = 1 and 2.

tests/test_loss_trl.py proves the loss and its gradient equal TRL's on fixed tensors; this covers what lies
around them and decides what a run learns: the learning rate and its schedule, AdamW's fields, clipping, how each
side scales the loss over ranks and passes, and the GRPOConfig/DeepSpeed files bench/vs_trl.py's mapping gives TRL
(the one bench/real_vs_trl.py's comparison runs on). TRL generates and scores; the recipe trains on that rollout
(tests/dist_update.py, its `rollout` option)."""
import json
import sys

import pytest
import torch
from conftest import REPO, torchrun
from dist_update import BASE
from test_update import run_cases

from grpo_recipe.config.schema import Config

pytest.importorskip("trl", reason="trl not installed (bash launch/setup_venv.sh test,bench-trl)")
sys.path.insert(0, str(REPO / "bench"))
from vs_trl import trl_ds_config, trl_fields  # noqa: E402

# Every prompt is 7 tokens long: TRL's training forward passes no position ids, so a left-padded prompt is scored
# at positions shifted from those it was sampled at (the recipe counts from the first real token); under RoPE the
# relative positions are the same, but the two sides' float results would not be bit-close.
PROMPTS = ["the cat up", "the sat two", "the mat up", "the dog two", "the ran three", "the bed three", "the now big",
           "the up cat"]
CASE = dict(num_generations=4, per_device_train_batch_size=8, max_completion_length=8, learning_rate=3e-3,
            max_grad_norm=0.05, loss_type="dapo", temperature=0.7, logging_steps=1)


def eos_prone_model(src, dst):
    """The tiny model with its EOS embedding (tied to its output row) moved along its mean final hidden state, so
    that sampled completions end at many lengths (the untrained model almost never samples EOS)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(src)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    with torch.no_grad():
        h = model(**tok(PROMPTS, return_tensors="pt"), output_hidden_states=True).hidden_states[-1]
        mean = h.reshape(-1, h.shape[-1]).mean(0)
        model.get_input_embeddings().weight[tok.eos_token_id] += 2.0 * mean / mean.norm() ** 2
    model.save_pretrained(dst)
    tok.save_pretrained(dst)
    return dst


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tiny_model_dir):
    return eos_prone_model(tiny_model_dir, tmp_path_factory.mktemp("eos_prone"))


@pytest.fixture(scope="module")
def trl_run(tmp_path_factory, model_dir):
    from transformers import AutoConfig, AutoTokenizer

    from grpo_recipe.model.ds_config import ds_config

    tok = AutoTokenizer.from_pretrained(model_dir)
    assert {len(tok(p)["input_ids"]) for p in PROMPTS} == {7}
    tmp = tmp_path_factory.mktemp("trl_step")
    cfg = Config(**{**BASE, **CASE, "model_name_or_path": str(model_dir), "num_iterations": 2})
    (tmp / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    hidden = AutoConfig.from_pretrained(model_dir).hidden_size
    (tmp / "ds.json").write_text(json.dumps(trl_ds_config(cfg, False, ds_config(cfg, 2, hidden))))
    spec = {"output_dir": str(tmp / "trl"), "model": str(model_dir), "prompts_file": str(tmp / "prompts.jsonl"),
            "deepspeed_config": str(tmp / "ds.json"),
            "grpo_config": trl_fields(cfg, 2, 2, False) | {"seed": 3, "disable_tqdm": True}}
    (tmp / "spec.json").write_text(json.dumps(spec))
    torchrun(2, ["tests/dist_trl_step.py", str(tmp / "spec.json")])
    return tmp / "trl"


def weights(folder):
    from safetensors.torch import load_file

    return load_file(folder / "model.safetensors")


def test_recipe_update_equals_trls_trainer(trl_run, tmp_path, model_dir):
    rollouts = [torch.load(trl_run / f"rollout-rank{r}.pt", weights_only=True) for r in range(2)]
    assert [len(r) for r in rollouts] == [1, 1]  # one generation for both optimizer steps
    lengths = torch.cat([r[0]["completion_mask"].sum(-1) for r in rollouts])
    assert len(set(lengths.tolist())) > 1, "completions of one length would not test the token normalizer"
    logs = [e for e in json.loads((trl_run / "log_history.json").read_text()) if "grad_norm" in e]
    # what the comparison covers: both steps clip the gradient, and the second pass clips the ratio
    assert [e["step"] for e in logs] == [1, 2] and min(e["grad_norm"] for e in logs) > CASE["max_grad_norm"]
    assert logs[1]["clip_ratio/region_mean"] > 0.1
    cases = [{"name": f"mu{mu}", "rollout": str(trl_run), **CASE, "model_name_or_path": str(model_dir),
              "num_iterations": mu} for mu in (1, 2)]
    got = run_cases(tmp_path, 2, cases, "ours")
    start = weights(model_dir)
    for mu in (1, 2):
        trl = weights(trl_run / f"step-{mu}")
        ours = got[f"mu{mu}"]["state"]
        assert trl.keys() <= ours.keys()
        moved = max((trl[k] - start[k]).abs().max().item() for k in trl)
        assert moved > 0.5 * CASE["learning_rate"], f"step {mu}: TRL's weights did not move ({moved})"
        for k in trl:
            torch.testing.assert_close(ours[k], trl[k], atol=2e-5, rtol=0, msg=f"step {mu}: {k}")
