"""The entropy coefficient's controller (algo/entropy.py). Its equality with TRL's step by step:
tests/test_loss_trl.py; its resume: tests/test_checkpoint.py."""
import math
from types import SimpleNamespace

from grpo_recipe.algo.entropy import EntropyControl


def config(**kw):
    return SimpleNamespace(**({"entropy_coef": 0.0, "use_adaptive_entropy": False, "entropy_target": 0.5,
                               "entropy_coef_delta": 0.1, "entropy_coef_min": 0.0, "entropy_coef_max": 0.25} | kw))


def test_a_fixed_coefficient_never_moves():
    c = EntropyControl.from_config(config(entropy_coef=0.02))
    for h in (0.1, 9.0, 0.0):
        assert c.applied() == 0.02
        c.step_done(h)
    assert (c.coef, c.last_entropy, c.enabled) == (0.02, math.inf, True)
    assert not EntropyControl.from_config(config()).enabled


def test_adaptive_applies_only_below_target_and_stays_within_bounds():
    c = EntropyControl.from_config(config(use_adaptive_entropy=True))
    assert c.enabled and c.applied() == 0.0  # no entropy measured yet
    seen = []
    for h in (0.4, 0.3, 0.2, 0.1, 0.9, 0.9, 0.9, 0.9):
        c.step_done(h)
        seen.append((round(c.coef, 6), round(c.applied(), 6)))
    assert seen == [(0.1, 0.1), (0.2, 0.2), (0.25, 0.25), (0.25, 0.25), (0.15, 0.0), (0.05, 0.0), (0.0, 0.0),
                    (0.0, 0.0)]
    d = EntropyControl.from_config(config(use_adaptive_entropy=True))
    d.load_state_dict(c.state_dict())
    assert (d.coef, d.last_entropy) == (c.coef, c.last_entropy)
