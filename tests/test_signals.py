"""grpo_recipe/dist/signals.py: bounded user code is cut short by a stop signal (a user's catch-all cannot swallow
it) and ended by the watchdog when it ignores the interruption. End to end (a hanging reward on every rank or one,
SIGTERM during the hang, signals during start-up): tests/test_launch.py."""
import subprocess
import sys
import time

import pytest
from conftest import REPO

from grpo_recipe.dist.env import rank_env


def test_user_code_that_ignores_its_interruption_is_ended_by_the_watchdog(tmp_path):
    """A reward stuck where no signal reaches it (here: signals blocked, as in C code that masks them): after its
    bound and the grace, the process writes the line and exits 1 by itself."""
    code = ("import signal, time\nfrom grpo_recipe.dist import signals\nsignals.GRACE_S = 1.0\n"
            "with signals.bounded(\"reward 'stuck'\", 0.5):\n"
            "    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM, signal.SIGTERM})\n"
            "    time.sleep(60)\n")
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=rank_env(RANK="3"), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 1 and time.monotonic() - started < 20, proc.stderr
    assert "error (rank 3): reward 'stuck' did not return within 0.5 s and ignored the interruption" in proc.stderr


def test_a_stop_signal_cuts_bounded_user_code_short_and_a_user_except_cannot_swallow_it():
    import os
    import signal

    from grpo_recipe.dist import signals

    signals.catch()
    try:
        with pytest.raises(signals.Interrupted, match="stopped by SIGUSR1 while reward 'sleepy' ran"):
            with signals.bounded("reward 'sleepy'", None):
                try:
                    os.kill(os.getpid(), signal.SIGUSR1)
                    time.sleep(30)
                except Exception:  # a user's catch-all
                    pass
        assert signals.pending() == "SIGUSR1"
    finally:
        signals._received.clear()
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)


def test_user_code_that_holds_the_gil_in_c_is_ended_by_faulthandlers_watchdog():
    """`sum(range(10**12))` never returns to Python and never lets another thread run: neither the alarm nor the
    Python watchdog can act. faulthandler's C watchdog ends the process (exit 1) with the stuck line's traceback."""
    code = ("from grpo_recipe.dist import signals\nsignals.GRACE_S, signals.C_GUARD_S = 1.0, 1.0\n"
            "def verifier():\n    return sum(range(10**13))\n"
            "with signals.bounded(\"reward 'verifier'\", 0.5):\n    verifier()\n")
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=rank_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1 and time.monotonic() - started < 30, proc.stderr
    assert "Timeout (0:00:02.500000)!" in proc.stderr and "in verifier" in proc.stderr, proc.stderr


def test_the_c_level_guard_costs_microseconds_a_call():
    from grpo_recipe.dist import signals

    n = 200
    t0 = time.perf_counter()
    for _ in range(n):
        with signals.bounded("reward 'quick'", 60.0):
            pass
    per_call = (time.perf_counter() - t0) / n
    print(f"bounded() with its guards: {per_call * 1e6:.0f} us a call")
    assert per_call < 0.01  # a reward function is called once per rollout
