"""Run recipe.train under torchrun with timers on DeepSpeed's forward/backward/step and comm backend.

    torchrun ... bench/instrumented.py OUT_PREFIX --config ... [--key value ...]
Each rank writes OUT_PREFIX.rank{r}.json: seconds and calls per timer, peak RSS, old-log-prob buffer bytes.
"""
import json
import resource
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

TIMES, CALLS = defaultdict(float), defaultdict(int)
PEAK = {"old_logp_bytes": 0, "buffer_bytes": 0}


def timed(cls, name, key_fn):
    orig = getattr(cls, name)

    def wrapper(*a, **k):
        key = key_fn()
        t0 = time.perf_counter()
        try:
            return orig(*a, **k)
        finally:
            TIMES[key] += time.perf_counter() - t0
            CALLS[key] += 1

    setattr(cls, name, wrapper)


def main():
    out_prefix, argv = sys.argv[1], sys.argv[2:]
    from deepspeed.comm.torch import TorchBackend
    from deepspeed.runtime.engine import DeepSpeedEngine

    from recipe import buffer, train

    timed(DeepSpeedEngine, "forward", lambda: "forward" if torch.is_grad_enabled() else "forward_nograd")
    timed(DeepSpeedEngine, "backward", lambda: "backward")
    timed(DeepSpeedEngine, "step", lambda: "optimizer_step")
    for op in ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_gather", "broadcast",
               "reduce_scatter", "barrier", "all_reduce_coalesced"):
        if hasattr(TorchBackend, op):
            timed(TorchBackend, op, lambda: "comm")
    build = buffer.RolloutBuffer.build.__func__

    def tracking_build(cls, *a, **k):
        buf = build(cls, *a, **k)
        PEAK["old_logp_bytes"] = max(PEAK["old_logp_bytes"], buf.old_logps.numel() * buf.old_logps.element_size())
        PEAK["buffer_bytes"] = max(PEAK["buffer_bytes"], sum(t.numel() * t.element_size() for t in
                                                             buf.state_dict().values() if torch.is_tensor(t)))
        return buf

    buffer.RolloutBuffer.build = classmethod(tracking_build)
    import torch.distributed as dist

    rank_holder = {}
    orig_destroy = dist.destroy_process_group

    def destroy(*a, **k):
        rank_holder["rank"] = dist.get_rank()
        return orig_destroy(*a, **k)

    dist.destroy_process_group = destroy
    code = train.main(argv)
    rank = rank_holder.get("rank", 0)
    Path(f"{out_prefix}.rank{rank}.json").write_text(json.dumps({
        "times_s": dict(TIMES), "calls": dict(CALLS), "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        **PEAK}))
    sys.exit(code)


if __name__ == "__main__":
    main()
