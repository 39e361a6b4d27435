"""The built-in tiny models: built offline, cached atomically, one tokenizer for the plain ones."""
import json

import pytest

from grpo_recipe.model import tiny


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("GRPO_RECIPE_CACHE", str(tmp_path))
    return tmp_path


def test_each_builtin_has_its_shape_and_vllm_compatible_heads(cache, monkeypatch):
    # The tools model's build, warm-up included, in a fresh cache; 2 warm-up steps, not 150 (minutes of CI): what
    # the full warm-up teaches, the tools quickstart shows (tests/test_tools.py)
    monkeypatch.setattr(tiny, "TOOLS_WARMUP", (2, tiny.TOOLS_WARMUP[1]))
    folders = {name: tiny.ensure_builtin(name) for name in tiny.BUILTIN_MODELS}
    for name, folder in folders.items():
        cfg = json.loads((folder / "config.json").read_text())
        hidden, intermediate, heads, kv_heads = tiny.BUILTIN_MODELS[name]
        assert (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"],
                cfg["num_key_value_heads"]) == (hidden, intermediate, heads, kv_heads)
        assert hidden // heads == 32  # vLLM's CPU attention needs a supported head size
        assert folder.parent == cache
    plain = {(f / "tokenizer.json").read_text() for n, f in folders.items() if n != "builtin:tiny-qwen2-tools"}
    assert len(plain) == 1  # same tokenizer: runs on either plain model see the same token ids
    # the tools model's: ChatML's markers and tool-call tags as special tokens, <|im_end|> ending a turn
    tools = json.loads((folders["builtin:tiny-qwen2-tools"] / "tokenizer.json").read_text())
    assert [t["content"] for t in tools["added_tokens"]] == [tiny.EOS, *tiny.CHATML]
    tools_cfg = json.loads((folders["builtin:tiny-qwen2-tools"] / "tokenizer_config.json").read_text())
    assert tools_cfg["eos_token"] == "<|im_end|>"
    before = {f: (f / "model.safetensors").stat().st_mtime_ns for f in folders.values()}
    assert {tiny.ensure_builtin(n) for n in tiny.BUILTIN_MODELS} == set(before)  # cached, not rebuilt
    assert all((f / "model.safetensors").stat().st_mtime_ns == t for f, t in before.items())


def test_unknown_builtin_is_refused():
    with pytest.raises(ValueError, match="unknown built-in"):
        tiny.ensure_builtin("builtin:tiny-huge")


def test_incomplete_cache_folder_is_rebuilt_complete(cache, capfd):
    # What a 2-rank race used to leave: rank 1's folder, with only the tokenizer files (no config, no weights).
    target = cache / f"tiny-qwen2-{tiny.VERSION}"
    tiny.build_tokenizer().save_pretrained(target)
    assert tiny.missing_files(target) == ["config.json", "model.safetensors"]
    assert tiny.ensure_builtin("builtin:tiny-qwen2") == target
    assert tiny.missing_files(target) == []
    assert "lacks config.json, model.safetensors" in capfd.readouterr().err
    (target / "model.safetensors").write_bytes(b"\0" * 64)  # torn weights
    tiny.ensure_builtin("builtin:tiny-qwen2")
    assert tiny.missing_files(target) == []
    config = json.loads((target / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]  # TRL and vLLM pick the class from it
    del config["architectures"]
    (target / "config.json").write_text(json.dumps(config))
    assert tiny.missing_files(target) == ["config.json's architectures"]
    tiny.ensure_builtin("builtin:tiny-qwen2")
    assert tiny.missing_files(target) == []
    (target / "tokenizer.json").unlink()  # without it AutoTokenizer would build another tokenizer, silently
    assert tiny.missing_files(target) == ["tokenizer.json"]
    tiny.ensure_builtin("builtin:tiny-qwen2")
    assert tiny.missing_files(target) == [] and "lacks tokenizer.json" in capfd.readouterr().err


def test_saved_weights_load_back_identical_with_tied_head_named_as_embeddings(cache):
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    folder = tiny.ensure_builtin("builtin:tiny-qwen2")
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    assert "model.embed_tokens.weight" in keys and "lm_head.weight" not in keys  # as vLLM's loader expects
    loaded = AutoModelForCausalLM.from_pretrained(folder).state_dict()
    built = tiny.build_model(tiny.build_tokenizer()).state_dict()
    assert loaded.keys() == built.keys() and all(torch.equal(loaded[k], built[k]) for k in built)


@pytest.mark.parametrize("start", ["empty", "incomplete"])
def test_two_rank_run_from_an_empty_or_incomplete_cache(tmp_path, start):
    from conftest import torchrun

    from grpo_recipe.run.metrics import read_jsonl

    cache = tmp_path / "cache"
    if start == "incomplete":
        tiny.build_tokenizer().save_pretrained(cache / f"tiny-qwen2-{tiny.VERSION}")
    out = tmp_path / "out"
    proc = torchrun(2, ["-m", "grpo_recipe.train", "--config", "grpo_recipe/configs/quickstart.yaml", "--max_steps", "2",
                        "--per_device_train_batch_size", "4", "--num_generations", "4", "--max_completion_length", "8",
                        "--disable_tqdm", "true", "--output_dir", str(out)], GRPO_RECIPE_CACHE=cache)
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [1, 2]
    assert tiny.missing_files(cache / f"tiny-qwen2-{tiny.VERSION}") == []
    assert ("lacks config.json" in proc.stderr) == (start == "incomplete")
