"""Stop signals and time bounds for user code.

Stop signals (SIGTERM, SIGUSR1: preemption, Slurm's warning) are recorded from the first moment of a rank's life,
so that one arriving during start-up is not lost: the run acts on it at its next safe point (before the process
group starts, after setup, after each optimizer step).

User code (a reward function) runs `bounded`: inside, a stop signal or the time bound raises `Interrupted` in
the main thread, which cuts short sleeps, system calls and Python loops, and the run goes on to its safe point
with a message naming the function. Code stuck in C that never returns to Python is ended by a watchdog thread
after GRACE_S more: the process writes the line and exits (1; 75 when a stop signal was the reason). C code that
also holds the GIL (a verifier evaluating `sum(range(10**12))`) stops every Python thread, that watchdog included:
faulthandler's own watchdog, a C thread that needs no GIL, then ends the process C_GUARD_S later still, with the
stuck code's traceback on stderr and exit code 1 (arming and cancelling it cost microseconds a call:
tests/test_signals.py).
Standard library only: installed before torch loads.
"""
from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import sys
import threading
import time

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
GRACE_S = 30.0  # how long user code that ignores the interruption may still run before the process ends
C_GUARD_S = 10.0  # then, if even the Python watchdog could not run (the GIL held), faulthandler's ends it
_received: list[tuple[str, float]] = []
_inside: dict = {}  # the bounded section running now: what, since, timeout_s


class Interrupted(BaseException):  # not an Exception: a user's `except Exception` must not swallow it
    """User code was cut short: by a stop signal (`signal` set) or by its time bound."""

    def __init__(self, message: str, signal_name: str | None = None):
        super().__init__(message)
        self.signal = signal_name


def _record(signum, frame) -> None:
    name = signal.Signals(signum).name
    _received.append((name, time.monotonic()))
    if _inside and threading.current_thread() is threading.main_thread():
        raise Interrupted(f"stopped by {name} while {_inside['what']} ran", name)


def _alarm(signum, frame) -> None:
    if _inside:
        raise Interrupted(f"{_inside['what']} did not return within {_inside['timeout_s']:g} s")


def catch() -> None:
    """Record stop signals instead of dying of them (again after a library installed its own handlers)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, _record)


def pending() -> str | None:
    """The first stop signal this process received, or None."""
    return _received[0][0] if _received else None


@contextlib.contextmanager
def bounded(what: str, timeout_s: float | None):
    """Run the block as user code named `what`, within `timeout_s` seconds (None or 0: no bound); see above."""
    main = threading.current_thread() is threading.main_thread()
    if not main:  # signals reach the main thread only: nothing to bound here
        yield
        return
    if pending():  # already asked to stop: do not start user code
        raise Interrupted(f"stopped by {pending()} before {what} ran", pending())
    _start_watchdog()
    previous = signal.signal(signal.SIGALRM, _alarm)
    _inside.update(what=what, since=time.monotonic(), timeout_s=timeout_s or 0.0)
    if timeout_s:
        signal.setitimer(signal.ITIMER_REAL, timeout_s)
        faulthandler.dump_traceback_later(timeout_s + GRACE_S + C_GUARD_S, exit=True, file=sys.__stderr__)
    try:
        yield
    finally:
        if timeout_s:
            faulthandler.cancel_dump_traceback_later()
        signal.setitimer(signal.ITIMER_REAL, 0)
        _inside.clear()
        signal.signal(signal.SIGALRM, previous)


_watchdog: list[threading.Thread] = []


def _start_watchdog() -> None:
    if not _watchdog:
        _watchdog.append(threading.Thread(target=_watch, name="grpo-user-code-watchdog", daemon=True))
        _watchdog[0].start()


def _watch() -> None:
    """End the process when bounded code ignored its interruption for GRACE_S (stuck in C, signals masked)."""
    while True:
        time.sleep(1.0)
        inside = dict(_inside)
        if not inside:
            continue
        now, rank = time.monotonic(), os.environ.get("RANK", "0")
        stop = [t for _, t in _received if t >= inside["since"]]
        if stop and now - stop[0] > GRACE_S:
            why, code = f"stopped by {pending()}, but {inside['what']} did not return within {GRACE_S:g} s", 75
        elif inside["timeout_s"] and now - inside["since"] > inside["timeout_s"] + GRACE_S:
            why, code = f"{inside['what']} did not return within {inside['timeout_s']:g} s and ignored the " \
                        f"interruption", 1
        else:
            continue
        sys.stderr.write(f"error (rank {rank}): {why}; ending this process (exit {code}) without a new "
                         f"checkpoint: the last one is intact\n")
        sys.stderr.flush()
        os._exit(code)
