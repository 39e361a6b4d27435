"""Worker (run under torchrun): TRL 1.16's own GRPOTrainer over one generation, for tests/test_update_trl.py.

    torchrun --nproc_per_node 2 tests/dist_trl_step.py SPEC.json

SPEC.json: output_dir, model (a folder), prompts_file, deepspeed_config and the GRPOConfig fields. The trainer is
what a TRL user runs (ZeRO-3 through accelerate, transformers' generate); two hooks only read: each rank saves what
`_generate_and_score_completions` returned (OUT/rollout-rankR.pt: the prompt and completion ids and masks, the
advantages, the old log-probs), and a callback saves the gathered weights after every optimizer step
(OUT/step-K, `trainer.save_model`); rank 0 writes TRL's logs (OUT/log_history.json).
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
KEEP = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages", "old_per_token_logps")


def reward(prompts, completions, **kwargs):
    """Deterministic and spread within a group: the completion's characters, summed, mod 7."""
    return [float(sum(map(ord, c)) % 7) for c in completions]


def main(spec_path: str) -> int:
    import datasets
    from accelerate import PartialState
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from grpo_recipe.dist.buildlock import load_comm_op

    spec = json.loads(Path(spec_path).read_text())
    out = Path(spec["output_dir"])
    rank = int(os.environ.get("RANK", "0"))
    # as bench/trl_runner.py: on CPU accelerate must be told gloo before it counts DeepSpeed's world
    load_comm_op()
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    PartialState(backend="gloo")

    class SaveEachStep(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            trainer.save_model(str(out / f"step-{state.global_step}"))

    args = GRPOConfig(output_dir=str(out), deepspeed=spec["deepspeed_config"],
                      model_init_kwargs={"dtype": torch.float32}, accelerator_config={"use_configured_state": True},
                      **spec["grpo_config"])
    dataset = datasets.load_dataset("json", data_files=spec["prompts_file"], split="train")
    trainer = GRPOTrainer(model=spec["model"], reward_funcs=[reward], args=args, train_dataset=dataset,
                          callbacks=[SaveEachStep()])
    generate = trainer._generate_and_score_completions
    calls = []

    def recorded(*a, **kw):
        batch = generate(*a, **kw)
        calls.append({k: batch[k].detach().cpu().clone() for k in KEEP if batch.get(k) is not None})
        torch.save(calls, out / f"rollout-rank{rank}.pt")
        return batch

    trainer._generate_and_score_completions = recorded
    trainer.train()
    if rank == 0:
        (out / "log_history.json").write_text(json.dumps(trainer.state.log_history))
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    from grpo_recipe.dist import liveness

    liveness.run_and_exit(lambda: main(sys.argv[1]))
