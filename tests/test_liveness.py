"""grpo_recipe/dist/liveness.py: which errors count as a failed collective (the end-to-end case, a SIGSTOPped rank, is in
tests/test_launch.py; which of gloo's messages a run sees depends on where the other rank stopped), and the exit
codes run_and_exit leaves."""
import os
import subprocess
import sys

import pytest
from conftest import REPO

from grpo_recipe.dist.liveness import is_collective_failure

GLOO_SEEN = [  # each raised by a real 2-rank run whose other rank stopped answering
    "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 20000ms for recv operation",
    "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:5567",
    "Application timeout caused pair closure",  # a coalesced all-gather's handle.wait() in ZeRO-3's step
]


@pytest.mark.parametrize("text", GLOO_SEEN)
def test_gloo_failures_are_collective_failures(text):
    assert is_collective_failure(RuntimeError(text))


@pytest.mark.parametrize("error", [RuntimeError("CUDA out of memory"), ValueError("Timed out waiting"),
                                   KeyError("gloo")])
def test_other_errors_are_not(error):
    assert not is_collective_failure(error)


@pytest.mark.parametrize("body, code, err", [
    ("print('done', end='')", 0, ""),              # a finished rank: its unflushed output kept, exit 0
    ("return 3", 3, ""),                            # main's own exit code (grpo_recipe.train's preemption code)
    ("raise ValueError('bad shard')", 1, "ValueError: bad shard"),  # a traceback and 1, never a silent 0
    ("sys.exit('error: bad config')", 1, "error: bad config"),
    ("sys.exit(4)", 4, ""),
])
def test_run_and_exit_keeps_the_exit_code_and_skips_teardown(tmp_path, body, code, err):
    script = tmp_path / "rank.py"
    script.write_text("import atexit, sys\nfrom grpo_recipe.dist import liveness\n"
                      "atexit.register(lambda: print('TEARDOWN RAN'))\n"
                      f"def main():\n    {body}\n"
                      "liveness.run_and_exit(main)\nprint('after run_and_exit')\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == code, proc.stderr
    assert err in proc.stderr
    assert "TEARDOWN RAN" not in proc.stdout and "after run_and_exit" not in proc.stdout  # nothing after main
    assert proc.stdout == ("done" if body.startswith("print") else "")

