"""Worker (torchrun): LoRA under ZeRO-3 -- the update, the adapter-disabled reference, merged generation,
merge/unmerge cycles and saving, on one engine.

    torchrun --nproc_per_node 2 tests/dist_lora.py OUT_DIR

Rank 0 writes OUT_DIR/lora.pt and the recipe's saved folders OUT_DIR/final and OUT_DIR/final-merged; the
test compares them with single-process peft and plain-PyTorch computations.
"""
import sys
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
from dist_update import BASE, run_case

from grpo_recipe.algo.update import forward_logps
from grpo_recipe.config.schema import Config
from grpo_recipe.dist import liveness
from grpo_recipe.dist.group import init_distributed
from grpo_recipe.generation import build_generator
from grpo_recipe.model import engine as eng
from grpo_recipe.model.load import load_tokenizer
from grpo_recipe.model.save import save_hf_model
from grpo_recipe.model.source import model_path

CASE = dict(use_peft=True, lora_r=16, lora_alpha=32, loss_type="grpo", num_iterations=2, optimizer_steps_per_pass=2,
            gradient_accumulation_steps=2, beta=0.1)
PROMPTS = ["TITLE: merged adapters", "POST: greedy tokens from the merged weights, please"]
PROBE = "model.layers.0.self_attn.q_proj"  # one LoRA layer whose merged weight the test recomputes


def consolidated(engine) -> dict:
    state = engine._zero3_consolidated_16bit_state_dict()  # collective; the dict only on rank 0
    return {k: v.clone() for k, v in state.items()} if state else {}


def main():
    out = Path(sys.argv[1])
    rank, world = init_distributed()
    cfg = Config(**{**BASE, **CASE, "max_completion_length": 12})
    # 1. the recipe's LoRA update on the fixed rollout (beta > 0: the reference is the adapter-disabled policy)
    engine, ref, buf, _, _, _ = run_case(cfg, rank, world)
    res = {"trained": consolidated(engine)}
    mb = buf.micro_batch(torch.arange(len(buf)))
    c_len = mb["completion_mask"].shape[1]
    with torch.no_grad():
        res["ref_logps"] = forward_logps(ref, mb["input_ids"], mb["attention_mask"], c_len, 1.0)
        res["policy_logps"] = forward_logps(engine, mb["input_ids"], mb["attention_mask"], c_len, 1.0)
    # 2. a large adapter, so that it clearly changes greedy tokens: random lora_B, set on rank 0 and broadcast
    lora_b = [p for n, p in engine.module.named_parameters() if "lora_B" in n]
    with deepspeed.zero.GatheredParameters(lora_b, modifier_rank=0):
        if rank == 0:
            g = torch.Generator().manual_seed(1)
            for p in lora_b:
                p.data.copy_(torch.randn(p.shape, generator=g) * 0.2)
    res["before_cycles"] = consolidated(engine)
    # 3. greedy generation through the recipe's generator (gathered, adapter merged): merge/unmerge cycle 1
    tok = load_tokenizer(model_path(cfg))
    gen = build_generator(cfg, engine, tok)
    gen.gen_config.do_sample = False
    prompt_ids = [tok(p).input_ids for p in PROMPTS]
    res["merged_greedy"] = gen.generate(prompt_ids, seed=0).ids[::cfg.num_generations]
    # 4. cycles 2..10, each with a forward on the merged weights; record what the merged layer held
    probe = engine.module.get_submodule("base_model.model." + PROBE)
    for _ in range(9):
        with eng.gathered_for_generation(engine) as model:
            res["merged_flags"] = [m.merged for m in model.modules() if hasattr(m, "merged_adapters")]
            res["merged_probe"] = probe.base_layer.weight.detach().clone()
            model(input_ids=mb["input_ids"][:2], attention_mask=mb["attention_mask"][:2])
    res["after_cycles"] = consolidated(engine)
    res["partitioned"] = all(p.ds_status.name == "NOT_AVAILABLE" for p in engine.module.parameters() if not p.ds_persist)
    # 5. the trained model's logits, then the recipe's saving (adapter, and the merged model)
    with torch.no_grad():
        pos = (mb["attention_mask"].cumsum(-1) - 1).clamp(min=0)
        res["logits"] = engine(input_ids=mb["input_ids"], attention_mask=mb["attention_mask"], position_ids=pos,
                               use_cache=False).logits
    names = {id(p): n for n, p in engine.module.named_parameters()}
    res["trainable"] = sorted(n for n, p in engine.module.named_parameters() if p.requires_grad)
    res["in_optimizer"] = sorted(names[id(p)] for group in engine.optimizer.fp16_groups for p in group)
    save_hf_model(engine, tok, out / "final", rank, save_merged=True)
    flags = torch.tensor([float(res["partitioned"])])
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    res["partitioned"] = bool(flags[0])
    if rank == 0:
        torch.save(res, out / "lora.pt")
    dist.barrier()


if __name__ == "__main__":
    liveness.run_and_exit(main)  # no gloo/DeepSpeed teardown, which occasionally aborts a finished rank
