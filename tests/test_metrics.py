"""Metrics: the JSONL reading rule (a torn last line is a write in progress), the logger's cut back to a
resumed step, the reward quarters, the timer."""
import json

import pytest

from recipe.metrics import MetricsLogger, Timer, read_jsonl, reward_quarters


def test_read_jsonl_leaves_out_a_torn_last_line_only(tmp_path):
    path = tmp_path / "m.jsonl"
    assert read_jsonl(path) == []  # no file yet
    path.write_text('{"step": 1}\n\n{"step": 2}\n{"step": 3, "loss": {}')  # killed mid-write
    assert read_jsonl(path) == [{"step": 1}, {"step": 2}]
    path.write_text('{"step": 1}\n{"ste\n{"step": 3}\n')  # a complete line that does not parse is an error
    with pytest.raises(json.JSONDecodeError):
        read_jsonl(path)


def test_logger_resumed_at_a_step_drops_later_lines_and_appends(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3))
                                            + '{"step": 4, "lo')
    logger = MetricsLogger(tmp_path, rank=0, total_steps=5, initial_step=2, disable_tqdm=True)
    logger.log({"step": 3, "loss": float("nan")})
    logger.close()
    assert read_jsonl(tmp_path / "metrics.jsonl") == [{"step": 1}, {"step": 2}, {"step": 3, "loss": None}]


def test_reward_quarters_are_the_means_of_the_first_and_last_quarter():
    records = [{"reward_mean": float(r)} for r in range(8)]
    assert reward_quarters(records) == (0.5, 6.5)
    assert reward_quarters(records[:3]) == (0.0, 2.0)  # fewer than 4 steps: one step each


def test_timer_accumulates_until_popped():
    timer = Timer()
    for _ in range(2):
        with timer("forward"):
            pass
    out = timer.pop("forward", "backward")
    assert set(out) == {"time_forward_s", "time_backward_s"} and out["time_forward_s"] > 0
    assert out["time_backward_s"] == 0.0 and timer.pop("forward") == {"time_forward_s": 0.0}
