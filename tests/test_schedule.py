"""The learning-rate schedule: the formula at chosen steps, transformers' own schedulers at every step, the warmup
length, the LambdaLR the engine gets, and when a resume may change max_steps. (Once per optimizer step under
gradient accumulation, against a reference: tests/test_update.py; bit-exact resume across the warmup boundary:
tests/test_checkpoint.py; the logged rate: tests/test_train.py.)"""
import math

import pytest
import torch

from grpo_recipe.algo.schedule import depends_on_max_steps, lr_factor, lr_scheduler, warmup_steps
from grpo_recipe.config.schema import Config


def test_factor_at_chosen_steps_follows_the_formula():
    # warmup: step k of W runs at k / W (the first at 0, as in transformers)
    assert [lr_factor(k, "cosine", 10, 4) for k in range(4)] == [0.0, 0.25, 0.5, 0.75]
    # cosine from 1 at the end of warmup to min_lr_ratio at max_steps, (1 + m) / 2 half way
    assert lr_factor(4, "cosine", 10, 4, 0.1) == pytest.approx(1.0)
    assert lr_factor(7, "cosine", 10, 4, 0.1) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_factor(7, "cosine", 10, 4, 0.1) == pytest.approx(0.55)
    assert lr_factor(10, "cosine", 10, 4, 0.1) == pytest.approx(0.1)
    # linear: 1 - (k - W) / (T - W), down to 0
    assert lr_factor(6, "linear", 10, 2) == pytest.approx(0.5) and lr_factor(10, "linear", 10, 2) == 0.0
    assert lr_factor(0, "constant", 10, 0) == 1.0
    assert lr_factor(1, "constant_with_warmup", 10, 3) == pytest.approx(1 / 3)


@pytest.mark.parametrize("total, warmup", [(12, 0), (12, 5), (7, 7), (30, 3)])
def test_every_step_equals_transformers_schedulers(total, warmup):
    from transformers import (
        get_constant_schedule,
        get_constant_schedule_with_warmup,
        get_cosine_with_min_lr_schedule_with_warmup,
        get_linear_schedule_with_warmup,
    )

    def hf_factors(make):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        sched, out = make(opt), []
        for _ in range(total):
            out.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        return out

    expected = {
        "constant_with_warmup": hf_factors(lambda o: get_constant_schedule_with_warmup(o, warmup)),
        "linear": hf_factors(lambda o: get_linear_schedule_with_warmup(o, warmup, total)),
        "cosine": hf_factors(lambda o: get_cosine_with_min_lr_schedule_with_warmup(o, warmup, total, min_lr_rate=0.2)),
    }
    if warmup == 0:  # constant has no warmup (with one, transformers ignores it and the config refuses it)
        expected["constant"] = hf_factors(get_constant_schedule)
    for kind, hf in expected.items():
        ours = [lr_factor(k, kind, total, warmup, 0.2 if kind == "cosine" else 0.0) for k in range(total)]
        assert ours == pytest.approx(hf, abs=1e-12), kind


def test_warmup_length_from_steps_or_ratio():
    assert warmup_steps(Config(max_steps=100, warmup_steps=7)) == 7
    assert warmup_steps(Config(max_steps=100, warmup_ratio=0.05)) == 5
    assert warmup_steps(Config(max_steps=30, warmup_ratio=0.1)) == 3  # rounded up, as transformers does
    assert warmup_steps(Config(max_steps=31, warmup_ratio=0.1)) == 4
    assert warmup_steps(Config()) == 0


def test_lambda_scheduler_on_an_optimizer_steps_through_the_schedule():
    cfg = Config(learning_rate=0.5, max_steps=6, lr_scheduler_type="linear", warmup_steps=2)
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=cfg.learning_rate)
    sched = lr_scheduler(cfg)(opt)
    seen = []
    for _ in range(cfg.max_steps):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([0.5 * lr_factor(k, "linear", 6, 2) for k in range(6)])
    assert seen[:3] == pytest.approx([0.0, 0.25, 0.5])
    # its state is plain data (DeepSpeed saves it in the checkpoint; every load is weights_only)
    state = sched.state_dict()
    torch.save(state, "/dev/null")
    assert state["last_epoch"] == 6


def test_which_schedules_depend_on_max_steps():
    assert not depends_on_max_steps(Config())
    assert not depends_on_max_steps(Config(lr_scheduler_type="constant_with_warmup", warmup_steps=10))
    assert depends_on_max_steps(Config(lr_scheduler_type="constant_with_warmup", warmup_ratio=0.1))
    assert depends_on_max_steps(Config(lr_scheduler_type="cosine"))
