"""Worker (torchrun): a colocated vLLM engine per rank, synced from ZeRO-3 shards after real training steps.

Each round: one GRPO optimizer step on the ZeRO-3 engine, then checks that vLLM is stale before the
sync and matches the trained weights after it: greedy tokens equal transformers' greedy decoding of a
plain model holding the gathered weights, and the sampler's log-probs equal the trainer's own
log-probs of the sampled tokens. Writes OUT.json on rank 0 (all flags reduced over ranks).

Usage: dist_vllm.py OUT.json TP  (TP 2: the two ranks share one tensor-parallel engine, each with its own prompts)
"""
import json
import sys
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist

from grpo_recipe.algo.buffer import RolloutBuffer
from grpo_recipe.algo.update import forward_logps, train_on_rollout
from grpo_recipe.config.schema import Config
from grpo_recipe.dist import liveness
from grpo_recipe.dist.group import init_distributed
from grpo_recipe.generation import build_generator, finish
from grpo_recipe.generation.vllm import cpu_shm_segments
from grpo_recipe.model import engine as eng
from grpo_recipe.model.load import load_model, load_tokenizer
from grpo_recipe.model.source import model_path

ROUNDS = 2


def hf_greedy(model, tok, prompts, max_new):
    outs = []
    for p in prompts:  # one at a time: no padding, nothing for the comparison to depend on
        ids = torch.tensor([p])
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        outs.append(out[0, len(p):].tolist())
    return finish(outs, tok.eos_token_id, tok, max_new).ids


def plain_copy(engine, path, cfg):
    """A plain transformers model holding the engine's current (gathered) weights."""
    model = load_model(path, cfg).eval()
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=None):
        model.load_state_dict({k: v.clone() for k, v in engine.module.state_dict().items()}, strict=False)
    model.tie_weights()
    return model


def grpo_round(gen, engine, tok, prompts, r, ref=None):
    """A real GRPO step on a fresh rollout of 2 samples per prompt (the advantages only need to move the weights);
    `ref`: the KL term's reference (gen.cfg.beta > 0)."""
    comp = gen.generate(prompts, seed=100 * r + dist.get_rank())
    advantages = torch.tensor([1.0, -1.0] * len(prompts))
    buf = RolloutBuffer.build([p for p in prompts for _ in range(2)], comp.ids, advantages, comp.mask,
                              tok.pad_token_id, order_seed=r, sampling_logps=comp.logps)
    (step,) = train_on_rollout(engine, ref, buf, gen.cfg)  # mu = 1, one step: the whole rollout
    return step.stats


def main():
    out, tp = sys.argv[1], int(sys.argv[2])
    rank, world = init_distributed()
    cfg = Config(generation_backend="vllm", num_iterations=1, num_generations=2, per_device_train_batch_size=4,
                 max_completion_length=12, max_prompt_length=32, learning_rate=0.05, top_k=0, vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_max=2.0,
                 vllm_tensor_parallel_size=tp)
    path = model_path(cfg)
    tok = load_tokenizer(path)
    engine = eng.init_engine(load_model(path, cfg), cfg, world)
    gen = build_generator(cfg, engine, tok)
    gen.chunk_numel = 40_000  # several gathers per sync even for the tiny model
    # which F.linear vLLM's model sees when it runs (zero.Init installed ZeRO-3's for the whole process)
    from deepspeed.runtime.zero.partition_parameters import InsertPostInitMethodToModuleSubClasses as patcher

    linear_seen = []
    vllm_model = gen.llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
    vllm_model.register_forward_pre_hook(
        lambda m, a: linear_seen.append(torch.nn.functional.linear is getattr(patcher, "linear_bk", None)))
    chunks = [0]
    orig_gather = deepspeed.zero.GatheredParameters.__enter__

    def counting_enter(self):
        chunks[0] += 1
        return orig_gather(self)

    deepspeed.zero.GatheredParameters.__enter__ = counting_enter
    prompts = [tok(f"TITLE: rank {rank} asks about").input_ids, tok("POST: my landlord wants the deposit").input_ids]
    init_greedy = hf_greedy(load_model(path, cfg).eval(), tok, prompts, cfg.max_completion_length)
    flags = {"greedy_before_training": gen_greedy(gen, prompts) == init_greedy}
    logp_err, results = 0.0, []
    for r in range(ROUNDS):
        stats = grpo_round(gen, engine, tok, prompts, r)
        trained = hf_greedy(plain_copy(engine, path, cfg), tok, prompts, cfg.max_completion_length)
        stale = engine_greedy(gen, prompts)  # straight to vLLM: generate() would sync a stale engine itself
        chunks[0] = 0
        gen.sync(engine)
        synced_chunks = chunks[0]
        after = gen_greedy(gen, prompts)
        # the sampler's log-probs of sampled tokens vs the trainer's forward on the same tokens
        comp = gen.generate(prompts, seed=7 + rank)
        buf = RolloutBuffer.build([p for p in prompts for _ in range(2)], comp.ids, torch.zeros(4), comp.mask,
                                  tok.pad_token_id, order_seed=0, sampling_logps=comp.logps)
        with torch.no_grad():
            lp = forward_logps(engine, buf.input_ids, buf.attention_mask, buf.completion_mask.shape[1], 1.0)
        m = buf.completion_mask.bool()
        logp_err = max(logp_err, (lp - buf.sampling_logps)[m].abs().max().item())
        results.append({"stale_differs": stale != trained, "after_matches": after == trained,
                        "weights_moved": trained != init_greedy, "chunks": synced_chunks,
                        "is_ratio_mean": stats["is_ratio_mean"], "is_ratio_max": stats["is_ratio_max"]})
    flat = torch.tensor([float(flags["greedy_before_training"])]
                        + [float(x[k]) for x in results for k in ("stale_differs", "after_matches", "weights_moved")])
    dist.all_reduce(flat, op=dist.ReduceOp.MIN)
    err = torch.tensor([logp_err])
    dist.all_reduce(err, op=dist.ReduceOp.MAX)
    report = {"greedy_before_training": bool(flat[0]), "syncs": gen.syncs, "logp_max_abs_err": err.item(),
              "zero3_linear_installed": torch.nn.functional.linear is not getattr(patcher, "linear_bk", None),
              "vllm_forwards_with_torch_linear": [sum(linear_seen), len(linear_seen)],
              "rounds": [{**x, **{k: bool(flat[1 + 3 * i + j]) for j, k in
                                  enumerate(("stale_differs", "after_matches", "weights_moved"))}}
                         for i, x in enumerate(results)]}
    if rank == 0:
        json.dump(report, open(out, "w"))
    dist.barrier()
    segments = cpu_shm_segments()
    gen.close()  # last: vLLM's shutdown tears down the default process group
    # what close left of this rank's shared memory (the process then ends without running destructors)
    Path(f"{out}.shm{rank}").write_text(json.dumps({"made": [str(p) for p in segments],
                                                    "left": [str(p) for p in segments if p.exists()]}))


def engine_greedy(gen, prompts):
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=gen.cfg.max_completion_length, stop_token_ids=[gen.tok.eos_token_id])
    mine = slice(0, len(prompts))
    if gen.tp > 1:  # a tensor-parallel group's engines must see identical requests
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, prompts)
        mine = slice(dist.get_rank() * len(prompts), (dist.get_rank() + 1) * len(prompts))
        prompts = [p for part in parts for p in part]
    with eng.torch_linear():  # as the generator runs vLLM
        outs = gen.llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False,
                                lora_request=gen.adapter.request if gen.adapter else None)[mine]
    return finish([list(o.outputs[0].token_ids) for o in outs], gen.tok.eos_token_id, gen.tok,
                  gen.cfg.max_completion_length).ids


def gen_greedy(gen, prompts):
    """The backend's own generate path with top_k = 1 (greedy, whatever the temperature)."""
    gen.cfg.top_k = 1
    try:
        return gen.generate(prompts, seed=0).ids[::gen.cfg.num_generations]
    finally:
        gen.cfg.top_k = 0


if __name__ == "__main__":
    liveness.run_and_exit(main)  # no gloo/DeepSpeed teardown, which occasionally aborts a finished rank
