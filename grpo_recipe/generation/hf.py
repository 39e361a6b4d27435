"""transformers' `generate` on the training engine's own weights (gathered once per rollout, or layer by layer),
or on a plain model (a generation rank's copy, generation/remote.py)."""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from grpo_recipe.algo.buffer import left_pad
from grpo_recipe.dist import allocator
from grpo_recipe.dist.collectives import device
from grpo_recipe.generation.base import Completions, StopStrings, finish
from grpo_recipe.model.engine import gathered_for_generation


def stop_criteria(stops: list[str], tokenizer, prompt_width: int):
    """transformers' stopping criterion for our stop strings: the same test `finish` cuts with."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    test = StopStrings(stops, tokenizer)

    class _Stop(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            # the test reads only the newest `window` tokens: one copy to the host per step, not one per row
            tail = input_ids[:, max(prompt_width, input_ids.shape[1] - test.window):].tolist()
            done = [test.hit(row) for row in tail]
            return torch.tensor(done, dtype=torch.bool, device=input_ids.device)

    return StoppingCriteriaList([_Stop()]) if test.stops else None


class SampledLogps:
    """A logits processor that keeps the sampler's log-prob of each token it picks, log softmax(logits / T) as
    the trainer scores it, holding one step's [samples, vocabulary] at a time (`output_logits` would keep every
    step's). It runs before the sampling warpers (transformers puts a caller's processors ahead of them)."""

    def __init__(self, temperature: float):
        self.temperature, self.last, self.picked = temperature, None, []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.last is not None:  # the token sampled from the previous step's scores is the last input now
            self.picked.append(self.last.gather(-1, input_ids[:, -1:]).squeeze(-1))  # on the device until the end
        self.last = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        return scores

    def logps(self, new: torch.Tensor) -> torch.Tensor:
        """[samples, new tokens], given the new tokens (the last one has no later call)."""
        if self.last is not None and len(self.picked) < new.shape[1]:
            self.picked.append(self.last.gather(-1, new[:, -1:].to(self.last.device)).squeeze(-1))
        self.last = None
        return torch.stack(self.picked, dim=1).cpu() if self.picked else torch.zeros(new.shape[0], 0)


class HFGenerator:
    def __init__(self, cfg, engine, tokenizer, model=None, with_logps: bool = False):
        """On `engine`'s weights, or on `model` (plain, whole) when given; `with_logps`: report the sampler's
        log-probs of softmax(logits / temperature), as the trainer scores them."""
        from transformers import GenerationConfig

        self.cfg, self.engine, self.tok, self.model, self.with_logps = cfg, engine, tokenizer, model, with_logps
        self.syncs = 0  # never needed: generation reads the live (gathered) parameters
        self.stats: dict = {}
        self.per_layer = cfg.hf_generation_gather == "per_layer" and model is None
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
                 greedy: bool = False, rollout: int | None = None) -> Completions:
        n = 1 if greedy else n or self.cfg.num_generations
        ids, attn = left_pad([p for p in prompt_ids for _ in range(n)], self.tok.pad_token_id)
        width, dev = ids.shape[1], device()
        sampled = SampledLogps(self.cfg.temperature) if self.with_logps and not greedy else None
        weights = contextlib.nullcontext(self.model) if self.model is not None else \
            gathered_for_generation(self.engine, self.per_layer)
        # the heap reused for the decode steps' blocks only, not for the gathered weights (those go back at the end)
        with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []), weights as model, \
                allocator.reusing_heap():
            torch.manual_seed(seed)
            was_training = model.training
            model.eval()
            out = model.generate(input_ids=ids.to(dev), attention_mask=attn.to(dev),
                                 generation_config=self.greedy_config if greedy else self.gen_config,
                                 synced_gpus=self.synced, logits_processor=[sampled] if sampled else None,
                                 stopping_criteria=stop_criteria(self.cfg.stop, self.tok, width))
            model.train(was_training)
        new = out[:, width:]
        comp = finish(new.tolist(), self.tok.eos_token_id, self.tok, self.cfg.max_completion_length, self.cfg.stop)
        if sampled is not None:
            comp.logps = sampled.logps(new)[:, :comp.mask.shape[1]] * comp.mask
        return comp

    def sync(self, engine) -> None:
        pass

    def state_dict(self) -> dict | None:
        return None

    def load_state_dict(self, state: dict | None) -> None:
        pass

    def release(self) -> None:
        pass  # nothing is held between calls: the gathered weights go back to their shards after each

    def close(self) -> None:
        pass
