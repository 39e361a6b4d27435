"""Named wall-clock phases of a rollout (generate, score, old_logp, train, ...): the metrics report them and
the reuse rule (algo/reuse.py) prices a fresh rollout from them."""
from __future__ import annotations

import time
from contextlib import contextmanager


class Timer:
    """Accumulates named wall-clock durations until `pop`."""

    def __init__(self):
        self.totals: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.totals[name] = self.totals.get(name, 0.0) + time.perf_counter() - t0

    def pop(self, *names: str) -> dict[str, float]:
        return {f"time_{n}_s": self.totals.pop(n, 0.0) for n in names}
