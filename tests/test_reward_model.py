"""rewards/model.py: a sequence-classification model as a reward function scores what transformers' own forward
scores on the same text (batched and padded or not, text and chat prompts), mixes with functions and weights, and
trains on 2 ranks; a folder that is not a reward model is one line."""
import json

import pytest
import torch
from conftest import torchrun

from grpo_recipe.rewards.funcs import RewardError, load_reward_funcs, score
from grpo_recipe.run.metrics import read_jsonl

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory, tiny_model_dir):
    """The tiny Qwen2 as a sequence-classification model with one output (random head), with a chat template."""
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    folder = tmp_path_factory.mktemp("rm") / "tiny-rm"
    config = AutoConfig.from_pretrained(tiny_model_dir, num_labels=1)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    config.pad_token_id = tok.pad_token_id
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(config)
    model.save_pretrained(folder)
    tok.chat_template = CHATML
    tok.save_pretrained(folder)
    return folder


def plain_scores(folder, texts):
    """transformers' own forward, one text at a time (no padding), first logit."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    with torch.no_grad():
        return [model(**tok(t, return_tensors="pt", add_special_tokens=False)).logits[0, 0].item() for t in texts]


def test_scores_equal_transformers_forward_on_the_same_text(reward_model):
    from transformers import AutoTokenizer

    (rm,) = load_reward_funcs([str(reward_model)])  # TRL's form: the model's name as a reward function
    assert rm.name == "tiny-rm" and rm.weight == 1.0
    rm.fn.batch_size = 3  # batches of different lengths, padded on the right
    prompts = ["TITLE: short", "TITLE: a much longer prompt about a landlord and a deposit", "x", "TITLE: four"]
    completions = [" one", " two words", " and three words here", ""]
    got = rm.fn(prompts, completions)
    want = plain_scores(reward_model, [p + c for p, c in zip(prompts, completions)])
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-5, (got, want)
    # chat prompts: the reward model's own template over prompt + completion messages
    chats = [[{"role": "user", "content": p}] for p in prompts]
    answers = [[{"role": "assistant", "content": c}] for c in completions]
    tok = AutoTokenizer.from_pretrained(reward_model)
    texts = [tok.apply_chat_template(p + a, tokenize=False) for p, a in zip(chats, answers)]
    got = rm.fn(chats, answers)
    assert max(abs(a - b) for a, b in zip(got, plain_scores(reward_model, texts))) < 1e-5


def test_a_reward_model_mixes_with_functions_and_weights(reward_model):
    funcs = load_reward_funcs(["length", {"model": str(reward_model), "weight": 0.5, "name": "rm"}])
    total, per = score(funcs, ["TITLE: a", "TITLE: b"], [" yes", " no"], {})
    assert set(per) == {"length", "rm"}
    torch.testing.assert_close(total, per["length"] + 0.5 * per["rm"])


def test_a_folder_that_is_not_a_reward_model_is_one_line(tmp_path, tiny_model_dir):
    with pytest.raises(RewardError, match=r"reward_funcs: reward model .*: Qwen2ForCausalLM is not a "
                                          r"sequence-classification model"):
        load_reward_funcs([{"model": str(tiny_model_dir)}])
    two = tmp_path / "two"
    two.mkdir()
    (two / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForSequenceClassification"],
                                                 "id2label": {"0": "a", "1": "b"}}))
    with pytest.raises(RewardError, match="2 outputs; a reward model has one"):
        load_reward_funcs([str(two)])
    with pytest.raises(RewardError, match=r"unknown key\(s\) \['kwargs'\]"):
        load_reward_funcs([{"model": str(two), "kwargs": {}}])


@pytest.mark.slow
def test_a_reward_model_and_a_function_train_on_two_ranks(tmp_path, reward_model):
    """The same model loaded whole on each rank and sharded by ZeRO-3 over both ranks scores alike."""
    out = tmp_path / "out"
    funcs = (f"[{{func: length, weight: 1.0}}, {{model: '{reward_model}', weight: 0.5}}, "
             f"{{model: '{reward_model}', sharded: true, name: sharded-rm, weight: 0.5}}]")
    torchrun(2, ["-m", "grpo_recipe.train", "--config", "grpo_recipe/configs/quickstart.yaml", "--max_steps", "2",
                 "--num_iterations", "1", "--max_completion_length", "8", "--disable_tqdm", "true",
                 "--reward_funcs", funcs, "--output_dir", str(out)])
    records = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    assert all(isinstance(r["reward/tiny-rm"], float) and r["reward/tiny-rm"] == r["reward/tiny-rm"] for r in records)
    for r in records:
        assert r["reward/sharded-rm"] == pytest.approx(r["reward/tiny-rm"], abs=1e-5)


def test_a_sharded_reward_model_scores_uneven_batches_on_two_ranks(tmp_path, reward_model):
    """ZeRO-3 over 2 ranks, rank 0 with 3 texts and rank 1 with 5 (batches of 2: 2 and 3 forwards), a failing
    function listed first that fails on rank 1 only: the sharded model scores first (else rank 0 would wait in its
    collectives for rank 1, which stopped at the failure), every rank's scores equal transformers' forward."""
    out = tmp_path / "scores.json"
    torchrun(2, ["tests/dist_reward_model.py", str(reward_model), str(out)])
    got = json.loads(out.read_text())
    for rank, (texts, scores, error) in enumerate(got):
        assert len(texts) == 3 + 2 * rank
        assert max(abs(a - b) for a, b in zip(scores, plain_scores(reward_model, texts))) < 1e-5
        assert ("'fails' raised ValueError: only here" in error) == (rank == 1), error
