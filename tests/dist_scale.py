"""Worker (torchrun): partitioned loading, both HF generation modes, and bf16 training, on real gloo ranks.

    torchrun --nproc_per_node 2 tests/dist_scale.py OUT.pt

Rank 0 writes OUT.pt; tests/test_scale.py compares it with plain transformers / peft computations.
"""
import json
import sys
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
from dist_update import BASE, run_case

from grpo_recipe.config.schema import Config
from grpo_recipe.dist import liveness
from grpo_recipe.dist.group import init_distributed
from grpo_recipe.generation import build_generator
from grpo_recipe.model import engine as eng
from grpo_recipe.model.load import load_model, load_tokenizer
from grpo_recipe.model.source import model_path

DS_CONFIGS = ("ds_configs/zero3.json", "ds_configs/zero3_offload.json", "ds_configs/zero2.json")
REPO = Path(__file__).resolve().parent.parent
PROMPTS = ["TITLE: partitioned", "POST: every rank holds a slice of each weight, and only while it is loaded"]


def gathered_state(model) -> dict:
    """Every parameter in full (a collective under ZeRO-3), by name."""
    out = {}
    for n, p in model.named_parameters():
        with deepspeed.zero.GatheredParameters([p]) if hasattr(p, "ds_id") else torch.no_grad():
            out[n] = p.detach().clone()
    return out


def held_as_partitions(params, world: int) -> bool:
    """Each parameter is held as this rank's ceil(numel / world) elements and nothing more."""
    return all(hasattr(p, "ds_id") and p.data.numel() == 0 and p.ds_tensor.numel() == -(-p.ds_numel // world)
               for p in params)


def loading(rank, world, path, bin_folder: Path) -> dict:
    res = {}
    for ds in DS_CONFIGS:
        for peft in (False, True):
            cfg = Config(**{**BASE, "deepspeed_config": ds, "use_peft": peft, "lora_r": 4, "lora_alpha": 8})
            model = load_model(path, cfg, world)
            name = f"{ds.split('/')[-1].removesuffix('.json')}{'_lora' if peft else ''}"
            base = [p for n, p in model.named_parameters() if "lora_" not in n]
            zero3 = "zero3" in ds
            res[name] = {"partitioned": held_as_partitions(base, world) if zero3 else
                         not any(hasattr(p, "ds_id") for p in base)}
            if ds == "ds_configs/zero3.json":  # the weights themselves: once per model kind
                res[name]["state"] = gathered_state(model)
            if ds == "ds_configs/zero3_offload.json" and not peft:  # the engine takes a partitioned model
                engine = eng.init_engine(model, cfg, world)
                res[name]["engine_ok"] = eng.is_zero3(engine) and engine.zero_offload_param() is not None
                engine.destroy()
            del model
    # Linears that look like a tied output head but are not (the attention's square projections): left
    # unpartitioned at construction, partitioned after the tie, loaded like the rest
    from grpo_recipe.model import partitioned as partitioned_load

    shape_of_head = partitioned_load._tied_head_shape
    partitioned_load._tied_head_shape = lambda hf_config: (hf_config.hidden_size, hf_config.hidden_size)
    model = load_model(path, Config(**BASE), world)
    partitioned_load._tied_head_shape = shape_of_head
    res["square_heads"] = {"partitioned": held_as_partitions(list(model.parameters()), world),
                           "state": gathered_state(model)}
    # no safetensors: transformers' own ZeRO-3 loading, partitioned too
    cfg = Config(**BASE)
    model = load_model(str(bin_folder), cfg, world)
    res["bin"] = {"partitioned": held_as_partitions(list(model.parameters()), world), "state": gathered_state(model)}
    return res


def live_numel_during(engine, fn) -> tuple:
    """(result of fn(), the most parameter elements that were gathered at once while it ran)."""
    params = [p for p in engine.module.parameters() if not p.ds_persist]
    peak = [0]

    def hook(*_):
        peak[0] = max(peak[0], sum(p.ds_numel for p in params if p.ds_status.name != "NOT_AVAILABLE"))

    # a global hook: it runs whether or not the modules' own hooks are set aside (full generation sets them
    # aside), after each module's forward and before ZeRO-3's own post-forward hook releases its parameters
    handle = torch.nn.modules.module.register_module_forward_hook(hook)
    try:
        return fn(), peak[0]
    finally:
        handle.remove()


def bounded_zero3(out_dir: Path, rank: int) -> str:
    """zero3.json with nothing kept gathered after use or fetched ahead: the tightest per-layer bound."""
    conf = json.loads((REPO / "ds_configs/zero3.json").read_text())
    conf["zero_optimization"].update(stage3_max_reuse_distance=0, stage3_max_live_parameters=0,
                                     stage3_prefetch_bucket_size=0)
    path = out_dir / f"zero3_bounded.rank{rank}.json"
    path.write_text(json.dumps(conf))
    return str(path)


def generation(rank, world, path, out_dir: Path) -> dict:
    base = {**BASE, "max_completion_length": 10, "deepspeed_config": bounded_zero3(out_dir, rank)}
    cfg = Config(**base)
    engine = eng.init_engine(load_model(path, cfg, world), cfg, world)
    tok = load_tokenizer(path)
    prompt_ids = [tok(p).input_ids for p in PROMPTS]
    res = {"total_numel": sum(p.ds_numel for p in engine.module.parameters() if not p.ds_persist)}
    for mode in ("full", "per_layer"):
        gen = build_generator(Config(**{**base, "hf_generation_gather": mode}), engine, tok)
        # rank 1 generates for more prompts than rank 0: per-layer gathering must keep the ranks in step
        prompts = prompt_ids[:1 + rank % 2]
        sampled, peak = live_numel_during(engine, lambda: gen.generate(prompts, seed=11 + rank))
        gen.gen_config.do_sample = False
        res[mode] = {"sampled": sampled.ids, "greedy": gen.generate(prompts, seed=0).ids, "peak_live_numel": peak}
    engine.destroy()
    return res


def bf16(rank, world) -> dict:
    res = {}
    for name, flag in (("fp32", False), ("bf16", True)):
        cfg = Config(**{**BASE, "bf16": flag, "num_iterations": 2, "gradient_accumulation_steps": 2})
        engine, _, buf, _, _, outs = run_case(cfg, rank, world)
        from grpo_recipe.algo.update import forward_logps

        mb = buf.micro_batch(torch.arange(2))
        with torch.no_grad():
            logp = forward_logps(engine, mb["input_ids"], mb["attention_mask"], mb["completion_mask"].shape[1], 1.0)
        res[name] = {"losses": [o["loss"] for o in outs], "logp_dtype": str(logp.dtype),
                     "old_logps_dtype": str(buf.old_logps.dtype), "old_logps": buf.old_logps.clone(),
                     "param_dtype": str(next(engine.module.parameters()).dtype),
                     "grad_norm": [o.get("grad_norm") for o in outs]}
        engine.destroy()
    return res


def memory(rank, world, path, out_dir: Path) -> dict:
    """What a rank holds after engine set-up (the fp32 master is the parameter partition itself), and the final
    save written a shard at a time (small shards here, so that there are several)."""
    from grpo_recipe.model import save as save_mod
    from grpo_recipe.model.load import load_tokenizer as tokenizer_of

    cfg = Config(**BASE)
    engine = eng.init_engine(load_model(path, cfg, world), cfg, world)
    opt = engine.optimizer
    shared = all(m.data_ptr() == q.data_ptr() for m, q in zip(opt.fp32_partitioned_groups_flat,
                                                              opt.fp16_partitioned_groups_flat))
    run_case_state = gathered_state(engine.module)
    save_mod.SHARD_BYTES = 300_000  # bytes: several shards of the tiny model
    save_mod.save_hf_model(engine, tokenizer_of(path), out_dir / "final", rank)
    engine.destroy()
    return {"master_shared": shared, "gathered": run_case_state,
            "subgroups": len(opt.fp16_partitioned_groups_flat)}


def main():
    out = Path(sys.argv[1])
    rank, world = init_distributed()
    path = model_path(Config(**BASE))
    if rank == 0:  # the tiny model as a pytorch_model.bin folder
        from transformers import AutoModelForCausalLM

        (out.parent / "bin").mkdir()
        plain = AutoModelForCausalLM.from_pretrained(path)
        plain.config.save_pretrained(out.parent / "bin")
        torch.save(plain.state_dict(), out.parent / "bin" / "pytorch_model.bin")
    dist.barrier()
    res = {"world": world, "loading": loading(rank, world, path, out.parent / "bin"),
           "generation": generation(rank, world, path, out.parent), "bf16": bf16(rank, world),
           "memory": memory(rank, world, path, out.parent)}
    flags = torch.tensor([float(all(v["partitioned"] for v in res["loading"].values()))])
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    res["partitioned_on_every_rank"] = bool(flags[0])
    gens = [None] * world
    dist.all_gather_object(gens, res["generation"])
    res["generation_per_rank"] = gens
    if rank == 0:
        torch.save(res, out)
    dist.barrier()


if __name__ == "__main__":
    liveness.run_and_exit(main)  # no gloo/DeepSpeed teardown, which occasionally aborts a finished rank
