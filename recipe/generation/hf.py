"""transformers' `generate` on the training engine's own weights, gathered once per rollout."""
from __future__ import annotations

import torch

from recipe.data import left_pad
from recipe.engine import device, gathered_for_generation
from recipe.generation.base import Completions, finish


class HFGenerator:
    def __init__(self, cfg, engine, tokenizer):
        from transformers import GenerationConfig

        self.cfg, self.engine, self.tok = cfg, engine, tokenizer
        self.syncs = 0  # never needed: generation reads the live (gathered) parameters
        # Explicit, so a model's own generation_config.json cannot change the sampling.
        self.gen_config = GenerationConfig(
            do_sample=True, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
            max_new_tokens=cfg.max_completion_length, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id, use_cache=True)

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], seed: int) -> Completions:
        ids, attn = left_pad([p for p in prompt_ids for _ in range(self.cfg.num_generations)], self.tok.pad_token_id)
        width, dev = ids.shape[1], device()
        with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []), \
                gathered_for_generation(self.engine) as model:
            torch.manual_seed(seed)
            was_training = model.training
            model.eval()
            out = model.generate(input_ids=ids.to(dev), attention_mask=attn.to(dev),
                                 generation_config=self.gen_config)
            model.train(was_training)
        return finish(out[:, width:].tolist(), self.tok.eos_token_id, self.tok, self.cfg.max_completion_length)

    def sync(self, engine) -> None:
        pass

    def close(self) -> None:
        pass
