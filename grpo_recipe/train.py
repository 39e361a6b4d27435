"""GRPO with multi-step rollout reuse on a DeepSpeed ZeRO-3 engine.

    python -m grpo_recipe.train --config grpo_recipe/configs/quickstart.yaml [--key value ...]

Works as a plain process (a world of one), under torchrun, and under the deepspeed launcher.
"""
from __future__ import annotations

from grpo_recipe.dist import allocator, signals

if __name__ == "__main__":
    allocator.restart_with_huge_pages()  # first: glibc reads its huge-page setting only at start-up
signals.catch()  # before the heavy imports: a preemption during start-up is acted on, not lost
allocator.configure()  # before anything is allocated: freed memory goes back to the system

import os  # noqa: E402
import random
import re
import shutil
import sys
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from grpo_recipe.algo.buffer import RolloutBuffer
from grpo_recipe.algo.clock import Timer
from grpo_recipe.algo.entropy import EntropyControl
from grpo_recipe.algo.loss import batch_normalized, group_advantages, normalized_sum, zero_std_groups
from grpo_recipe.algo.reuse import ReuseController
from grpo_recipe.algo.update import NonFiniteError, StepResult, check_finite, train_on_rollout
from grpo_recipe.config.help import help_text
from grpo_recipe.config.load import HelpRequested, load_config
from grpo_recipe.config.schema import Config, ConfigError
from grpo_recipe.data.prompts import DataError, PromptStream, check_prompts, load_datasets, uses_chat_template
from grpo_recipe.dist import liveness
from grpo_recipe.dist.env import PREEMPTED_EXIT_CODE, LaunchError
from grpo_recipe.dist.collectives import all_reduce_named, barrier, first_error
from grpo_recipe.dist.group import init_distributed
from grpo_recipe.dist.link import layout
from grpo_recipe.generation import GenerationError, Generator, build_generator, generate_on_every_rank, rollout_seed
from grpo_recipe.generation.remote import serve
from grpo_recipe.generation.environments import Environments
from grpo_recipe.generation.tools import (ToolError, ToolRunner, check_template, context_length, load_tools, multi_turn,
                                          round_seed, set_templates)
from grpo_recipe.generation.vllm import VLLMUnavailable
from grpo_recipe.model import engine as eng
from grpo_recipe.model.load import load_model, load_tokenizer
from grpo_recipe.model.save import save_hf_model
from grpo_recipe.model.source import model_path
from grpo_recipe.rewards.funcs import (
    RewardError,
    RewardFunc,
    RewardStopped,
    check_answer_columns,
    load_reward_funcs,
    score,
)
from grpo_recipe.run import outdir
from grpo_recipe.run.checkpoint import Checkpointer, CheckpointError
from grpo_recipe.run.evaluation import Evaluator
from grpo_recipe.run.metrics import MetricsLogger, read_jsonl, reward_quarters, sample_rows
from grpo_recipe.run.preflight import preflight
from grpo_recipe.run.trackers import build_trackers

# the Timer's phases, logged as time_<phase>_s (forward, backward, optimizer: parts of train)
TIMED = ("sync", "generate", "score", "old_logp", "train", "forward", "backward", "optimizer")


@dataclass
class Run:
    """The run's components, built once from the config by `setup`."""
    cfg: Config
    rank: int
    world: int
    tokenizer: Any
    stream: PromptStream
    engine: Any  # the policy's DeepSpeed engine
    ref: Any  # the KL term's reference policy, called like a model (None when beta = 0)
    rewards: list[RewardFunc]
    generator: Generator
    checkpointer: Checkpointer
    evaluator: Evaluator | None  # None: no evaluation during training
    lock: Any = None  # rank 0's hold on the output folder (grpo_recipe/run/outdir.py), kept for the run's lifetime
    tools: ToolRunner | None = None  # multi-turn rollouts: the tools the model may call
    envs: Environments | None = None  # and the environments whose methods it may call, one per completion


@dataclass
class LoopState:
    """Where the loop is. A checkpoint saves exactly this per rank (with the RNG states); a resume continues it."""
    step: int = 0  # optimizer steps done
    rollout: int = 0  # the rollout being trained on
    position: tuple[int, int] | None = None  # its last (pass, step) done; None: none yet
    buffer: RolloutBuffer | None = None  # that rollout with its old log-probs; None: not generated yet
    stats: dict | None = None  # its reward and completion statistics (part of each of its steps' records)
    samples: list | None = None  # rank 0, log_completions_steps: a few of its completions with rewards, advantages
    reuse: dict | None = None  # the adaptive-reuse controller's state
    entropy: dict | None = None  # use_adaptive_entropy: the entropy coefficient's state
    generator: dict | None = None  # generation_ranks, max_staleness 1: the next rollout, received ahead of its turn
    old_logp_forwards: int = 0  # cumulative, logged with every step
    prompts_truncated: int = 0  # cumulative, logged with every step
    nonfinite_steps: int = 0  # steps skipped for a non-finite loss or gradient norm, logged with every step
    weight_syncs: int = 0  # the generator's syncs so far (at a checkpoint), logged with every step
    weights_synced: bool = False  # whether the generator already held this step's weights (at a checkpoint)

    def next_rollout(self) -> None:
        self.rollout, self.position, self.buffer, self.stats, self.samples = self.rollout + 1, None, None, None, None

    def state_dict(self) -> dict:
        state = {f.name: getattr(self, f.name) for f in fields(self)}
        return state | {"buffer": None if self.buffer is None else self.buffer.state_dict()}

    @classmethod
    def from_state_dict(cls, state: dict) -> "LoopState":
        buffer = None if state["buffer"] is None else RolloutBuffer.from_state_dict(state["buffer"])
        # a field added after the checkpoint was written keeps its default
        return cls(**{f.name: state[f.name] for f in fields(cls) if f.name in state} | {"buffer": buffer})


class StoppedAtStartup(Exception):
    """A stop signal arrived before the run had anything to save."""


def setup(cfg: Config, data: tuple | None = None) -> tuple[Run, LoopState]:
    """Build every component from the config, cheapest and most likely to fail first; the loop's starting state."""
    # the data first, every prompt checked: bad data costs one line before any process group or model
    path = model_path(cfg)
    try:
        tokenizer = load_tokenizer(path)
    except (OSError, ValueError) as e:  # e.g. no EOS token, or files transformers cannot read
        raise ConfigError(f"model_name_or_path: no usable tokenizer in {path}: {' '.join(str(e).split())[:300]}") \
            from None
    set_templates(tokenizer, cfg)
    tools = envs = None
    rewards = load_reward_funcs(cfg.reward_funcs)
    if cfg.uses_tools:
        standalone = load_tools(cfg.tools)
        tools = ToolRunner(standalone, cfg.tool_timeout_s)
        if cfg.environment_factory is not None:
            envs = Environments(cfg.environment_factory, standalone, cfg.tool_timeout_s)
            rewards += [RewardFunc(name, fn, 1.0, {}) for name, fn in envs.reward_funcs()]  # weight 1, as TRL's
        check_template(tokenizer, tools.schemas or next(s for s in envs.schemas.values() if s))
    if not rewards:
        raise ToolError("reward_funcs: none given, and no environment defines get_reward")
    train_prompts, eval_prompts = load_datasets(cfg, *(data or ()))  # a held-out eval slice leaves the train set
    checked = [(train_prompts, cfg.dataset_name)]
    if eval_prompts is not None:  # held out of the train set or its own: checked the same way
        checked.append((eval_prompts, cfg.eval_dataset_name or cfg.dataset_name))
    for prompts, name in checked:
        check_prompts(prompts, cfg, uses_chat_template(tokenizer, cfg), name)
        check_answer_columns(rewards, prompts.column_names)
    if signals.pending():  # before the process group and the output folder: nothing is touched yet
        raise StoppedAtStartup(f"stopped by {signals.pending()} during start-up, before anything was written")
    if cfg.full_determinism:  # before any CUDA work: cuBLAS reads its workspace setting when it starts
        from transformers.trainer_utils import enable_full_determinism

        enable_full_determinism(cfg.seed)
    rank, world = init_distributed(cfg.collective_timeout_s, cfg.generation_ranks)  # world: the training ranks
    random.seed(cfg.seed + rank)
    np.random.seed(cfg.seed + rank)
    torch.manual_seed(cfg.seed + rank)
    checkpointer = Checkpointer(cfg, rank, world)
    # the folder is this run's for its lifetime: refuse another run's outputs, lock out concurrent runs
    claim, lock = outdir.claim(cfg, rank, world, checkpointer.find, checkpointer.run_id_of)
    checkpointer.run_id, checkpointer.lineage, resume_from = claim.run_id, claim.lineage, claim.resume_from
    if resume_from is not None:
        checkpointer.check_config(resume_from)  # before any model is loaded
    stream = PromptStream(train_prompts, tokenizer, cfg, rank, world, tools and tools.schemas)
    model = load_model(path, cfg, world)
    engine = eng.init_engine(model, cfg, world)
    ref = eng.init_reference(path, cfg, world, engine) if cfg.beta > 0.0 else None
    generator = build_generator(cfg, engine, tokenizer)
    state = LoopState()
    if resume_from is not None:
        saved = checkpointer.load(resume_from, engine)
        state = LoopState.from_state_dict(saved)
        if cfg.sync_ref_model:  # the mixed reference is where the loop is too
            eng.load_reference_shard(ref, saved["reference"])
        generator.load_state_dict(state.generator)
        synced = generator.syncs
        generator.sync(engine)  # the checkpoint's weights, for a generator that started from the model folder
        synced = generator.syncs - synced  # 1 where it synced (vLLM, generation ranks), 0 where it needs none
        # counted as the uninterrupted run counts: there, a rollout whose passes are done syncs next (this sync
        # stands for it) unless an evaluation synced already; in the middle of a rollout nothing syncs
        done = state.position == (cfg.max_passes - 1, cfg.optimizer_steps_per_pass - 1)
        generator.syncs = state.weight_syncs + (synced if done and not state.weights_synced else 0)
        if rank == 0:
            print(f"resumed from {resume_from} at step {state.step}", file=sys.stderr)
    checkpointer.install_signal_handlers()
    evaluator = None
    if eval_prompts is not None and (cfg.eval_steps or cfg.eval_on_start):
        evaluator = Evaluator(cfg, PromptStream(eval_prompts, tokenizer, cfg, rank, world, tools and tools.schemas),
                              generator, rewards, rank, world, tools, envs, context_length(cfg, engine.module.config))
    run = Run(cfg, rank, world, tokenizer, stream, engine, ref, rewards, generator, checkpointer, evaluator, lock,
              tools, envs)
    return run, state


def rollout_stats(rewards: torch.Tensor, per_func: dict, comp, num_truncated_prompts: int, prompt_tokens: int,
                  error: bool, zero_std: torch.Tensor, objective: torch.Tensor | None = None) -> dict:
    """Reward and completion statistics over all ranks, in one all-reduce (which also shares errors); with
    `objective` (GDPO's normalized sums) its mean and std over all ranks too."""
    r64 = rewards.double()  # the batch std divides advantages: sums in float64, so 1 or N ranks agree
    lengths = comp.mask.sum(-1)
    sums = {"samples": rewards.numel(), "length": lengths.sum(), "truncated": comp.truncated.float().sum(),
            "prompts_truncated": num_truncated_prompts, "failed_ranks": float(error),
            "zero_std_groups": zero_std.sum(), "groups": zero_std.numel(),
            "reward": r64.sum(), "reward^2": (r64 ** 2).sum(),
            "ranks": 1.0, "decode_steps": lengths.max() if len(lengths) else 0, "tokens": prompt_tokens + lengths.sum()}
    if comp.tool_mask is not None:  # multi-turn: the model's own tokens, tool calls and failures
        sums |= {"model_tokens": (comp.tool_mask * comp.mask).sum(), "tool_calls": comp.tool_counts["tool_calls"],
                 "tool_failures": comp.tool_counts["tool_failures"]}
    if objective is not None:
        o64 = objective.double()
        sums |= {"objective": o64.sum(), "objective^2": (o64 ** 2).sum()}
    for k, v in per_func.items():  # each function over the samples it applies to (NaN: it returned None there)
        applies = ~v.isnan()
        sums |= {f"reward/{k}": v.double().nansum(), f"reward/{k}^2": (v.double()[applies] ** 2).sum(),
                 f"applies/{k}": applies.sum()}
    sums = all_reduce_named({k: torch.as_tensor(v, dtype=torch.float64) for k, v in sums.items()})
    return summarize_rollout({k: v.item() for k, v in sums.items()}, list(per_func))


def summarize_rollout(sums: dict[str, float], names: list[str]) -> dict:
    """The logged statistics from the all-ranks sums; stds are sample stds: sqrt((sum x^2 - n mean^2) / (n - 1))."""
    def mean_std(key: str, n: float) -> tuple[float, float]:
        mean = sums[key] / max(n, 1.0)
        return mean, max(sums[f"{key}^2"] / max(n, 1.0) - mean ** 2, 0.0) ** 0.5 * (n / max(n - 1, 1)) ** 0.5

    n = sums["samples"]
    per_func = {k: mean_std(f"reward/{k}", sums[f"applies/{k}"]) for k in names}
    mean, std = mean_std("reward", n)
    objective = dict(zip(("objective_mean", "objective_std"), mean_std("objective", n))) if "objective" in sums else {}
    tools = {"tool_calls_per_completion": sums["tool_calls"] / n,
             "tool_failure_fraction": sums["tool_failures"] / max(sums["tool_calls"], 1.0),
             "tool_tokens_per_completion": (sums["length"] - sums["model_tokens"]) / n} if "tool_calls" in sums else {}
    return {"reward_mean": mean, "reward_std": std, "frac_reward_zero_std": sums["zero_std_groups"] / sums["groups"],
            "completion_length_mean": sums["length"] / n, "truncated_fraction": sums["truncated"] / n,
            # what the rollout cost: its decoding steps (longest completion, mean over ranks) and the tokens a
            # pass trains on (prompts and completions, all ranks); reuse.py prices replays with them
            "decode_steps": sums["decode_steps"] / sums["ranks"], "rollout_tokens": int(sums["tokens"]),
            "prompts_truncated": int(sums["prompts_truncated"]), "failed_ranks": int(sums["failed_ranks"]),
            **objective, **tools, **{f"reward/{k}": m for k, (m, _) in per_func.items()},
            **{f"reward/{k}_std": s for k, (_, s) in per_func.items()}}


def generate(run: Run, prompt_ids: list[list[int]], rollout: int, per_sample: list | None = None):
    """This rank's completions (a failure on any rank stops every rank); sampling from NaN probabilities means
    the last update broke the weights."""
    seed = rollout_seed(run.cfg.seed, rollout, run.rank, run.world)
    where = f"generation of rollout {rollout}"
    try:
        if run.tools is None or run.cfg.generation_ranks:  # generation ranks run the tool rounds themselves
            return generate_on_every_rank(run.generator, prompt_ids, where, seed=seed, rollout=rollout)
        # tool rounds sample afresh from prompts that now hold the results: a seed of their own each
        turn = lambda prompts, n, k: generate_on_every_rank(  # noqa: E731
            run.generator, prompts, f"{where}, tool round {k}" if k else where, n=n, rollout=rollout,
            seed=round_seed(seed, k))
        return multi_turn(turn, run.tokenizer, run.cfg, prompt_ids, run.tools,
                          context_length(run.cfg, run.engine.module.config), per_sample)
    except GenerationError as e:
        if re.search(r"\b(nan|inf)\b", str(e), re.IGNORECASE):
            raise NonFiniteError(f"{e}: the policy is no longer finite after the last update; resume from an "
                                 "earlier checkpoint with a lower learning_rate") from None
        raise


def collect_rollout(run: Run, rollout: int, timer: Timer) -> tuple[RolloutBuffer, dict, list | None]:
    """Generate this rank's groups, score them, and fill the rank-local buffer with their advantages. Also returns
    rank 0's completion samples when log_completions_steps asks for them."""
    cfg, G = run.cfg, run.cfg.num_generations
    batch = run.stream.batch(rollout)
    rows, per_sample = batch.repeat(G), None
    if run.envs is not None:  # an environment per completion: its observation joins its prompt, its tools its own
        liveness.set_phase(f"rollout {rollout}: environments")
        rows, per_sample = run.envs.prepare(run.stream, rows, rollout_seed(cfg.seed, rollout, run.rank, run.world))
    liveness.set_phase(f"rollout {rollout}: generation")
    with timer("generate"):
        comp = generate(run, rows.prompt_ids if per_sample else batch.prompt_ids, rollout, per_sample)
        run.generator.release()  # every turn is in: a colocated engine's memory goes to scoring and training
    error = None  # a bad reward on any rank stops every rank with that rank's message
    with timer("score"):
        try:
            rewards, per_func = score(run.rewards, rows.prompts, comp.texts, rows.columns, completion_ids=comp.ids,
                                      timeout_s=cfg.reward_timeout_s or None, where=f"rollout {rollout}: ",
                                      turns=comp.turns)
        except RewardError as e:
            error, rewards, per_func = e, torch.zeros(len(comp.ids)), {f.name: torch.zeros(1) for f in run.rewards}
    liveness.set_phase(f"rollout {rollout}: reward statistics (all ranks)")
    zero_std = zero_std_groups(rewards, G)
    objective = None  # GDPO: each function normalized within its group first, then weighted and summed
    if cfg.multi_objective_aggregation == "normalize_then_sum" and error is None:
        objective = normalized_sum(torch.stack([per_func[f.name] for f in run.rewards], dim=-1),
                                   torch.tensor([f.weight for f in run.rewards]), G)
    stats = rollout_stats(rewards, per_func, comp, batch.num_truncated, sum(map(len, rows.prompt_ids)),
                          error is not None, zero_std, objective) | run.generator.stats  # generation_ranks: its lag
    if stats.pop("failed_ranks"):  # every rank names the function that failed (or was stopped), wherever it ran
        failed_rank, message = first_error(None if error is None else str(error))
        message = message if failed_rank == run.rank else f"{message} (on rank {failed_rank})"
        raise (RewardStopped if message.startswith("stopped by") else RewardError)(message)
    liveness.set_phase(f"rollout {rollout}: training (all ranks)")
    # every group lives on this rank; scale_rewards: batch divides by the std over all ranks (as TRL does)
    if objective is not None:  # GDPO's sums, normalized over the whole batch (all ranks)
        advantages = batch_normalized(objective, stats.pop("objective_mean"), stats.pop("objective_std"))
    else:
        advantages = group_advantages(rewards, G, cfg.scale_rewards, batch_std=stats["reward_std"])
    mask = comp.mask * (~comp.truncated).unsqueeze(-1) if cfg.mask_truncated_completions else comp.mask
    active = ~zero_std.repeat_interleave(G) if cfg.zero_std_filter else None  # all-equal groups teach nothing
    buf = RolloutBuffer.build(rows.prompt_ids, comp.ids, advantages, mask, run.tokenizer.pad_token_id,
                              order_seed=cfg.seed * 100_003 + rollout, sampling_logps=comp.logps, active=active,
                              tool_mask=comp.tool_mask)
    samples = None
    if run.rank == 0 and cfg.log_completions_steps:  # this rank's first groups: nothing is gathered
        samples = sample_rows(rollout, rows.prompts, comp.texts, rewards, per_func, advantages,
                              cfg.num_prompts_to_log * G, comp.turns)
    return buf, stats, samples


def step_record(run: Run, state: LoopState, done: StepResult, timer: Timer, step_time_s: float,
                step_cpu_s: float) -> dict:
    """One line of metrics.jsonl: the step's statistics, its rollout's, the counters and where the time went."""
    return {"step": state.step, "generation": state.rollout, "iteration": done.pass_index,
            "passes_used": done.pass_index + 1, **done.stats, **state.stats,
            "prompts_truncated": state.prompts_truncated, "old_logp_forwards": state.old_logp_forwards,
            "nonfinite_steps": state.nonfinite_steps, "weight_syncs": run.generator.syncs, **timer.pop(*TIMED),
            "step_time_s": step_time_s, "step_cpu_s": step_cpu_s,
            "tokens_per_s": done.stats["train_tokens"] / step_time_s}


def report(run: Run, state: LoopState, logger: MetricsLogger, record: dict) -> None:
    """After each optimizer step: the evaluation at eval steps (its eval/ metrics join the step's record), the
    metrics line at logging and eval steps and the last, completion samples, and the progress bar."""
    cfg, step = run.cfg, state.step
    evaluated = run.evaluator is not None and run.evaluator.due(step)
    if evaluated:
        try:
            record.update(run.evaluator.run(step))
        except RewardStopped:  # a stop signal cut it short: the step's line without it; the loop checkpoints
            pass
    if step % cfg.logging_steps == 0 or step == cfg.max_steps or evaluated:
        logger.log(record)
    if cfg.log_completions_steps and step % cfg.log_completions_steps == 0:
        logger.log_completions(step, state.samples)
    logger.advance(record)


def save(run: Run, state: LoopState) -> None:
    state.generator = run.generator.state_dict()  # a rollout in flight is part of where the loop is
    state.weight_syncs = run.generator.syncs
    state.weights_synced = getattr(run.generator, "synced_step", None) == run.engine.global_steps
    synced_ref = {"reference": eng.reference_shard(run.ref)} if run.cfg.sync_ref_model else {}
    run.checkpointer.save(run.engine, state.step, state.state_dict() | synced_ref)


def train(run: Run, state: LoopState) -> tuple[list[dict], bool]:
    """The loop, from `state` on (updated in place). Returns the step records and whether it stopped early for
    a signal (after a checkpoint)."""
    cfg, ckpt, timer, out = run.cfg, run.checkpointer, Timer(), Path(run.cfg.output_dir)
    logger = MetricsLogger(out, run.rank, cfg.max_steps, initial_step=state.step, disable_tqdm=cfg.disable_tqdm,
                           trackers=lambda: build_trackers(cfg.report_to, out, cfg))
    reuse, entropy = ReuseController(cfg), EntropyControl.from_config(cfg)
    if state.reuse is not None:
        reuse.load_state_dict(state.reuse)
    if state.entropy is not None:
        entropy.load_state_dict(state.entropy)
    records, last, last_cpu = [], time.perf_counter(), time.process_time()
    if ckpt.stop_requested():  # a signal during start-up: nothing trained since the checkpoint resumed from
        logger.close()
        return records, True
    if state.step == 0 and cfg.eval_on_start and run.evaluator is not None:
        logger.log({"step": 0, **run.evaluator.run(0)})
    while state.step < cfg.max_steps:
        if state.buffer is None:  # generate, score, advantages
            try:
                state.buffer, state.stats, state.samples = collect_rollout(run, state.rollout, timer)
            except RewardStopped as e:  # a stop signal cut a reward short on some rank: the last step is safe
                if state.step != (ckpt.saved_step or 0):
                    save(run, state)
                logger.close()
                if run.rank == 0:
                    print(f"note: {e}; the rollout it scored is dropped (resuming generates it again)",
                          file=sys.stderr)
                return records, True
            state.prompts_truncated += state.stats.pop("prompts_truncated")
        for done in train_on_rollout(run.engine, run.ref, state.buffer, cfg, after=state.position, timer=timer,
                                     entropy=entropy):
            state.step += 1
            # a non-finite loss or gradient norm: stop, or (skip_nonfinite_steps) count a step DeepSpeed skipped
            state.nonfinite_steps += check_finite(done, state.step, state.nonfinite_steps, cfg.skip_nonfinite_steps)
            state.old_logp_forwards += done.old_logp_forwards
            if cfg.sync_ref_model and state.step % cfg.ref_model_sync_steps == 0:  # TR-DPO
                eng.mix_into_reference(run.ref, run.engine, cfg.ref_model_mixup_alpha)
            now, cpu = time.perf_counter(), time.process_time()
            record = step_record(run, state, done, timer, now - last, cpu - last_cpu)
            # reuse (grpo_recipe/algo/reuse.py): after a finished pass, maybe skip the rest of this rollout
            skip_rest = reuse.step_done(record, done.last_in_pass)
            records.append(record | reuse.status())
            last_step = (cfg.max_passes - 1, cfg.optimizer_steps_per_pass - 1)  # skipped passes count as done
            state.position = last_step if skip_rest else (done.pass_index, done.step_index)
            state.reuse, state.entropy = reuse.state_dict(), entropy.state_dict()
            report(run, state, logger, records[-1])
            # checkpoint on schedule, at the end, or when a signal asks every rank to stop
            stop, finished = ckpt.stop_requested(), state.step >= cfg.max_steps
            if stop or ckpt.should_save(state.step) or (finished and cfg.save_steps > 0):
                save(run, state)
            if stop or finished:
                logger.close()
                return records, stop and not finished
            # an evaluation's time (eval/time_s) and a checkpoint's are their own, not the next step's
            last, last_cpu = time.perf_counter(), time.process_time()
            if skip_rest:
                break
        state.next_rollout()
        with timer("sync"):
            run.generator.sync(run.engine)  # the next rollout must sample from the updated policy
    logger.close()
    return records, False


def say_error(line: str) -> None:
    """One write per line: ranks share stderr, and print's two writes (text, newline) interleave between them."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def save_final(run: Run, final: Path) -> bool:
    """Write OUTPUT_DIR/final; if the write fails (a disk filled by something else meanwhile), every rank says
    so in one line, the partial folder is removed, and the line names what still holds the run."""
    error = None
    try:
        save_hf_model(run.engine, run.tokenizer, final, run.rank, save_merged=run.cfg.save_merged)
    except Exception as e:  # noqa: BLE001 -- disk full, permissions, a filesystem gone: all end the same way
        error = f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
    failed = first_error(error)
    if failed is None:
        return True
    if run.rank == 0:
        for tmp in (final.with_name("final.tmp"), final.with_name("final-merged.tmp")):
            shutil.rmtree(tmp, ignore_errors=True)
    kept = run.checkpointer.kept_note()
    recover = (f"{kept}: free space, then rerun with --resume_from_checkpoint auto, which writes the final model "
               f"without training further" if kept.startswith("kept") else
               "no checkpoint holds this run (save_steps: 0 keeps none), so it cannot be resumed")
    say_error(f"error (rank {run.rank}): the final model could not be written to {final} ({failed[1]}, on rank "
              f"{failed[0]}); removed the partial folder; {recover}")
    return False


def main(argv: list[str] | None = None) -> int:
    """`grpo-train`: the config from the command line, then the run (`execute`). Returns the exit code."""
    try:
        cfg = load_config(argv)
    except HelpRequested:
        if os.environ.get("RANK", "0") == "0":  # under a launcher, once
            print(help_text())
        return 0
    except ConfigError as e:
        say_error(f"config error: {e}")
        return 2
    return execute(cfg)


def execute(cfg: Config, data: tuple | None = None) -> int:
    """A whole run of a checked config: preflight, setup, the loop, the final model. `data`: (train, eval)
    `datasets.Dataset` objects given in Python (grpo_recipe.api) in place of the config's dataset names.
    Returns the exit code (0 done, 1 failed, 2 bad input, 75 stopped after a checkpoint)."""
    try:
        preflight(cfg, data_given=data is not None)  # files, the model, vLLM, rewards: before any process group
    except ConfigError as e:
        say_error(f"config error: {e}")
        return 2
    except LaunchError as e:  # e.g. more ranks on this node than GPUs it sees
        say_error(f"error: {e}")
        return 2
    if cfg.generation_ranks and layout(cfg.generation_ranks).is_generator:
        try:
            return serve(cfg, data)  # until the training ranks say stop
        except (ConfigError, DataError, LaunchError) as e:
            say_error(f"error (generation rank {os.environ.get('RANK')}): {e}")
            return 2
    try:
        run, state = setup(cfg, data)
    except StoppedAtStartup as e:
        say_error(f"{e}; exit {PREEMPTED_EXIT_CODE}: rerun to start")
        return PREEMPTED_EXIT_CODE
    except ConfigError as e:
        say_error(f"config error: {e}")
        return 2
    except (DataError, CheckpointError, VLLMUnavailable, RewardError, outdir.OutputDirError, LaunchError) as e:
        say_error(f"error: {e}")
        return 2
    try:
        records, preempted = train(run, state)
    except RewardError as e:  # a user's function misbehaved: say which, on every rank, without a traceback
        say_error(f"reward error (rank {run.rank}): {e}")
        return 1
    except (CheckpointError, NonFiniteError, GenerationError) as e:  # all ranks agreed; earlier checkpoints are intact
        say_error(f"error (rank {run.rank}): {e}")
        return 1
    final = Path(cfg.output_dir) / "final"
    if not preempted and not save_final(run, final):
        return 1
    if run.rank == 0:
        if preempted:
            saved = "checkpoint saved" if records else "nothing new to save (stopped during start-up)"
            if run.checkpointer.saved_step == state.step and state.step and not records:
                saved = "nothing new to save since the checkpoint it resumed from"
            again = "rerun with --resume_from_checkpoint auto to continue" if state.step else "rerun to start"
            print(f"stopped by {signals.pending() or 'a signal'} at step {state.step}; {saved}, "
                  f"exit {PREEMPTED_EXIT_CODE}; {again}", file=sys.stderr)
        else:
            first, last = reward_quarters(read_jsonl(Path(cfg.output_dir) / "metrics.jsonl") or records)
            print(f"reward_mean: first quarter {first:.3f} -> last quarter {last:.3f}")
            print(f"metrics: {Path(cfg.output_dir) / 'metrics.jsonl'}")
            print(f"model:   {final}")
    barrier()
    run.generator.close()  # last: vLLM's shutdown tears the process group down itself
    if dist.is_initialized():
        dist.destroy_process_group()
    return PREEMPTED_EXIT_CODE if preempted else 0


def cli() -> None:
    """`python -m grpo_recipe.train` and the `grpo-train` console script."""
    liveness.run_and_exit(main)  # a failed collective: one line naming the silent rank; no interpreter teardown


if __name__ == "__main__":
    cli()
