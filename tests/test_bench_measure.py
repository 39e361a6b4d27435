"""bench/measure.py's whole-run sampler: a run that outgrows the memory it may have, or its time, is stopped with
everything it started, which is gone when it returns, and says why."""
import os
import sys

from conftest import REPO
from procs import alive

sys.path.insert(0, str(REPO / "bench"))


def rank_under_a_shell(tmp_path, body: str) -> list[str]:
    """A rank process (RANK in its environment) started by a shell, as a launcher starts one; it writes its pid."""
    script = f"import os, time; open({str(tmp_path / 'pid')!r}, 'w').write(str(os.getpid())); {body}"
    return ["bash", "-c", f'{sys.executable} -c "{script}" & wait']


def test_whole_run_peaks_stops_a_run_whose_ranks_outgrow_the_memory_limit(tmp_path):
    from measure import whole_run_peaks

    cmd = rank_under_a_shell(tmp_path, "b = b'x' * (300 << 20); time.sleep(120)")
    r = whole_run_peaks(cmd, {**os.environ, "RANK": "0"}, tmp_path, memory_limit=100 << 20)
    assert r["stopped"] == "memory" and r["exit_code"] != 0 and r["wall_s"] < 60
    assert max(r["peak_bytes"]) > 100 << 20
    # the rank below the launcher too, not only the launcher, and gone before it returns: its memory is back
    assert not alive(int((tmp_path / "pid").read_text()))


def test_whole_run_peaks_stops_a_run_past_its_time_and_lets_one_within_finish(tmp_path):
    from measure import whole_run_peaks

    env = {**os.environ, "RANK": "0"}
    r = whole_run_peaks(rank_under_a_shell(tmp_path, "time.sleep(120)"), env, tmp_path, timeout_s=2)
    assert r["stopped"] == "timeout" and r["exit_code"] != 0 and 2 <= r["wall_s"] < 60
    r = whole_run_peaks(rank_under_a_shell(tmp_path, "time.sleep(1)"), env, tmp_path, timeout_s=60,
                        memory_limit=1 << 40)
    assert r["stopped"] is None and r["exit_code"] == 0 and len(r["peak_bytes"]) == 1
