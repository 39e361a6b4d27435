"""Worker (torchrun): HF generation on a ZeRO-3 engine vs the same weights in a plain model.

Writes OUT.json on rank 0: whether tokens matched on every rank, all-gather counts for two
generation lengths, whether training still works afterwards, and what each rank raised when generation
failed on rank 1 alone.
"""
import json
import sys

import torch
import torch.distributed as dist
from deepspeed.runtime.zero.linear import zero3_linear_wrap

from grpo_recipe.algo.buffer import left_pad
from grpo_recipe.algo.update import forward_logps
from grpo_recipe.config.schema import Config
from grpo_recipe.dist import liveness
from grpo_recipe.dist.group import init_distributed
from grpo_recipe.generation import GenerationError, build_generator, generate_on_every_rank
from grpo_recipe.model import engine as eng
from grpo_recipe.model.load import load_model, load_tokenizer
from grpo_recipe.model.source import model_path

GATHERS = [0]


def count_gathers(cdb):
    """Count the all-gathers that DeepSpeed's comm backend issues (its single sink for them)."""
    orig = cdb.all_gather_function

    def counting(*a, **k):
        GATHERS[0] += 1
        return orig(*a, **k)

    cdb.all_gather_function = counting


class GatheredCalls:
    """Counts ZeRO-3's parameter all-gathers (partition_parameters' single sink for them) inside each `with`."""

    def __init__(self):
        self.counts = []

    def __enter__(self):
        from deepspeed.runtime.zero import partition_parameters as pp

        self.orig, self.counts = pp._dist_allgather_fn, [*self.counts, 0]

        def counting(*a, **k):
            self.counts[-1] += 1
            return self.orig(*a, **k)

        pp._dist_allgather_fn = counting

    def __exit__(self, *exc):
        from deepspeed.runtime.zero import partition_parameters as pp

        pp._dist_allgather_fn = self.orig


def main():
    out = sys.argv[1]
    rank, world = init_distributed()
    cfg = Config(num_generations=2, per_device_train_batch_size=4, max_completion_length=12, top_k=0)
    path = model_path(cfg)
    tok = load_tokenizer(path)
    engine = eng.init_engine(load_model(path, cfg, world), cfg, world)
    plain = load_model(path, cfg).eval()
    gen = build_generator(cfg, engine, tok)
    prompts = [tok(f"TITLE: rank {rank} asks").input_ids, tok("POST: a longer prompt here, longer").input_ids]
    import deepspeed.comm.comm as ds_comm

    count_gathers(ds_comm.cdb)
    got = gen.generate(prompts, seed=123 + rank)
    gathers_12 = GATHERS[0]
    # Reference: the same sampling on the plain model with the same seed.
    ids, attn = left_pad([p for p in prompts for _ in range(2)], tok.pad_token_id)
    width = ids.shape[1]
    torch.manual_seed(123 + rank)
    ref = plain.generate(input_ids=ids, attention_mask=attn, generation_config=gen.gen_config)[:, width:].tolist()
    eos = tok.eos_token_id
    ref_cut = [r[:r.index(eos) + 1] if eos in r else r for r in ref]
    match = ref_cut == got.ids
    # Longer generation: the number of all-gathers must not grow with the number of decoding steps.
    GATHERS[0] = 0
    gen.gen_config.max_new_tokens = 24
    gen.generate(prompts, seed=7)
    gathers_24 = GATHERS[0]
    # Hooks are back: a training forward/backward/step works and parameters are partitioned again.
    lp = forward_logps(engine, ids, attn, 3, 1.0)
    engine.backward(lp.sum())
    engine.step()
    partitioned = all(p.ds_status.name == "NOT_AVAILABLE" for p in engine.module.parameters() if not p.ds_persist)
    # The gradient partition, which now holds that step's gradients, gives its memory back while the gathered
    # model generates, and comes back its size, zeroed.
    grads = engine.optimizer.grad_partitions_flat_buffer
    full, had_grads = grads.untyped_storage().nbytes(), bool(grads.any())
    with eng.gathered_for_generation(engine):
        released = grads.untyped_storage().nbytes()
    grads_back = grads.untyped_storage().nbytes() == full and not bool(grads.any())
    # ZeRO-3's recorded module trace outlives generation, so the micro-batch after a rollout prefetches its
    # parameters in a few coalesced gathers instead of fetching module by module.
    coordinator = engine.optimizer.parameter_offload.get_param_coordinator()
    gathers = GatheredCalls()

    def micro_batch():
        engine.backward(forward_logps(engine, ids, attn, 3, 1.0).sum())
        engine.step()

    for _ in range(3):  # the 1st records the trace, the 3rd's start completes it
        micro_batch()
    with eng.gathered_for_generation(engine):
        plain_linear = torch.nn.functional.linear is not zero3_linear_wrap
    gen.generate(prompts, seed=5)
    trace_kept = coordinator.is_complete_trace()
    with gathers:
        micro_batch()
    coordinator._invalidate_trace()
    with gathers:
        micro_batch()  # the same micro-batch without a trace
    zero3_linear_back = torch.nn.functional.linear is zero3_linear_wrap
    # A failure on rank 1 alone (a token id the model does not have) stops both ranks at once, naming rank 1.
    bad = [[engine.module.config.vocab_size + 5]] if rank == 1 else prompts
    try:
        generate_on_every_rank(gen, bad, "test generation", seed=1)
        raised = None
    except GenerationError as e:
        raised = str(e)
    raised_all = [None] * world
    dist.all_gather_object(raised_all, raised)
    flags = torch.tensor([float(match), float(partitioned), float(had_grads and released == 0 and grads_back),
                          float(trace_kept), float(plain_linear and zero3_linear_back)])
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    if rank == 0:
        json.dump({"match": bool(flags[0]), "partitioned": bool(flags[1]), "grads_released": bool(flags[2]),
                   "trace_kept": bool(flags[3]), "plain_linear": bool(flags[4]), "micro_batch_gathers": gathers.counts,
                   "gathers_12": gathers_12,
                   "gathers_24": gathers_24, "texts": got.texts, "mask_sum": got.mask.sum(-1).tolist(),
                   "ids": got.ids, "truncated": got.truncated.tolist(), "eos": eos,
                   "raised": raised_all}, open(out, "w"))
    dist.barrier()


if __name__ == "__main__":
    liveness.run_and_exit(main)  # no gloo/DeepSpeed teardown, which occasionally aborts a finished rank
