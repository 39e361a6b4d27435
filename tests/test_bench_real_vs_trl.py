"""bench/real_vs_trl.py: its smoke run (pilots, variants, verdicts, a run resumed after a cut) and its verdicts'
declared rules on synthetic runs."""
import importlib.util
import json
import os
import sys

import pytest
from benchruns import assert_plot, bench, written
from conftest import REPO


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
