"""A collective that fails or times out (`collective_timeout_s`) ends the run with one line naming the rank
that stopped answering, instead of a traceback that says only "Timed out waiting ... for recv".

Each rank bumps a counter in the rendezvous store from a daemon thread every HEARTBEAT_S seconds; a
stopped, dead or cut-off rank's counter stands still. The rank that sees a collective fail compares the
counters over a few beats and names the silent ranks. The store is the launcher's (local.sh, the Slurm
script, torchrun), so it still answers when rank 0 is the one that stopped. With the heartbeat each rank also
publishes what it is doing (`set_phase`: generation, a reward function, training), so a rank that still
answers but is stuck is named with its phase and how long it has been in it.
"""
from __future__ import annotations

import atexit
import datetime
import os
import sys
import threading
import time
import traceback

HEARTBEAT_S = 2.0
WATCH_BEATS = 3  # a counter that did not move over this many beats belongs to a rank that stopped answering
FAILED_EXIT_CODE = 1
_KEY = "grpo/alive/{}"
_PHASE_KEY = "grpo/phase/{}"
_run: dict = {}  # rank, world size and timeout of this process's run, once its process group is up
_phase = {"text": "start-up", "since": time.time()}  # what this rank is doing, published with the heartbeat


def set_phase(text: str) -> None:
    """What this rank does from now on, e.g. "rollout 3: reward 'correctness'" (named if a collective times out);
    a phase spent in collectives says "(all ranks)": the rank the others wait for is one that is not."""
    _phase.update(text=text, since=time.time())


def _store(timeout_s: float):
    import torch.distributed as dist

    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)


def _beat(rank: int, stop: threading.Event) -> None:
    store, published = None, None
    while not stop.is_set():
        try:
            store = store or _store(10.0)
            store.add(_KEY.format(rank), 1)
            phase = (_phase["text"], _phase["since"])
            if phase != published:
                store.set(_PHASE_KEY.format(rank), f"{phase[1]:.3f} {phase[0]}")
                published = phase
        except Exception:  # noqa: BLE001 -- the store may be gone at the end of a run: try again later
            store, published = None, None
        stop.wait(HEARTBEAT_S)


def phases(world: int) -> dict[int, tuple[str, float]] | None:
    """Each rank's published phase and seconds in it; None when the store cannot be asked."""
    try:
        store, now = _store(5.0), time.time()
        out = {}
        for r in range(world):
            if store.check([_PHASE_KEY.format(r)]):
                since, _, text = store.get(_PHASE_KEY.format(r)).decode().partition(" ")
                out[r] = (text, now - float(since))
        return out
    except Exception:  # noqa: BLE001
        return None


def start(rank: int, world: int, timeout_s: float) -> None:
    """Remember the run for `describe` and start this rank's heartbeat (multi-rank runs with a TCP store)."""
    _run.update(rank=rank, world=world, timeout_s=timeout_s)
    if world > 1 and "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
        stop = threading.Event()
        thread = threading.Thread(target=_beat, args=(rank, stop), name="grpo-heartbeat", daemon=True)
        thread.start()
        # stopped before interpreter teardown: a daemon thread caught inside the store's C++ call then aborts
        atexit.register(lambda: (stop.set(), thread.join(timeout=15.0)))


def silent_ranks(rank: int, world: int) -> list[int] | None:
    """The other ranks whose heartbeat stood still for WATCH_BEATS beats; None when the store cannot be asked."""
    try:
        store = _store(5.0)
        before = [store.add(_KEY.format(r), 0) for r in range(world)]
        time.sleep(WATCH_BEATS * HEARTBEAT_S)
        after = [store.add(_KEY.format(r), 0) for r in range(world)]
    except Exception:  # noqa: BLE001 -- unreachable store: said so in the message
        return None
    return [r for r in range(world) if r != rank and after[r] == before[r]]


def is_collective_failure(e: BaseException) -> bool:
    import torch.distributed as dist

    text = str(e)
    return isinstance(e, getattr(dist, "DistError", ())) or isinstance(e, RuntimeError) and any(
        s in text for s in ("Timed out waiting", "Connection closed by peer", "Connection reset by peer",
                            # gloo's words when a coalesced all-gather's wait() times out (seen in CI)
                            "Application timeout caused pair closure", "Socket Timeout", "gloo", "NCCL"))


def describe(e: BaseException) -> str:
    rank, world, timeout_s = _run["rank"], _run["world"], _run["timeout_s"]
    silent = silent_ranks(rank, world)
    if silent is None:
        who = "the rendezvous store does not answer either (the process hosting it may be the one that stopped)"
    elif silent:
        who = f"rank {', '.join(map(str, silent))} stopped answering (no heartbeat for {WATCH_BEATS * HEARTBEAT_S:g} s)"
    else:
        where = phases(world) or {}
        # the others wait (in a phase marked "(all ranks)", a collective) for a rank doing its own work
        working = {r: v for r, v in where.items() if "(all ranks)" not in v[0]} or where
        stuck = max(working.items(), key=lambda kv: kv[1][1]) if working else None
        doing = "; ".join(f"rank {r}: {t} for {s:.0f} s" for r, (t, s) in sorted(where.items()))
        who = (f"every rank still answers, so one is stuck or slow: rank {stuck[0]} in {stuck[1][0]!r} for "
               f"{stuck[1][1]:.0f} s ({doing}); fix what it runs, or raise collective_timeout_s if that is "
               f"legitimate") if stuck else \
            "every rank still answers, so one is stuck or slow (raise collective_timeout_s if that is legitimate)"
    first_line = (str(e).strip().splitlines() or [type(e).__name__])[-1][:200]
    return (f"error (rank {rank}): a collective failed or did not complete within collective_timeout_s = "
            f"{timeout_s:g} s: {who}; ending the run (resume from the last checkpoint) [{first_line}]")


def guarded(main) -> int:
    """Run `main`; a failed collective becomes one line naming the silent ranks and a non-zero exit code."""
    try:
        return main()
    except Exception as e:
        if not _run or _run["world"] == 1 or not is_collective_failure(e):
            raise
        print(describe(e), file=sys.stderr, flush=True)
        return FAILED_EXIT_CODE


def run_and_exit(main) -> None:
    """A rank's entry point: `guarded(main)`, then end the process at once with its exit code (an exception:
    its traceback and 1). Everything is written by then; interpreter teardown is skipped because destructors
    of gloo/DeepSpeed background threads occasionally abort there ("terminate called without an active
    exception", seen in CI in several per-rank scripts) and turn a finished rank into a failed one."""
    try:
        code = guarded(main)
    except SystemExit as e:  # sys.exit(n) or sys.exit("message") inside main
        if e.code is None or isinstance(e.code, int):
            code = e.code
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 -- printed, then the exit code says it
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)
