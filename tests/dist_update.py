"""Worker (run under torchrun): the recipe's own update path on a fixed rollout, for parity tests.

    torchrun --nproc_per_node N tests/dist_update.py OUT.pt '[{"name": ..., <Config overrides>}, ...]'

For each case: fresh engine from the tiny model, this rank's shard of a fixed global rollout, and the
recipe's own `train_on_rollout` over it (old log-probs, normalizers, mu passes) -- then rank 0 saves the
gathered weights and counters.
"""
import json
import sys

import torch

from grpo_recipe.algo.buffer import RolloutBuffer
from grpo_recipe.algo.loss import group_advantages
from grpo_recipe.algo.loss import zero_std_groups as all_equal_groups
from grpo_recipe.algo.update import train_on_rollout
from grpo_recipe.config.schema import Config
from grpo_recipe.dist import liveness
from grpo_recipe.dist.group import init_distributed
from grpo_recipe.generation import Completions
from grpo_recipe.model import engine as eng
from grpo_recipe.model.load import load_model
from grpo_recipe.model.source import model_path
from grpo_recipe.train import rollout_stats

# adam_epsilon 1e-6: Adam turns float noise in near-zero gradients (e.g. the attention key bias, whose exact
# gradient is 0) into lr-sized steps of random sign; a larger eps keeps the comparison about the update itself.
BASE = dict(model_name_or_path="builtin:tiny-qwen2", learning_rate=1e-3, max_grad_norm=0.0, num_generations=4,
            adam_epsilon=1e-6, num_iterations=1,
            per_device_train_batch_size=2, max_completion_length=8, epsilon=0.2, epsilon_high=0.28)


def fixed_rollout(n: int, seed: int = 0, vocab: int = 500, eos: int = 0):
    """n samples: prompts of 3..6 tokens, completions of 2..8 tokens (some ending in EOS), advantages."""
    g = torch.Generator().manual_seed(seed)
    prompts, comps = [], []
    for i in range(n):
        p_len = 3 + int(torch.randint(0, 4, (1,), generator=g))
        c_len = 2 + int(torch.randint(0, 7, (1,), generator=g))
        prompts.append(torch.randint(1, vocab, (p_len,), generator=g).tolist())
        c = torch.randint(1, vocab, (c_len,), generator=g).tolist()
        if i % 3 == 0:
            c[-1] = eos
        comps.append(c)
    adv = torch.randn(n, generator=g)
    return prompts, comps, adv


def local_buffer(cfg: Config, rank: int, world: int, pad_id: int = 0, zero_std_groups=(),
                 tool_tokens: bool = False) -> RolloutBuffer:
    """This rank's slice of the fixed rollout. The global groups `zero_std_groups` had all-equal rewards: their
    advantages are 0, and with zero_std_filter they are left out of the update. `tool_tokens`: tokens 1 and 2 of
    every completion longer than 3 are a tool's result (attended to, not trained: generation/tools.py)."""
    n = cfg.completions_per_rollout
    prompts, comps, adv = fixed_rollout(n * world)
    group = torch.arange(n * world) // cfg.num_generations
    zero = torch.isin(group, torch.tensor(list(zero_std_groups), dtype=torch.long))
    adv[zero] = 0.0
    sl = slice(rank * n, (rank + 1) * n)
    prompts, comps = prompts[sl], comps[sl]
    width = max(len(c) for c in comps)
    mask = torch.zeros(n, width)
    for i, c in enumerate(comps):
        mask[i, :len(c)] = 1
    active = ~zero[sl] if cfg.zero_std_filter else None
    tool_mask = None
    if tool_tokens:
        tool_mask = torch.ones(n, width)
        tool_mask[:, 1:3] = (mask.sum(-1, keepdim=True) <= 3).float()
    return RolloutBuffer.build(prompts, comps, adv[sl], mask, pad_id, order_seed=1000 + rank, active=active,
                               tool_mask=tool_mask)


def rollout_buffer(path: str, rank: int, pad_id: int = 0) -> RolloutBuffer:
    """This rank's rollout as TRL's trainer generated and scored it (tests/dist_trl_step.py): prompts without their
    left padding, completions up to the end of their mask, TRL's own advantages."""
    batch = torch.load(f"{path}/rollout-rank{rank}.pt", weights_only=True)[0]
    prompts = [row[m.bool()].tolist() for row, m in zip(batch["prompt_ids"], batch["prompt_mask"])]
    mask = batch["completion_mask"].float()
    comps = [row[:int(m.sum())].tolist() for row, m in zip(batch["completion_ids"], mask)]
    return RolloutBuffer.build(prompts, comps, batch["advantages"].float(), mask, pad_id, order_seed=1000 + rank)


def fixed_rewards(n: int) -> torch.Tensor:
    """Rewards of a global rollout whose groups differ in level and spread, so that a rank's own std is far
    from the whole batch's."""
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, generator=g) * torch.arange(1, n + 1) / n + torch.arange(n) // 4 * 10.0


def advantages_from_rewards(cfg: Config, buf: RolloutBuffer, rank: int, world: int) -> torch.Tensor:
    """This rank's advantages of the fixed global rewards, through the recipe's own path (train.py): reward
    statistics over all ranks in one all-reduce, then group advantages."""
    n = len(buf)
    rewards = fixed_rewards(n * world)[rank * n:(rank + 1) * n]
    comp = Completions(ids=[[] for _ in range(n)], mask=buf.completion_mask, truncated=torch.zeros(n, dtype=torch.bool),
                       texts=[""] * n)  # what rollout_stats reads: the masks and truncation
    stats = rollout_stats(rewards, {}, comp, 0, 0, False, all_equal_groups(rewards, cfg.num_generations))
    return group_advantages(rewards, cfg.num_generations, cfg.scale_rewards, batch_std=stats["reward_std"])


def fixed_sampling_logps(buf: RolloutBuffer, rank: int, world: int) -> torch.Tensor:
    """A sampler's log-probs for this rank's samples, fixed per global sample (so any split sees the same):
    uniform in [-7.5, -5], around the tiny untrained model's own (about -6.2), so drift ratios spread over
    about exp(+-1.3) per token and much wider per sequence."""
    n, c = buf.completion_mask.shape  # c: this rank's longest completion, at most BASE's max_completion_length
    g = torch.Generator().manual_seed(7)
    every = torch.rand(n * world, BASE["max_completion_length"], generator=g) * -2.5 - 5.0
    return every[rank * n:(rank + 1) * n, :c]


def run_case(cfg: Config, rank: int, world: int, from_rewards: bool = False, zero_std_groups=(),
             sampling_logps: bool = False, tool_tokens: bool = False, rollout: str | None = None):
    """Fresh engine, this rank's shard of the fixed rollout, `train_on_rollout` over it. Returns the engine,
    the reference, the buffer, the old-log-prob forwards, store counts and each step's statistics.
    `from_rewards`: advantages from fixed rewards as train.py computes them; `rollout`: TRL's rollout in this folder
    instead of the fixed one."""
    path = model_path(cfg)
    torch.manual_seed(0)
    engine = eng.init_engine(load_model(path, cfg, world), cfg, world)
    ref = eng.init_reference(path, cfg, world, engine) if cfg.beta > 0 else None
    buf = (rollout_buffer(rollout, rank) if rollout else
           local_buffer(cfg, rank, world, zero_std_groups=zero_std_groups, tool_tokens=tool_tokens))
    if from_rewards:
        buf.advantages = advantages_from_rewards(cfg, buf, rank, world).float()
    if sampling_logps:
        buf.sampling_logps = fixed_sampling_logps(buf, rank, world)
    stores = torch.zeros(len(buf), dtype=torch.long)
    original_store = buf.store_old_logps

    def counting_store(idx, logps):
        stores[idx] += 1
        original_store(idx, logps)

    buf.store_old_logps = counting_store
    steps = list(train_on_rollout(engine, ref, buf, cfg))
    assert [(s.pass_index, s.step_index) for s in steps] == [
        (p, s) for p in range(cfg.num_iterations) for s in range(cfg.optimizer_steps_per_pass)]
    forwards = sum(s.old_logp_forwards for s in steps)
    return engine, ref, buf, forwards, stores, [s.stats for s in steps]


def main():
    out_path, cases = sys.argv[1], json.loads(sys.argv[2])
    rank, world = init_distributed()
    results = {}
    for case in cases:
        name, from_rewards = case.pop("name"), case.pop("from_rewards", False)
        zero_std_groups = case.pop("zero_std_groups", ())
        sampling, tools = case.pop("sampling_logps", False), case.pop("tool_tokens", False)
        rollout = case.pop("rollout", None)
        engine, _, buf, forwards, stores, outs = run_case(Config(**{**BASE, **case}), rank, world, from_rewards,
                                                          zero_std_groups, sampling, tools, rollout)
        state = engine._zero3_consolidated_16bit_state_dict() if eng.is_zero3(engine) else engine.module.state_dict()
        all_stores = [torch.zeros_like(stores) for _ in range(world)]
        torch.distributed.all_gather(all_stores, stores)
        if rank == 0:
            results[name] = {"state": {k: v.clone() for k, v in state.items()}, "old_logp_forwards": forwards,
                             "advantages": buf.advantages.clone(),
                             "stores": torch.cat(all_stores), "old_logps": buf.old_logps.clone(),
                             "approx_kl": torch.tensor([o["approx_kl"] for o in outs], dtype=torch.float64),
                             "clip_ratio_region": torch.tensor([o["clip_ratio_region"] for o in outs], dtype=torch.float64),
                             "entropy": torch.tensor([o["entropy"] for o in outs], dtype=torch.float64),
                             "learning_rate": torch.tensor([o["learning_rate"] for o in outs], dtype=torch.float64),
                             "loss": torch.tensor([o["loss"] for o in outs], dtype=torch.float64),
                             "extra": {k: torch.tensor([o.get(k, float("nan")) for o in outs], dtype=torch.float64)
                                       for k in ("is_ratio_mean", "is_zeroed_fraction", "off_policy_masked_fraction",
                                                 "clip_ratio_high", "high_entropy_fraction", "entropy_coef")},
                             "zero": {"stage": engine.zero_optimization_stage(),
                                      "offload_param": engine.zero_offload_param() is not None,
                                      "offload_optimizer": engine.zero_use_cpu_optimizer()}}
        engine.destroy()
    if rank == 0:
        torch.save(results, out_path)
    torch.distributed.barrier()


if __name__ == "__main__":
    liveness.run_and_exit(main)  # no gloo/DeepSpeed teardown, which occasionally aborts a finished rank
