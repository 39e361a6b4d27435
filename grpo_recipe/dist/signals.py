"""Stop signals (SIGTERM, SIGUSR1: preemption, Slurm's warning) recorded from the first moment of a rank's life,
so that one arriving during start-up is not lost: the run acts on it at its next safe point (before the process
group starts, after setup, after each optimizer step). Standard library only: installed before torch loads."""
from __future__ import annotations

import signal

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
_received: list[str] = []


def _record(signum, frame) -> None:
    _received.append(signal.Signals(signum).name)


def catch() -> None:
    """Record stop signals instead of dying of them (again after a library installed its own handlers)."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, _record)


def pending() -> str | None:
    """The first stop signal this process received, or None."""
    return _received[0] if _received else None
