"""transformers' `generate` on the training engine's own weights: gathered once per rollout, or layer by layer."""
from __future__ import annotations

import torch
import torch.distributed as dist

from grpo_recipe.algo.buffer import left_pad
from grpo_recipe.dist.group import device
from grpo_recipe.generation.base import Completions, StopStrings, finish
from grpo_recipe.model.engine import gathered_for_generation


def stop_criteria(stops: list[str], tokenizer, prompt_width: int):
    """transformers' stopping criterion for our stop strings: the same test `finish` cuts with."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    test = StopStrings(stops, tokenizer)

    class _Stop(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            done = [test.hit(row[prompt_width:].tolist()) for row in input_ids]
            return torch.tensor(done, dtype=torch.bool, device=input_ids.device)

    return StoppingCriteriaList([_Stop()]) if test.stops else None


class HFGenerator:
    def __init__(self, cfg, engine, tokenizer):
        from transformers import GenerationConfig

        self.cfg, self.engine, self.tok = cfg, engine, tokenizer
        self.syncs = 0  # never needed: generation reads the live (gathered) parameters
        self.per_layer = cfg.hf_generation_gather == "per_layer"
        # per-layer gathering is collective at every forward: ranks whose samples all ended keep stepping
        self.synced = self.per_layer and dist.is_initialized() and dist.get_world_size() > 1
        # Explicit, so a model's own generation_config.json cannot change the sampling.
        self.gen_config = GenerationConfig(
            do_sample=True, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
            min_p=cfg.min_p or None, repetition_penalty=cfg.repetition_penalty,
            max_new_tokens=cfg.max_completion_length, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id, use_cache=True)
        self.greedy_config = GenerationConfig(
            do_sample=False, max_new_tokens=cfg.max_completion_length, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id, use_cache=True)

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], seed: int, n: int | None = None,
                 greedy: bool = False) -> Completions:
        n = 1 if greedy else n or self.cfg.num_generations
        ids, attn = left_pad([p for p in prompt_ids for _ in range(n)], self.tok.pad_token_id)
        width, dev = ids.shape[1], device()
        with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []), \
                gathered_for_generation(self.engine, self.per_layer) as model:
            torch.manual_seed(seed)
            was_training = model.training
            model.eval()
            out = model.generate(input_ids=ids.to(dev), attention_mask=attn.to(dev),
                                 generation_config=self.greedy_config if greedy else self.gen_config,
                                 synced_gpus=self.synced,
                                 stopping_criteria=stop_criteria(self.cfg.stop, self.tok, width))
            model.train(was_training)
        return finish(out[:, width:].tolist(), self.tok.eos_token_id, self.tok, self.cfg.max_completion_length,
                      self.cfg.stop)

    def sync(self, engine) -> None:
        pass

    def close(self) -> None:
        pass
