"""Measured parts of bench/scale.py, each in fresh processes (torchrun ranks or one plain process).

    torchrun ... bench/scale_worker.py startup MODEL_DIR OUT.json before|after policy|policy+reference|reference
    python      bench/scale_worker.py logprob  MODEL_DIR OUT.json before|after CHECKPOINTING BF16 B P C
    torchrun ... bench/scale_worker.py throughput MODEL_DIR OUT.json before|after SAMPLES MICRO_BATCH MAX_C

"before" is today's code path, reproduced here in a few lines (the recipe keeps only the new one): loading
the whole model with `from_pretrained` on every rank, log-probs from full-sequence logits upcast to fp32, and
micro-batches padded to the rollout's longest prompt and completion in schedule order.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]
from measure import PeakSampler  # noqa: E402 -- after the path set-up


def config(model_dir: str, **overrides):
    from grpo_recipe.config.schema import Config

    base = dict(model_name_or_path=model_dir, num_generations=2, per_device_train_batch_size=2, learning_rate=1e-5,
                num_iterations=1, max_completion_length=512, max_prompt_length=64, bf16=False)
    return Config(**{**base, **overrides})


def todays_model(path: str):
    """Today's load_model: the whole model on every rank, fp32, dropout off."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    return model


def warm_up_imports(model_dir: str) -> None:
    """Import what loading imports (transformers' model code, DeepSpeed's engine), so that the baseline is
    the process ready to load and the figures are the loading itself."""
    import deepspeed.runtime.engine  # noqa: F401
    import deepspeed.runtime.zero.stage3  # noqa: F401
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = AutoConfig.from_pretrained(model_dir)
    AutoModelForCausalLM.from_config(type(hf)(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                                              num_attention_heads=1, num_key_value_heads=1))


def startup(model_dir: str, out: str, variant: str, what: str) -> None:
    """Peak private memory per rank from before loading to ready engines, phase by phase, as grpo_recipe.train's
    setup builds them: `policy`, `policy+reference` (beta > 0), or the `reference` alone (its own cost, free
    of what the policy's phases leave in the allocator)."""
    import deepspeed

    from grpo_recipe.dist.group import init_distributed
    from grpo_recipe.model import engine as eng
    from grpo_recipe.model.load import load_model

    rank, world = init_distributed()
    cfg = config(model_dir, beta=0.04 if "reference" in what else 0.0)
    warm_up_imports(model_dir)
    sampler = PeakSampler()
    engine = None
    if "policy" in what:
        model = todays_model(model_dir) if variant == "before" else load_model(model_dir, cfg, world)
        sampler.mark("policy_load")
        engine = eng.init_engine(model, cfg, world)
        sampler.mark("policy_engine")
    if "reference" in what:
        if variant == "before":  # today's init_reference: the whole model again, an engine without optimizer
            ref = todays_model(model_dir).requires_grad_(False)
            ref, *_ = deepspeed.initialize(model=ref, config=eng.ds_config(cfg, world, ref.config.hidden_size,
                                                                            train=False))
        else:
            ref = eng.init_reference(model_dir, cfg, world, engine)
        sampler.mark("reference")
    res = sampler.stop()
    module = (engine or ref).module
    res.update(rank=rank, world=world, variant=variant, what=what,
               model_numel=sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in module.parameters()))
    write_per_rank(out, rank, res)


def todays_forward_logps(model, input_ids, attention_mask, completion_len: int, temperature: float,
                         with_entropy: bool = False, entropy_grad: bool = False):
    """Today's forward_logps: logits for every position, the completion slice upcast to fp32 (and, as the
    recipe's, each position's entropy when the loop asks for it)."""
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                   use_cache=False).logits
    logits = logits[:, -completion_len - 1:-1].float() / temperature
    ids = input_ids[:, -completion_len:]
    lse = torch.logsumexp(logits, dim=-1)
    logps = torch.gather(logits, -1, ids.unsqueeze(-1)).squeeze(-1) - lse
    if not with_entropy:
        return logps
    with torch.no_grad():
        return logps, lse - (torch.softmax(logits, -1) * logits).sum(-1)


def logprob(model_dir: str, out: str, variant: str, checkpointing: bool, bf16: bool, batch: int = 2,
            prompt: int = 64, completion: int = 512) -> None:
    """Peak private memory of one micro-batch's log-prob forward (with the entropy metric, as the training
    forward computes it) and backward, over the model's weights and gradients (allocated beforehand, as they are
    in training). bf16: the module in bf16, as DeepSpeed runs it."""
    from grpo_recipe.algo.update import forward_logps

    torch.manual_seed(0)
    model = todays_model(model_dir).train()
    if bf16:
        model = model.to(torch.bfloat16)
    if checkpointing:
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    vocab = model.config.vocab_size
    ids = torch.randint(1, vocab, (batch, prompt + completion))
    attn = torch.ones_like(ids)
    fn = todays_forward_logps if variant == "before" else forward_logps
    sampler = PeakSampler()
    t0 = time.perf_counter()
    logp, _ = fn(model, ids, attn, completion, 1.0, with_entropy=True)  # as the training forward asks
    (-logp.mean()).backward()
    seconds = time.perf_counter() - t0
    sampler.mark("logprob_fwd_bwd")
    res = sampler.stop()
    res.update(variant=variant, checkpointing=checkpointing, bf16=bf16, batch=batch, prompt=prompt, completion=completion,
               seconds=seconds, model_numel=sum(p.numel() for p in model.parameters()),
               logits_bytes_fp32=batch * (prompt + completion) * vocab * 4)
    Path(out).write_text(json.dumps(res))


def todays_batching():
    """Today's micro-batches: schedule order (no grouping by length), every micro-batch as wide as the rollout."""
    from grpo_recipe.algo.buffer import RolloutBuffer

    class TodaysBuffer(RolloutBuffer):
        def _by_length(self, idx):
            return idx

        def micro_batch(self, idx):
            return {"input_ids": self.input_ids[idx], "attention_mask": self.attention_mask[idx],
                    "completion_mask": self.completion_mask[idx], "advantages": self.advantages[idx],
                    "old_logps": self.old_logps[idx], "has_old_logps": self.has_old_logps[idx],
                    "sampling_logps": self.sampling_logps[idx], "index": idx}

    return TodaysBuffer


def varied_rollout(n: int, vocab: int, seed: int, prompt=(16, 64), completion=(16, 512)):
    """n samples: prompt and completion lengths uniform in the given ranges, random tokens and advantages."""
    g = torch.Generator().manual_seed(seed)
    p_lens = torch.randint(prompt[0], prompt[1] + 1, (n,), generator=g)
    c_lens = torch.randint(completion[0], completion[1] + 1, (n,), generator=g)
    prompts = [torch.randint(1, vocab, (int(k),), generator=g).tolist() for k in p_lens]
    comps = [torch.randint(1, vocab, (int(k),), generator=g).tolist() for k in c_lens]
    mask = (torch.arange(completion[1]) < c_lens.unsqueeze(1)).float()
    return prompts, comps, torch.randn(n, generator=g), mask


def bounded_zero3(folder: Path, rank: int) -> str:
    """zero3.json gathering at most 1e8 parameters at a time (the shipped 1e9 is the whole 0.5B model): two
    0.5B training ranks then fit this 24 GiB machine."""
    conf = json.loads((Path(__file__).resolve().parent.parent / "ds_configs" / "zero3.json").read_text())
    conf["zero_optimization"].update(stage3_max_live_parameters=int(1e8), stage3_max_reuse_distance=int(1e8))
    path = folder / f"zero3_bounded.rank{rank}.json"
    path.write_text(json.dumps(conf))
    return str(path)


def throughput(model_dir: str, out: str, variant: str, samples: int, micro_batch: int, max_c: int) -> None:
    """Training tokens per second of one rollout's update (one optimizer step per rank-local rollout of
    `samples`), today's batching and log-probs against the recipe's; the rest is the recipe's own update, in
    bf16 with gradient checkpointing (how large models train)."""
    from measure import update

    from grpo_recipe.algo import update as upd
    from grpo_recipe.algo.buffer import RolloutBuffer
    from grpo_recipe.dist.group import init_distributed
    from grpo_recipe.model import engine as eng
    from grpo_recipe.model.load import load_model

    rank, world = init_distributed()
    cfg = config(model_dir, per_device_train_batch_size=micro_batch, gradient_accumulation_steps=samples // micro_batch,
                 gradient_checkpointing=True, max_completion_length=max_c, bf16=True,
                 deepspeed_config=bounded_zero3(Path(out).parent, rank))
    buffer_cls = RolloutBuffer
    if variant == "before":
        upd.forward_logps, buffer_cls = todays_forward_logps, todays_batching()
    engine = eng.init_engine(load_model(model_dir, cfg, world), cfg, world)
    prompts, comps, adv, mask = varied_rollout(samples, engine.module.config.vocab_size, seed=rank,
                                               completion=(min(16, max_c), max_c))
    buf = buffer_cls.build(prompts, comps, adv, mask, pad_id=0, order_seed=rank)
    torch.distributed.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    (out_step,) = update(engine, buf, cfg)
    seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
    res = {"variant": variant, "rank": rank, "seconds": seconds, "cpu_seconds": cpu_seconds, "loss": out_step["loss"],
           "grad_norm": out_step.get("grad_norm"), "train_tokens": out_step["train_tokens"],
           "tokens_per_s": out_step["train_tokens"] / seconds, "completion_lengths": [len(c) for c in comps],
           "prompt_lengths": [len(p) for p in prompts]}
    write_per_rank(out, rank, res)


def write_per_rank(out: str, rank: int, res: dict) -> None:
    Path(f"{out}.rank{rank}").write_text(json.dumps(res))


def main() -> None:
    part, model_dir, out, variant, *rest = sys.argv[1:]
    if part == "startup":
        startup(model_dir, out, variant, rest[0])
    elif part == "throughput":
        throughput(model_dir, out, variant, *map(int, rest))
    elif part == "logprob":
        logprob(model_dir, out, variant, rest[0] == "1", rest[1] == "1", *map(int, rest[2:]))
    else:
        raise SystemExit(f"unknown part {part}")


if __name__ == "__main__":
    from grpo_recipe.dist import liveness

    liveness.run_and_exit(main)  # no gloo/DeepSpeed teardown (see grpo_recipe.dist.liveness)
