"""Reward functions used by the tests (good and bad)."""
import asyncio

import numpy as np
import torch


def numpy_ones(prompts, completions, **kw):
    return np.ones(len(completions))


def tensor_twos(prompts, completions, **kw):
    return torch.full((len(completions),), 2.0)


def raises(prompts, completions, **kw):
    return [1 / 0 for _ in completions]


def wrong_count(prompts, completions, **kw):
    return [0.0]


def has_nan(prompts, completions, **kw):
    return [float("nan") if i == 1 else 0.0 for i in range(len(completions))]


def has_none(prompts, completions, **kw):
    return [None if i == 2 else 1.0 for i in range(len(completions))]


def not_a_list(prompts, completions, **kw):
    return 1.0


def none_for_odd(prompts, completions, **kw):
    """Applies to even samples only."""
    return [None if i % 2 else 10.0 for i in range(len(completions))]


def always_none(prompts, completions, **kw):
    return [None] * len(completions)


def echo_inputs(prompts, completions, completion_ids, **columns):
    """Records what a reward function receives (for the calling-convention test)."""
    RECEIVED.append({"prompts": prompts, "completions": completions, "completion_ids": completion_ids, **columns})
    return [0.0] * len(completions)


RECEIVED: list[dict] = []
_STARTED: dict[str, asyncio.Event] = {}  # cleared by the test that uses it


async def _wait_for_partner(me: str, partner: str, n: int) -> list[float]:
    """Signals that it started, then waits (bounded) until its partner has started too: awaited one after
    the other, the first would time out, because its partner cannot start before it returns."""
    for name in (me, partner):
        _STARTED.setdefault(name, asyncio.Event())
    _STARTED[me].set()
    await asyncio.wait_for(_STARTED[partner].wait(), timeout=30)
    return [1.0] * n


async def async_a(prompts, completions, **kw):
    return await _wait_for_partner("a", "b", len(completions))


async def async_b(prompts, completions, **kw):
    return await _wait_for_partner("b", "a", len(completions))


async def async_raises(prompts, completions, **kw):
    raise KeyError("missing")


def huge(prompts, completions, **kw):
    return [1e308 if i == 1 else 0.0 for i in range(len(completions))]


def exits_on_rank1(prompts, completions, **kw):
    import os
    import sys

    if os.environ.get("RANK") == "1":
        sys.exit(3)
    return [0.0] * len(completions)


_calls = [0]


def fill_disk(prompts, completions, path: str = "", at_call: int = 2, leave: int = 0, inodes: bool = False, **kw):
    """A zero reward that, on its `at_call`-th call, fills the filesystem holding `path` (rank 0 only) until
    `leave` bytes (or with inodes, `leave` inodes) are free: a disk that fills while the run goes on."""
    import os

    _calls[0] += 1
    if _calls[0] == at_call and os.environ.get("RANK", "0") == "0":
        os.makedirs(path, exist_ok=True)
        if inodes:
            made = []
            try:
                while True:
                    made.append(os.path.join(path, f"i{len(made)}"))
                    open(made[-1], "w").close()
            except OSError:
                made.pop()
            for name in made[:leave]:
                os.remove(name)
        else:
            st = os.statvfs(path)
            with open(os.path.join(path, "ballast"), "wb") as f:
                os.posix_fallocate(f.fileno(), 0, max(st.f_bavail * st.f_frsize - leave, 1))
    return [0.0] * len(completions)


_hang_calls = [0]


def hangs(prompts, completions, ranks: str = "all", at_call: int = 1, **kw):
    """A reward that, from its `at_call`-th call on, sleeps forever on `ranks` ("all" or one rank number): user
    code that hangs. Elsewhere a zero reward."""
    import os
    import time

    _hang_calls[0] += 1
    if _hang_calls[0] >= at_call and (ranks == "all" or str(ranks) == os.environ.get("RANK", "0")):
        while True:
            time.sleep(3600)
    return [0.0] * len(completions)


def trl_values(prompts, completions, **kw):
    """What TRL's reward loop takes as it is: a bool, a numpy scalar, a 0-d tensor, NaN (not applicable), an int."""
    import numpy as np
    import torch

    return [True, np.float32(0.5), torch.tensor(2.0), float("nan"), 3][:len(completions)]


def has_inf(prompts, completions, **kw):
    return [float("inf") if i == 1 else 0.0 for i in range(len(completions))]
