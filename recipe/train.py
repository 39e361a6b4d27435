"""GRPO with multi-step rollout reuse on a DeepSpeed ZeRO-3 engine.

    python -m recipe.train --config recipe/configs/quickstart.yaml [--key value ...]

Works as a plain process (a world of one), under torchrun, and under the deepspeed launcher.
"""
from __future__ import annotations

import itertools
import os
import random
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist

from recipe import engine as eng
from recipe.buffer import RolloutBuffer
from recipe.checkpoint import PREEMPTED_EXIT_CODE, CheckpointError, Checkpointer
from recipe.config import Config, ConfigError, load_config
from recipe.data import DataError, PromptStream, load_prompt_dataset
from recipe.generation import build_generator
from recipe.loss import group_advantages
from recipe.metrics import MetricsLogger, Timer, read_metrics, reward_quarters
from recipe.preflight import preflight
from recipe.reuse import ReuseController
from recipe.rewards import RewardError, load_reward_funcs, score
from recipe.update import train_on_rollout


def setup(cfg: Config) -> SimpleNamespace:
    """Build every component from the config, cheapest and most likely to fail first."""
    rank, world = eng.init_distributed()
    random.seed(cfg.seed + rank)
    np.random.seed(cfg.seed + rank)
    torch.manual_seed(cfg.seed + rank)
    checkpointer = Checkpointer(cfg, rank, world)
    resume_from = checkpointer.find()
    if resume_from is not None:
        checkpointer.check_config(resume_from)  # before any model is loaded
    path = eng.model_path(cfg)
    tokenizer = eng.load_tokenizer(path)
    stream = PromptStream(load_prompt_dataset(cfg), tokenizer, cfg, rank, world)
    model = eng.load_model(path, cfg)
    engine = eng.init_engine(model, cfg, world)
    ref = eng.init_reference(path, cfg, world, engine) if cfg.beta > 0.0 else None
    generator = build_generator(cfg, engine, tokenizer)
    resume = None
    if resume_from is not None:
        resume = checkpointer.load(resume_from, engine)
        generator.sync(engine)
        if rank == 0:
            print(f"resumed from {resume_from} at step {resume['step']}", file=sys.stderr)
    checkpointer.install_signal_handlers()
    return SimpleNamespace(cfg=cfg, rank=rank, world=world, tokenizer=tokenizer, stream=stream, engine=engine,
                           ref=ref, rewards=load_reward_funcs(cfg.reward_funcs), generator=generator,
                           checkpointer=checkpointer, resume=resume)


def rollout_stats(rewards: torch.Tensor, per_func: dict, comp, num_truncated_prompts: int,
                  error: bool) -> dict:
    """Reward and completion statistics over all ranks, in one all-reduce (which also shares errors)."""
    lengths = comp.mask.sum(-1)
    vec = torch.tensor([rewards.sum(), (rewards ** 2).sum(), rewards.numel(), lengths.sum(),
                        comp.truncated.float().sum(), num_truncated_prompts, float(error),
                        *[v.sum() for v in per_func.values()]], dtype=torch.float64)
    if dist.get_world_size() > 1:
        dist.all_reduce(vec)
    n = vec[2].item()
    mean = vec[0].item() / n
    out = {"reward_mean": mean, "reward_std": max(vec[1].item() / n - mean ** 2, 0.0) ** 0.5 * (n / max(n - 1, 1)) ** 0.5,
           "completion_length_mean": vec[3].item() / n, "truncated_fraction": vec[4].item() / n,
           "prompts_truncated": int(vec[5].item()), "failed_ranks": int(vec[6].item())}
    out.update({f"reward/{k}": vec[7 + i].item() / n for i, k in enumerate(per_func)})
    return out


def collect_rollout(c: SimpleNamespace, rollout: int, timer: Timer) -> tuple[RolloutBuffer, dict]:
    """Generate this rank's groups, score them, and fill the rank-local buffer with their advantages."""
    cfg, G = c.cfg, c.cfg.num_generations
    batch = c.stream.batch(rollout)
    with timer("generate"):
        comp = c.generator.generate(batch.prompt_ids, seed=(cfg.seed + (rollout * c.world + c.rank) * 1000) % 2**31)
    # a bad reward on any rank stops every rank with that rank's message
    rows, error = batch.repeat(G), None
    with timer("score"):
        try:
            rewards, per_func = score(c.rewards, rows.prompts, comp.texts, rows.columns)
        except RewardError as e:
            error, rewards, per_func = e, torch.zeros(len(comp.ids)), {f.name: torch.zeros(1) for f in c.rewards}
    stats = rollout_stats(rewards, per_func, comp, batch.num_truncated, error is not None)
    if stats.pop("failed_ranks"):
        raise error or RewardError(f"a reward function failed on another rank in rollout {rollout}")
    advantages = group_advantages(rewards, G, cfg.scale_rewards)  # every group lives on this rank
    mask = comp.mask * (~comp.truncated).unsqueeze(-1) if cfg.mask_truncated_completions else comp.mask
    buf = RolloutBuffer.build(rows.prompt_ids, comp.ids, advantages, mask, c.tokenizer.pad_token_id,
                              order_seed=cfg.seed * 100_003 + rollout, sampling_logps=comp.logps)
    return buf, stats


def train(c: SimpleNamespace, resume: dict | None = None) -> tuple[list[dict], bool]:
    """The loop. Returns the step records and whether it stopped early for a signal (after a checkpoint)."""
    cfg, timer, ckpt = c.cfg, Timer(), c.checkpointer
    r = resume or {}
    step, position = r.get("step", 0), r.get("position")
    old_logp_forwards, prompts_truncated = r.get("old_logp_forwards", 0), r.get("prompts_truncated", 0)
    logger = MetricsLogger(Path(cfg.output_dir), c.rank, cfg.max_steps, initial_step=step,
                           tensorboard=cfg.report_to_tensorboard, disable_tqdm=cfg.disable_tqdm)
    reuse = ReuseController(cfg)
    if "reuse" in r:
        reuse.load_state_dict(r["reuse"])
    records, last = [], time.perf_counter()
    if step >= cfg.max_steps:
        logger.close()
        return records, False
    for rollout in itertools.count(r.get("rollout", 0)):
        if "buffer" in r:  # resuming inside this rollout: same samples, same old log-probs
            buf, stats = RolloutBuffer.from_state_dict(r.pop("buffer")), r.pop("stats")
        else:  # generate, score, advantages
            buf, stats = collect_rollout(c, rollout, timer)
            prompts_truncated += stats.pop("prompts_truncated")
        # mu passes over the rollout, each split into steps_per_generation optimizer steps
        last_step = (cfg.num_iterations - 1, cfg.steps_per_generation - 1)
        for done_step in train_on_rollout(c.engine, c.ref, buf, cfg, after=position, timer=timer):
            it, s, out = done_step.pass_index, done_step.step_index, done_step.stats
            old_logp_forwards += done_step.old_logp_forwards
            reuse.observe(out)
            # adaptive reuse: after a finished pass, maybe skip the rest of this rollout
            skip_rest = reuse.enabled and done_step.last_in_pass and reuse.pass_done()
            step, now = step + 1, time.perf_counter()
            record = {"step": step, "generation": rollout, "iteration": it, "passes_used": it + 1, **out, **stats,
                      "prompts_truncated": prompts_truncated, "old_logp_forwards": old_logp_forwards,
                      "weight_syncs": c.generator.syncs, **timer.pop("sync", "generate", "score", "old_logp", "train"),
                      "step_time_s": now - last}
            record["tokens_per_s"], last = out["train_tokens"] / record["step_time_s"], now
            records.append(record)
            if step % cfg.logging_steps == 0 or step == cfg.max_steps:
                logger.log(record)
            # checkpoint on schedule, at the end, or when a signal asks every rank to stop
            stop, done = ckpt.stop_requested(), step >= cfg.max_steps
            if stop or ckpt.should_save(step) or (done and cfg.save_steps > 0):
                ckpt.save(c.engine, step, {"step": step, "rollout": rollout, "position": last_step if skip_rest else (it, s),
                                           "stats": stats, "reuse": reuse.state_dict(),
                                           "old_logp_forwards": old_logp_forwards,
                                           "prompts_truncated": prompts_truncated, "buffer": buf.state_dict()})
            if stop or done:
                logger.close()
                return records, stop and not done
            if skip_rest:
                break
        position = None
        with timer("sync"):
            c.generator.sync(c.engine)  # the next rollout must sample from the updated policy


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = load_config(argv)
        preflight(cfg)  # files, the built-in model, vLLM, reward imports: before any process group starts
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    try:
        c = setup(cfg)
    except (DataError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        records, preempted = train(c, c.resume)
    except RewardError as e:  # a user's function misbehaved: say which, on every rank, without a traceback
        print(f"reward error (rank {c.rank}): {e}", file=sys.stderr)
        return 1
    final = Path(cfg.output_dir) / "final"
    if not preempted:
        eng.save_hf_model(c.engine, c.tokenizer, final, c.rank, save_merged=cfg.save_merged)
    if c.rank == 0:
        if preempted:
            print(f"stopped by a signal at step {records[-1]['step'] if records else '?'}; checkpoint saved, "
                  f"exit {PREEMPTED_EXIT_CODE}; rerun with --resume_from_checkpoint auto to continue", file=sys.stderr)
        else:
            first, last = reward_quarters(read_metrics(Path(cfg.output_dir) / "metrics.jsonl") or records)
            print(f"reward_mean: first quarter {first:.3f} -> last quarter {last:.3f}")
            print(f"metrics: {Path(cfg.output_dir) / 'metrics.jsonl'}")
            print(f"model:   {final}")
    dist.barrier()
    c.generator.close()  # last: vLLM's shutdown tears the process group down itself
    if dist.is_initialized():
        dist.destroy_process_group()
    return PREEMPTED_EXIT_CODE if preempted else 0


if __name__ == "__main__":
    code = main()
    # Everything is written and the process group is gone; skip interpreter teardown, where destructors of
    # DeepSpeed/gloo background threads occasionally abort ("terminate called without an active exception")
    # and would turn a finished run into a failed one.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
