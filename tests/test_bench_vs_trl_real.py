"""bench/vs_trl_real.py: its smoke run (every side, the summary, the figure, a later invocation) and the rules
that decide which finished runs a study spanning sessions keeps and pairs."""
import importlib.util
import json
import os
import sys

import pytest
from benchruns import assert_plot, bench, written
from conftest import REPO

sys.path.insert(0, str(REPO / "bench"))


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
    from common import instance

    assert {x["instance"] for x in r["runs"]} == {instance()} and s["by_mu"]["1"]["sides_on_one_instance"]
    # a later invocation on the same instance keeps the finished runs and measures only what is missing (the
    # study spans sessions)
    kept = [x for x in r["runs"] if x["side"] != "floor"]
    (tmp_path / "vs_trl_real.json").write_text(json.dumps({**r, "runs": kept}))
    proc = bench(tmp_path, "vs_trl_real.py", "--smoke", "--out", str(tmp_path), "--workdir", str(tmp_path / "w"),
                 timeout=900)
    again = written(tmp_path / "vs_trl_real.json")
    assert "mu 1 floor" in proc.stderr and "mu 1 trl" not in proc.stderr and "mu 1 ours" not in proc.stderr
    assert again["runs"][:2] == kept and again["runs"][2]["side"] == "floor" and again["complete"]
    assert again["runs"][2]["invocation"] >= kept[0]["invocation"]
    assert again["shapes"]["smollm2"]["by_mu"]["1"]["sides_on_one_instance"]
    # --reread measures nothing: each kept run's figures come again from its logs, the same under the same readers
    proc = bench(tmp_path, "vs_trl_real.py", "--smoke", "--reread", "--out", str(tmp_path), "--workdir",
                 str(tmp_path / "w"), timeout=300)
    reread = written(tmp_path / "vs_trl_real.json")
    assert "mu 1" not in proc.stderr and all(x.pop("reread_at") for x in reread["runs"])
    assert reread["runs"] == again["runs"] and reread["shapes"] == again["shapes"]


def runs_of(instance_of, shapes=("smollm2", "qwen05b"), mus=(1, 4)):
    """One repetition's run records per shape and mu, each side on the instance `instance_of(shape, mu, side)`."""
    return [{"shape": shape, "mu": mu, "rep": 0, "side": side, "instance": instance_of(shape, mu, side)}
            for shape in shapes for mu in mus for side in ("ours", "trl", "floor")]


def test_vs_trl_real_keeps_finished_runs_and_continues_a_repetition_only_on_its_instance():
    from vs_trl_real import kept_runs

    runs = runs_of(lambda *_: "a")
    assert kept_runs(runs, ["smollm2"], [1, 4], False, "b") == runs  # finished repetitions stay, wherever run
    again = [r for r in runs if r not in kept_runs(runs, ["smollm2"], [1], True, "a")]  # --fresh --mus 1
    assert [(r["shape"], r["mu"]) for r in again] == [("smollm2", 1)] * 3
    half = runs[:2]  # smollm2 mu 1: ours and TRL measured, the floor still to go
    assert kept_runs(half, ["smollm2"], [1], False, "a") == half
    assert kept_runs(half, ["smollm2"], [1], False, "b") == []  # another boot: the whole repetition anew
    unstamped = [{k: v for k, v in r.items() if k != "instance"} for r in half]
    assert kept_runs(unstamped, ["smollm2"], [1], False, "a") == []


def test_vs_trl_real_marks_ratios_whose_sides_ran_on_different_instances():
    from vs_trl_real import summarize

    def record(r, sec):
        return {**r, "model": "m", "sec_per_step": sec, "tokens_per_s": 10.0, "peak_bytes": [2**30, 2**30],
                "phases_s_per_step": {"generate": 1.0, "prepare": 1.0, "forward": 1.0, "backward": 1.0, "other": 0}}

    secs = {"ours": 3.0, "trl": 4.0, "floor": 2.0}
    one = summarize([record(r, secs[r["side"]]) for r in runs_of(lambda *_: "a", ["smollm2"], [1])], "smollm2")
    assert one["by_mu"]["1"]["sides_on_one_instance"] and one["step_time_ratio"]["mu1"] == 0.75
    mixed = summarize([record(r, secs[r["side"]]) for r in runs_of(lambda s, m, side: "b" if side == "trl" else "a",
                                                                   ["smollm2"], [1])], "smollm2")
    assert not mixed["by_mu"]["1"]["sides_on_one_instance"] and mixed["floor_ratio"]["mu1"] == 1.5
    unknown = summarize([record(r, secs[r["side"]]) for r in runs_of(lambda *_: None, ["smollm2"], [1])], "smollm2")
    assert not unknown["by_mu"]["1"]["sides_on_one_instance"]


def test_vs_trl_real_pilot_projects_each_mu_from_the_phases_and_leaves_out_a_side_that_did_not_fit():
    from vs_trl import steps_for
    from vs_trl_real import MUS, REPS, TIMED_STEPS, project

    phases = {"ours": (30.0, 10.0, 20.0), "trl": (32.0, 12.0, 25.0), "floor": (28.0, 8.0, 18.0)}
    runs = [{"shape": "qwen05b", "side": side, "mu": 1, "exit_code": 0, "wall_s": 200.0 + 2 * sum(p),
             "train_span_s": 2 * sum(p), "phases_s_per_step": {"generate": p[0] - 1, "prepare": p[0],
                                                               "forward": p[1], "backward": p[2], "other": 0.5}}
            for side, p in phases.items()]
    proj = project(runs)["qwen05b"]
    for side, (prep, fwd, bwd) in phases.items():
        for mu in MUS:
            want = 200.0 + steps_for(TIMED_STEPS + mu, mu) * (prep / mu + fwd + bwd + 0.5)
            assert abs(proj["run_s"][side][str(mu)] - want) < 1e-9
    assert abs(proj["study_h"] - REPS * sum(s[str(mu)] for s in proj["run_s"].values() for mu in MUS) / 3600) < 1e-9
    stopped = [{**r, "exit_code": -9} if r["side"] == "trl" else r for r in runs]
    partial = project(stopped)["qwen05b"]
    assert set(partial["run_s"]) == {"ours", "floor"} and "study_h" not in partial


def test_vs_trl_real_runs_a_subset_of_sides_only_in_a_pilot():
    from vs_trl_real import main

    with pytest.raises(SystemExit, match="--sides is for --pilot only"):
        main(["--sides", "trl"])
