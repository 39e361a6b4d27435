"""The stored runs of a regime map and the commands they came from: `--keep` merges a new invocation's runs into
them, replacing only the (regime, variant, seed) runs it redid and dropping commands none of whose runs remain."""
from __future__ import annotations

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
