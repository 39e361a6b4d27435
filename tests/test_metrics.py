"""Metrics: the JSONL reading rule (a torn last line is a write in progress), the logger's cut back to a
resumed step, the bar per optimizer step, completion samples, the reward quarters, the timer."""
import json

import pytest

from grpo_recipe.algo.clock import Timer
from grpo_recipe.run.metrics import MetricsLogger, read_jsonl, reward_quarters, sample_rows


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


def test_bar_advances_every_optimizer_step_whatever_logging_steps_is(tmp_path):
    logger = MetricsLogger(tmp_path, rank=0, total_steps=6)
    for step in range(1, 7):
        record = {"step": step, "reward_mean": 0.5, "loss": 0.0}
        if step % 4 == 0:  # logging_steps 4: one line written
            logger.log(record)
        logger.advance(record)
    assert logger.bar.n == 6
    logger.close()
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [4]


def test_completion_samples_are_rows_with_rewards_and_advantages_and_resume_cuts_them(tmp_path):
    import torch

    prompts, texts = ["p0", "p0", "p1", "p1"], ["a", "bb", "ccc", "dddd"]
    rewards, adv = torch.tensor([1.0, 0.0, 0.5, 0.5]), torch.tensor([0.7, -0.7, 0.0, 0.0])
    per_func = {"length": torch.tensor([-1.0, -2.0, -3.0, -4.0]),
                "accuracy": torch.tensor([1.0, 0.0, float("nan"), 1.0])}
    rows = sample_rows(5, prompts, texts, rewards, per_func, adv, count=3)
    assert rows[1] == {"generation": 5, "prompt": "p0", "completion": "bb", "reward": 0.0, "reward/length": -2.0,
                       "reward/accuracy": 0.0, "advantage": pytest.approx(-0.7)}
    assert len(rows) == 3 and rows[2]["reward/accuracy"] is None  # accuracy returned None for it
    logger = MetricsLogger(tmp_path, rank=0, total_steps=4, disable_tqdm=True)
    logger.log_completions(2, rows)
    logger.log_completions(4, rows[:1])
    logger.close()
    got = read_jsonl(tmp_path / "completions.jsonl")
    assert [r["step"] for r in got] == [2, 2, 2, 4] and got[0] == {"step": 2, **rows[0]}
    MetricsLogger(tmp_path, rank=0, total_steps=4, initial_step=3, disable_tqdm=True).close()  # resumed at 3
    assert [r["step"] for r in read_jsonl(tmp_path / "completions.jsonl")] == [2, 2, 2]
    MetricsLogger(tmp_path / "other", rank=1, total_steps=4).log_completions(2, rows)  # only rank 0 writes
    assert not (tmp_path / "other").exists()


def test_reward_quarters_skip_an_eval_only_line():
    records = [{"step": 0, "eval/greedy/reward": 9.0}] + [{"step": s, "reward_mean": float(s)} for s in range(1, 9)]
    assert reward_quarters(records) == (1.5, 7.5)
