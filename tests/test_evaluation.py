"""Evaluation during training (grpo_recipe/run/evaluation.py): the eval prompts' shards. The metrics themselves, and that
evaluation leaves training unchanged, are tested end to end in tests/test_train.py."""
import pytest

from grpo_recipe.run.evaluation import shard


@pytest.mark.parametrize("n, world", [(5, 2), (4, 2), (1, 2), (7, 3), (3, 1), (2, 4)])
def test_each_prompt_is_evaluated_once_over_all_ranks(n, world):
    shards = [shard(n, rank, world) for rank in range(world)]
    per_rank = {len(indices) for indices, _ in shards}
    assert per_rank == {-(-n // world)}  # equal numbers of generation calls on every rank
    counted = sorted(i for indices, weights in shards for i, w in zip(indices, weights.tolist()) if w == 1.0)
    assert counted == list(range(n))  # disjoint shards covering the set; padding weighs 0
    assert all(w in (0.0, 1.0) for _, weights in shards for w in weights.tolist())
