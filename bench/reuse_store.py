"""The stored runs of a regime map and the commands they came from: `--keep` merges a new invocation's runs into
them, replacing only the (regime, variant, seed) runs it redid and dropping commands none of whose runs remain.

The runs live beside the summary, one compressed file per regime (RESULT_STEM/REGIME.json.gz, each run's rows
as columns), so that the summary JSON stays small and readable."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

RENAMED = {"4+kl": "4+kl2e-3"}  # variant names of earlier result files


def run_key(run: dict) -> tuple[str, str, int]:
    return run["regime"], run["variant"], run["seed"]


def runs_of(command: str, all_regimes: list[str]) -> list[tuple[str, str, int]]:
    """The (regime, variant, seed) runs a stored command made (older commands without --variants ran the
    defaults, without --regimes every regime)."""
    words = command.split()

    def after(flag: str, default: list[str]) -> list[str]:
        if flag not in words:
            return default
        i = words.index(flag) + 1
        return words[i:next((j for j in range(i, len(words)) if words[j].startswith("--")), len(words))]
    variants = [RENAMED.get(v, v) for v in after("--variants", ["1", "2", "4", "8", "auto"])]
    seeds = [int(s) for s in after("--seeds", ["0", "1", "2"])]
    return [(reg, v, s) for reg in after("--regimes", all_regimes) for v in variants for s in seeds]


def merge(old: dict, runs: list[dict], commands: list[str], all_regimes: list[str]) -> tuple[list[dict], list[str]]:
    """The stored result `old` with `runs` (made by `commands`) added: runs and commands to write."""
    for r in old["runs"]:
        r.setdefault("budget_s", old["regimes"][r["regime"]]["budget_s"])
        r["variant"] = RENAMED.get(r["variant"], r["variant"])
    rerun = set(map(run_key, runs))
    kept = [r for r in old["runs"] if run_key(r) not in rerun]
    stored, still = old.get("commands") or [old["command"]], set(map(run_key, kept))
    made = [set(runs_of(c, all_regimes)) for c in stored]
    # a command is history once every stored run it made was redone by a later one (or by this one)
    old_commands = [c for i, c in enumerate(stored) if (still & made[i]) - set().union(*made[i + 1:])]
    return kept + runs, old_commands + commands


def _columns(run: dict) -> dict:
    rows = run["rows"]
    keys = list(dict.fromkeys(k for row in rows for k in row))
    return {**run, "rows": {k: [row.get(k) for row in rows] for k in keys}}


def _rows(run: dict) -> dict:
    cols = run["rows"]
    n = len(next(iter(cols.values()))) if cols else 0
    return {**run, "rows": [{k: v[i] for k, v in cols.items() if v[i] is not None} for i in range(n)]}


def save_runs(runs: list[dict], folder: Path) -> list[str]:
    """Write the runs, one gzip file per regime, into `folder` (emptied first); returns the files' names."""
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("*.json.gz"):
        old.unlink()
    names = []
    for regime in dict.fromkeys(r["regime"] for r in runs):
        name = f"{regime}.json.gz"
        data = json.dumps([_columns(r) for r in runs if r["regime"] == regime], separators=(",", ":"))
        (folder / name).write_bytes(gzip.compress(data.encode(), compresslevel=9, mtime=0))
        names.append(name)
    return names


def load_runs(result: dict, folder: Path) -> list[dict]:
    """The runs of a stored result: from its run files in `folder` (or, in an older result, from the JSON)."""
    if "runs" in result:
        return result["runs"]
    return [_rows(r) for name in result["runs_files"]
            for r in json.loads(gzip.decompress((folder / name).read_bytes()))]
