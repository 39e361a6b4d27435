"""The built-in tiny models: built offline, cached atomically, one tokenizer for all of them."""
import json

import pytest

from recipe import tiny


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("GRPO_RECIPE_CACHE", str(tmp_path))
    return tmp_path


def test_each_builtin_has_its_shape_and_vllm_compatible_heads(cache):
    folders = {name: tiny.ensure_builtin(name) for name in tiny.BUILTIN_MODELS}
    for name, folder in folders.items():
        cfg = json.loads((folder / "config.json").read_text())
        hidden, intermediate, heads, kv_heads = tiny.BUILTIN_MODELS[name]
        assert (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"],
                cfg["num_key_value_heads"]) == (hidden, intermediate, heads, kv_heads)
        assert hidden // heads == 32  # vLLM's CPU attention needs a supported head size
        assert folder.parent == cache
    toks = {(f / "tokenizer.json").read_text() for f in folders.values()}
    assert len(toks) == 1  # same tokenizer: runs on either model see the same token ids
    before = {f: (f / "model.safetensors").stat().st_mtime_ns for f in folders.values()}
    assert {tiny.ensure_builtin(n) for n in tiny.BUILTIN_MODELS} == set(before)  # cached, not rebuilt
    assert all((f / "model.safetensors").stat().st_mtime_ns == t for f, t in before.items())


def test_unknown_builtin_is_refused():
    with pytest.raises(ValueError, match="unknown built-in"):
        tiny.ensure_builtin("builtin:tiny-huge")
