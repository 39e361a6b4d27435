"""bench/reuse_store.py: `--keep` replaces exactly the (regime, variant, seed) runs redone and keeps the commands
whose runs are still stored."""
import copy
import json
import sys

from conftest import REPO

sys.path.insert(0, str(REPO / "bench"))
from reuse_store import load_runs, merge, runs_of, save_runs  # noqa: E402

REGIMES = ["a", "b"]


def run(regime, variant, seed, tag="old"):
    return {"regime": regime, "variant": variant, "seed": seed, "tag": tag}


def stored(runs, commands):
    return {"runs": runs, "commands": commands, "regimes": {r: {"budget_s": 10} for r in REGIMES}}


def test_runs_of_reads_flags_and_defaults():
    assert runs_of("python x.py --regimes b --variants 1 4+kl --seeds 3 --keep", REGIMES) == [
        ("b", "1", 3), ("b", "4+kl2e-3", 3)]  # an earlier variant name is read as today's
    assert len(runs_of("python x.py", REGIMES)) == 2 * 5 * 3  # every regime, the default variants and seeds


def test_merge_replaces_redone_runs_and_drops_spent_commands():
    first = "python x.py --regimes a --variants 1 2 --seeds 0"
    second = "python x.py --regimes a b --variants 1 --seeds 0 1"
    old = stored([run("a", "1", 0), run("a", "2", 0), run("a", "1", 1), run("b", "1", 0), run("b", "1", 1)],
                 [first, second])
    # redo a's mu = 1 seed 0: the first command still made a's mu = 2, so it stays
    runs, commands = merge(copy.deepcopy(old), [run("a", "1", 0, "new")], ["third"], REGIMES)
    assert sorted((r["regime"], r["variant"], r["seed"], r["tag"]) for r in runs) == [
        ("a", "1", 0, "new"), ("a", "1", 1, "old"), ("a", "2", 0, "old"), ("b", "1", 0, "old"), ("b", "1", 1, "old")]
    assert commands == [first, second, "third"] and all(r["budget_s"] == 10 for r in runs if r["tag"] == "old")
    # redo a's mu = 2 too: every run the first command made now comes from later ones, so it is history
    runs, commands = merge(copy.deepcopy(old), [run("a", "1", 0, "new"), run("a", "2", 0, "new")], ["third"], REGIMES)
    assert commands == [second, "third"] and len(runs) == 5


def test_stored_map_needs_every_command_it_lists():
    old = json.loads((REPO / "bench" / "results" / "reuse_regimes.json").read_text())
    old["runs"] = load_runs(old, REPO / "bench" / "results" / "reuse_regimes")
    runs, commands = merge(copy.deepcopy(old), [], [], sorted({r["regime"] for r in old["runs"]}))
    assert commands == old["commands"] and len(runs) == len(old["runs"])


def test_runs_round_trip_through_their_compressed_files(tmp_path):
    runs = [run("a", "1", 0), run("b", "2", 1)]
    runs[0]["rows"] = [{"reward": 1.5, "time_s": 0.25}, {"reward": 2.0, "time_s": 0.5, "cost_s": 0.75}]
    runs[1]["rows"] = []
    names = save_runs(runs, tmp_path)
    assert names == ["a.json.gz", "b.json.gz"] and load_runs({"runs_files": names}, tmp_path) == runs
