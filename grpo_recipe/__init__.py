"""GRPO with multi-step rollout reuse on DeepSpeed ZeRO-3.

One folder per concern. Each imports only the folders before it in this order (tests/test_imports.py holds it):

    config      the Config dataclass, YAML + CLI loading, --help, the checks of each field. A leaf.
    dist        the process group, named collectives, liveness, rendezvous, exit codes, rank environment,
                build locks. Knows nothing of models.
    algo        the GRPO math and its small state: log-probs, losses, advantages, the rollout buffer, the update
                protocol, the reuse rule, the LR schedule, the phase clock. torch only, no DeepSpeed import.
    data        prompt datasets: loading, formatting, truncation, rank sharding, epoch order.
    rewards     built-in and user reward functions: loading, weighting, output validation, scoring.
    model       where a model comes from, loading (partitioned, LoRA), the DeepSpeed engines, saving, a warm-up.
    generation  one interface (generate, sync, release, close) and its backends, transformers and vLLM; multi-turn
                rollouts with tools and environments.
    run         the parts of a run: preflight, output folder, checkpoints, metrics, trackers, evaluation.
    tools       the command-line programs: evaluate, export, prepare_model, prepare_data, make_gsm8k_like, sft.
    examples    rewards, tools and environments for the shipped configs (user code: imports what a user's would).
    train       the recipe: setup and the training loop (`python -m grpo_recipe.train`, `grpo-train`).
    api         the recipe from Python: `from grpo_recipe import GRPORun` (a user's own script).

Files that ship with the package: configs/ (YAML) and assets/ (sample prompt sets).
"""

# The import order above, bottom first; tools, examples and train may import every folder before them, not each
# other; api imports train.
LAYERS = ("config", "dist", "algo", "data", "rewards", "model", "generation", "run", "tools", "examples", "train", "api")
TOP = ("tools", "examples", "train")  # api, above them all, is the recipe itself called from Python


def __getattr__(name: str):
    """`from grpo_recipe import GRPORun`, imported on first use (the package itself stays light)."""
    if name == "GRPORun":
        from grpo_recipe.api import GRPORun

        return GRPORun
    raise AttributeError(f"module 'grpo_recipe' has no attribute {name!r}")
