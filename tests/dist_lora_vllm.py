"""Worker (torchrun): LoRA under ZeRO-3 generating with a colocated vLLM engine, for one `vllm_lora_sync` mode.

Each of 10 rounds: one GRPO optimizer step on the LoRA engine (truncated IS correction on), then one sync. In the
first rounds and the last, vLLM is checked stale before the sync and, after it, against an independent merged
model: the base weights read from disk plus W + (alpha / r) B A computed here from the gathered adapter, in a
plain transformers model (output head untied: the adapter on the tied head must not touch the embeddings).
Greedy tokens must be equal, also for a prompt long enough to fill prompt-cache blocks (a stale cached prefix
would show). After the 10 syncs the engine's base weights are compared with the files, bit for bit.
The KL term is on (beta > 0): its reference is the policy engine with the adapter disabled (no second model),
whose log-probs must equal the files' model after the syncs. Every sync's gathers are counted and sized.

Usage: dist_lora_vllm.py OUT.json TP MODE  (MODE merged | adapter; TP 2: one tensor-parallel engine for both ranks)
"""
import json
import sys

import deepspeed
import torch
import torch.distributed as dist
from dist_vllm import engine_greedy, gen_greedy, grpo_round, hf_greedy

from grpo_recipe.algo.buffer import RolloutBuffer
from grpo_recipe.algo.update import forward_logps
from grpo_recipe.config.schema import Config
from grpo_recipe.dist import liveness
from grpo_recipe.dist.group import init_distributed
from grpo_recipe.generation import build_generator
from grpo_recipe.model import engine as eng
from grpo_recipe.model.load import load_model, load_tokenizer
from grpo_recipe.model.lora import ReferencePolicy, lora_layers
from grpo_recipe.model.source import model_path

SYNCS, CHECKED = 10, (0, 1, 9)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]


def gathered_state(engine) -> dict:
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=None):
        return {n: p.detach().clone() for n, p in engine.module.named_parameters(remove_duplicate=False)}


def merged_reference(state: dict, path: str, cfg: Config):
    """The merged policy from its definition: disk weights, plus (alpha / r) B A on every adapted module."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())  # untied: own matrix
    model.config.tie_word_embeddings = False
    weights = dict(model.named_parameters())
    with torch.no_grad():
        for name, a in state.items():
            if ".lora_A." in name:
                module = name.removeprefix("base_model.model.").split(".lora_A.")[0]
                b = state[name.replace(".lora_A.", ".lora_B.")]
                weights[module + ".weight"].add_((b @ a) * (cfg.lora_alpha / cfg.lora_r))
    return model


def main():
    out, tp, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    rank, world = init_distributed()
    cfg = Config(generation_backend="vllm", use_peft=True, lora_r=16, lora_alpha=32, lora_target_modules=TARGETS,
                 vllm_lora_sync=mode, vllm_tensor_parallel_size=tp, vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_max=2.0,
                 num_generations=2, per_device_train_batch_size=4, max_completion_length=12, max_prompt_length=200,
                 learning_rate=0.05, top_k=0, num_iterations=1, beta=0.05)
    path = model_path(cfg)
    tok = load_tokenizer(path)
    engine = eng.init_engine(load_model(path, cfg), cfg, world)
    ref = eng.init_reference(path, cfg, world, engine)
    gen = build_generator(cfg, engine, tok)
    gen.chunk_numel = 40_000  # several gathers per sync even for the tiny model
    gathers, in_sync = [], [False]  # per sync: the number of elements of each gather
    enter = deepspeed.zero.GatheredParameters.__enter__

    def counting_enter(self):
        if in_sync[0] and getattr(self, "params", None):
            gathers[-1].append(sum(p.ds_numel for p in self.params))
        return enter(self)

    deepspeed.zero.GatheredParameters.__enter__ = counting_enter
    sync = gen.sync

    def counted_sync(engine):  # only the sync's own gathers count (not the checks')
        gathers.append([])
        in_sync[0] = True
        try:
            sync(engine)
        finally:
            in_sync[0] = False

    gen.sync = counted_sync
    long = tok(" ".join(["POST: the landlord kept the deposit and the rent went up again"] * 16)).input_ids[:190]
    prompts = [tok(f"TITLE: rank {rank} asks about").input_ids, long]
    base_before = {k: v for k, v in gathered_state(engine).items() if ".lora_" not in k}
    rounds = []
    for r in range(SYNCS):
        stats = grpo_round(gen, engine, tok, prompts, r, ref=ref)
        if r not in CHECKED:
            gen.sync(engine)
            continue
        state = gathered_state(engine)
        trained = hf_greedy(merged_reference(state, path, cfg), tok, prompts, cfg.max_completion_length)
        stale = engine_greedy(gen, prompts)
        gen.sync(engine)
        after = gen_greedy(gen, prompts)
        untouched = all(torch.equal(v, state[k]) for k, v in gathered_state(engine).items())
        rounds.append({"stale_differs": stale != trained, "after_matches": after == trained,
                       "engine_untouched_by_sync": untouched, "sync_bytes": gen.last_sync_bytes,
                       "is_ratio_mean": stats["is_ratio_mean"], "is_ratio_max": stats["is_ratio_max"],
                       "kl": stats["kl"]})
    base_after = {k: v for k, v in gathered_state(engine).items() if ".lora_" not in k}
    from transformers import AutoModelForCausalLM

    disk = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    base_identical = base_before.keys() == base_after.keys() and all(
        torch.equal(base_after[k], base_before[k]) and torch.equal(base_after[k], disk[k.removeprefix(
            "base_model.model.").replace(".base_layer.", ".")]) for k in base_after)
    # The reference after 10 syncs: the files' model (policy and vLLM moved; the reference did not)
    comp = gen.generate(prompts, seed=rank)  # num_generations = 2 per prompt
    rows = [p for p in prompts for _ in range(cfg.num_generations)]
    buf = RolloutBuffer.build(rows, comp.ids, torch.zeros(len(rows)), comp.mask, tok.pad_token_id, order_seed=0)
    args = (buf.input_ids, buf.attention_mask, buf.completion_mask.shape[1], cfg.temperature)
    with torch.no_grad():
        ref_logps, policy_logps = forward_logps(ref, *args), forward_logps(engine, *args)
        files_logps = forward_logps(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), *args)
    m = buf.completion_mask.bool()
    # a sync's gather holds whole units (a LoRA layer with its adapter, or one parameter) up to chunk_numel
    model_numel = sum(p.ds_numel for p in engine.module.parameters())
    largest_unit = max([sum(p.ds_numel for p in layer.parameters()) for _, layer, _ in lora_layers(engine.module)]
                       + [p.ds_numel for p in engine.module.parameters()])
    keys = ("stale_differs", "after_matches", "engine_untouched_by_sync")
    flat = torch.tensor([float(base_identical)] + [float(x[k]) for x in rounds for k in keys])
    dist.all_reduce(flat, op=dist.ReduceOp.MIN)
    report = {"mode": mode, "tp": tp, "syncs": gen.syncs, "base_identical_after_syncs": bool(flat[0]),
              "gathers_per_sync": gathers, "chunk_numel": gen.chunk_numel, "model_numel": model_numel,
              "largest_unit_numel": largest_unit,
              "reference_is_the_policy_engine": isinstance(ref, ReferencePolicy) and ref.engine is engine,
              "ref_vs_files_max_abs": (ref_logps - files_logps)[m].abs().max().item(),
              "policy_vs_files_max_abs": (policy_logps - files_logps)[m].abs().max().item(),
              "rounds": [{**x, **{k: bool(flat[1 + 3 * i + j]) for j, k in enumerate(keys)}}
                         for i, x in enumerate(rounds)]}
    if rank == 0:
        json.dump(report, open(out, "w"), indent=1)
    dist.barrier()
    gen.close()  # last: vLLM's shutdown tears down the default process group


if __name__ == "__main__":
    liveness.run_and_exit(main)  # no gloo/DeepSpeed teardown, which occasionally aborts a finished rank
