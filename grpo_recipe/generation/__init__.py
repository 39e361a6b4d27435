"""Generation backends behind one small interface (`base.py`: generate, sync, close): `hf.py` and `vllm.py`;
`remote.py`: generation on ranks of its own (`generation_ranks`). `build_generator` picks the config's; the
training loop never asks which one it has. Imports config, dist, algo, data and model.
"""
from __future__ import annotations

from grpo_recipe.generation.base import (
    Completions,
    GenerationError,
    Generator,
    finish,
    generate_on_every_rank,
    rollout_seed,
)

__all__ = ["Completions", "GenerationError", "Generator", "build_generator", "finish", "generate_on_every_rank",
           "rollout_seed"]


def build_generator(cfg, engine, tokenizer) -> Generator:
    if cfg.generation_ranks:
        from grpo_recipe.generation.remote import RemoteGenerator

        return RemoteGenerator(cfg, engine, tokenizer)
    if cfg.generation_backend == "hf":
        from grpo_recipe.generation.hf import HFGenerator

        return HFGenerator(cfg, engine, tokenizer)
    if cfg.generation_backend == "vllm":
        from grpo_recipe.generation.vllm import VLLMGenerator
        from grpo_recipe.model.source import model_path

        return VLLMGenerator(cfg, engine, tokenizer, model_path(cfg))
    raise ValueError(f"generation_backend: unknown {cfg.generation_backend!r}")
