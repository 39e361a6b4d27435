"""Greedy evaluation: batched left-padded decoding equals one-prompt-at-a-time decoding, and the reported
accuracy and standard error follow from the per-sample scores."""
import json

import pytest
import torch

from grpo_recipe.tools.evaluate import evaluate, main


def test_batched_greedy_matches_single_prompt_decoding_and_accuracy(tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    prompts = ["TL;DR: a", "Post: my cat sat on the keyboard and", "x", "Summarize this short post", "TL;DR"]
    singles = []
    for p in prompts:  # the independent computation: no padding, no batching
        ids = tok(p, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, do_sample=False, max_new_tokens=6, eos_token_id=tok.eos_token_id,
                                 pad_token_id=tok.pad_token_id)
        singles.append(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    # answers: right for the first three, wrong for the last two -> accuracy 3/5
    rows = [{"prompt": p, "answer": s if i < 3 else s + "#"} for i, (p, s) in enumerate(zip(prompts, singles))]
    data = tmp_path / "eval.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = evaluate(str(tiny_model_dir), str(data), reward="accuracy", max_new_tokens=6, batch_size=2)
    assert [s["completion"] for s in res["samples"]] == singles
    assert (res["n"], res["correct"]) == (5, 3)
    assert res["accuracy"] == pytest.approx(0.6) and res["stderr"] == pytest.approx((0.6 * 0.4 / 5) ** 0.5)


def test_bad_input_is_one_line(tmp_path, tiny_model_dir, capsys):
    assert main(["--model", str(tiny_model_dir), "--data", str(tmp_path / "missing.jsonl")]) == 2
    assert "missing.jsonl" in capsys.readouterr().err
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"question": "q", "answer": "1"}) + "\n")
    assert main(["--model", str(tiny_model_dir), "--data", str(data)]) == 2
    assert "prompt_column" in capsys.readouterr().err
