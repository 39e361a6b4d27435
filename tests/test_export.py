"""grpo_recipe.tools.export: a checkpoint (or an output folder's newest one) to a Hugging Face folder, every file unpickled
with weights_only=True, refused with one line when the checkpoint does not match its manifest."""
import json
import subprocess
import sys

import pytest
import torch
from conftest import REPO

from grpo_recipe.run.checkpoint import _file_sizes, crc32_file
from grpo_recipe.tools.export import main


@pytest.mark.slow
def test_export_gives_the_final_model_of_the_run(hub_run, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ws, _, env, _ = hub_run
    out = tmp_path / "hf"
    proc = subprocess.run([sys.executable, "-m", "grpo_recipe.tools.export", str(ws / "run"), str(out)], cwd=ws, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"{ws / 'run' / 'checkpoints' / 'step-00000002'} -> {out}" in proc.stdout  # the newest one
    exported, final = load_file(out / "model.safetensors"), load_file(ws / "run" / "final" / "model.safetensors")
    assert exported.keys() == final.keys() and all(torch.equal(exported[k], final[k]) for k in final)
    model, tok = AutoModelForCausalLM.from_pretrained(out), AutoTokenizer.from_pretrained(out)
    assert torch.isfinite(model(**tok("TL;DR:", return_tensors="pt")).logits).all()


def fake_checkpoint(folder):
    """A folder with a manifest as Checkpointer.save writes it (the files' contents do not matter here)."""
    (folder / "ds").mkdir(parents=True)
    (folder / "ds" / "shard.pt").write_bytes(bytes(range(256)) * 64)
    (folder / "loop_rank0.pt").write_bytes(b"loop" * 100)
    sizes = _file_sizes(folder)
    meta = {"step": 1, "world_size": 1, "config": {}, "files": sizes,
            "checksums": {rel: crc32_file(folder / rel) for rel in sizes}}
    (folder / "meta.json").write_text(json.dumps(meta))


def test_export_refuses_a_checkpoint_that_does_not_match_its_manifest(tmp_path, capsys):
    ckpt = tmp_path / "run" / "checkpoints" / "step-00000001"
    fake_checkpoint(ckpt)
    shard = ckpt / "ds" / "shard.pt"
    data = bytearray(shard.read_bytes())
    data[100] ^= 1
    shard.write_bytes(bytes(data))
    assert main([str(ckpt), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: {ckpt}: file ds/shard.pt does not match its checksum (corrupt)"
    assert main([str(tmp_path / "nothing"), str(tmp_path / "hf")]) == 2
    assert "not a folder" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()


def test_export_help_runs_without_a_checkpoint():
    proc = subprocess.run([sys.executable, "-m", "grpo_recipe.tools.export", "--help"], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and "weights_only=True" in proc.stdout


@pytest.mark.slow
def test_export_of_a_lora_checkpoint_gives_the_adapter_and_the_merged_model(tmp_path):
    from safetensors.torch import load_file

    from grpo_recipe.dist.env import rank_env

    run = tmp_path / "run"
    train = subprocess.run([sys.executable, "-m", "grpo_recipe.train", "--config", "grpo_recipe/configs/quickstart.yaml",
                            "--max_steps", "1", "--per_device_train_batch_size", "4", "--num_generations", "4",
                            "--max_completion_length", "8", "--disable_tqdm", "true", "--use_peft", "true",
                            "--learning_rate", "0.02", "--save_steps", "1", "--save_merged", "true",
                            "--output_dir", str(run)], cwd=REPO, env=rank_env(), capture_output=True, text=True,
                           timeout=600)
    assert train.returncode == 0, train.stderr[-3000:]
    assert main([str(run / "checkpoints" / "step-00000001"), str(tmp_path / "hf"), "--merged"]) == 0
    for exported, final in (("hf", "final"), ("hf-merged", "final-merged")):
        name = "adapter_model.safetensors" if exported == "hf" else "model.safetensors"
        a, b = load_file(tmp_path / exported / name), load_file(run / final / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), exported
