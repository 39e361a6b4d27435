"""recipe/liveness.py: which errors count as a failed collective (the end-to-end case, a SIGSTOPped rank, is in
tests/test_launch.py; which of gloo's messages a run sees depends on where the other rank stopped)."""
import pytest

from recipe.liveness import is_collective_failure

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
