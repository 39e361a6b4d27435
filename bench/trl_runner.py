"""One TRL GRPOTrainer run for bench/vs_trl.py, launched by it under torchrun (one process per rank).

    python -m torch.distributed.run --nproc_per_node 2 bench/trl_runner.py SPEC.json

SPEC.json (written by vs_trl.py) holds the model folder, the prompt file, the DeepSpeed config file, the
recipe's reward specs and the GRPOConfig fields. Each rank appends one JSON line per event to
OUT/events-rankR.jsonl, stamped with time.perf_counter(): `train_begin`, `step_end` (after each optimizer
step), `generate`, `prepare`, `forward` and `backward` (each call of transformers' generate, of TRL's rollout
preparation, of its loss and of accelerate's backward, with its duration) and `rewards` (each reward call, i.e.
one generation on this rank: completions and mean reward). The callback and the wrappers only read a clock and
append a line; everything else is what a TRL user gets.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # the recipe's own reward functions, so both sides score with the same code
TRL_ONLY_KWARGS = ("trainer_state", "log_extra", "log_metric", "completion_ids", "environments")


def reward_wrapper(func, emit, as_text: bool = False):
    """A recipe RewardFunc as a TRL reward function (same call as the recipe makes), logging each call. With
    `as_text` (chat prompts given to TRL as messages where the recipe formats text prompts with the same chat
    template), the completions reach the function as text, as the recipe passes them."""
    from grpo_recipe.rewards.funcs import completion_text

    def reward(prompts, completions, **kwargs):
        columns = {k: v for k, v in kwargs.items() if k not in TRL_ONLY_KWARGS}
        if as_text:
            completions = [completion_text(c) for c in completions]
        values = [float(v) for v in func.fn(prompts=prompts, completions=completions, **columns, **func.kwargs)]
        emit("rewards", func=func.name, weight=func.weight, n=len(values), mean=sum(values) / len(values))
        return values

    reward.__name__ = func.name
    return reward


def timed(owner, method: str, event: str, emit) -> None:
    """Replace owner.method by a wrapper that emits `event` with the seconds each call took."""
    inner = getattr(owner, method)

    def wrapper(*a, **kw):
        t0 = time.perf_counter()
        result = inner(*a, **kw)
        emit(event, seconds=time.perf_counter() - t0)
        return result

    setattr(owner, method, wrapper)


def main(spec_path: str) -> int:
    import datasets
    import torch
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from grpo_recipe.rewards.funcs import load_reward_funcs

    spec = json.loads(Path(spec_path).read_text())
    out = Path(spec["output_dir"])
    rank = int(os.environ.get("RANK", "0"))
    out.mkdir(parents=True, exist_ok=True)
    events = (out / f"events-rank{rank}.jsonl").open("w")

    def emit(kind: str, **fields) -> None:
        events.write(json.dumps({"event": kind, "t": time.perf_counter(), **fields}) + "\n")
        events.flush()

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            emit("train_begin")
            if rank == 0:  # what DeepSpeed was given, once the Trainer filled the "auto" values
                ds = trainer.accelerator.state.deepspeed_plugin.deepspeed_config
                (out / "ds_config_resolved.json").write_text(json.dumps(ds, indent=1, default=str))

        def on_step_end(self, args, state, control, **kw):
            emit("step_end", step=state.global_step)
            # at mu = 1 with one optimizer step per generation, step k ends rollout k
            if budget is not None and budget.after(state.global_step, state.global_step, trainer.save_model):
                control.should_training_stop = True

    # Without GPUs accelerate picks no process-group backend for DeepSpeed and then counts a world of 1 (while
    # DeepSpeed itself joins both ranks), so the batch sizes it derives are wrong. Naming gloo, the backend
    # DeepSpeed falls back to on CPU, before TrainingArguments gives accelerate the world that DeepSpeed has.
    accel = {}
    if not torch.cuda.is_available():
        from accelerate import PartialState

        from grpo_recipe.dist.buildlock import load_comm_op

        load_comm_op()  # DeepSpeed's CPU comm op as the recipe's runs load it: built once, no stale lock

        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
        PartialState(backend="gloo")
        accel = {"accelerator_config": {"use_configured_state": True}}
    sys.path.insert(0, str(REPO / "bench"))
    from budget import RolloutBudget

    budget = RolloutBudget.from_env()  # bench/real_vs_trl.py: a budget in rollouts with snapshots
    funcs = load_reward_funcs(spec["reward_funcs"])
    dataset = datasets.load_dataset("json", data_files=spec["prompts_file"], split="train")
    args = GRPOConfig(output_dir=str(out), deepspeed=spec["deepspeed_config"], reward_weights=[f.weight for f in funcs],
                      model_init_kwargs={"dtype": torch.float32}, **accel, **spec["grpo_config"])
    as_text = bool(spec.get("chat_prompts"))
    trainer = GRPOTrainer(model=spec["model"], reward_funcs=[reward_wrapper(f, emit, as_text) for f in funcs], args=args,
                          train_dataset=dataset, callbacks=[Clock()])
    # Phases timed from outside (their behaviour untouched): generation; the whole rollout preparation (generation,
    # rewards, old and reference log-probs); forward + loss; backward (accelerate's DeepSpeed backward also runs
    # the engine's step, so the optimizer step at an accumulation boundary is inside it).
    timed(trainer, "_generate_single_turn", "generate", emit)
    timed(trainer, "_generate_and_score_completions", "prepare", emit)
    timed(trainer, "compute_loss", "forward", emit)
    timed(trainer.accelerator, "backward", "backward", emit)
    trainer.train()
    if rank == 0:
        (out / "log_history.json").write_text(json.dumps(trainer.state.log_history))
    events.close()
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    from grpo_recipe.dist import liveness

    liveness.run_and_exit(lambda: main(sys.argv[1]))  # no interpreter teardown, as in grpo_recipe/train.py
