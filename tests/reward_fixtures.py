"""Reward functions used by the tests (good and bad)."""
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
