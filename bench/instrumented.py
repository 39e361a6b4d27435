"""Run grpo_recipe.train (under torchrun, one process per rank) and write what the loop does not log per rank: the
process's peak RSS and the largest rollout buffer the rank held (its old log-probs, and the whole buffer).

    torchrun ... bench/instrumented.py OUT_PREFIX --config ... [--key value ...]
Each rank writes OUT_PREFIX.rank{r}.json. Step phases (generate, forward, backward, optimizer, ...) are the
loop's own timers: time_*_s in metrics.jsonl.
"""
import json
import os
import resource
import sys
from pathlib import Path

import torch

PEAK = {"old_logp_bytes": 0, "buffer_bytes": 0}


def main():
    out_prefix, argv = sys.argv[1], sys.argv[2:]
    from grpo_recipe import train
    from grpo_recipe.algo import buffer

    build = buffer.RolloutBuffer.build.__func__

    def tracking_build(cls, *a, **k):  # every rollout's buffer passes through here: note the largest
        buf = build(cls, *a, **k)
        PEAK["old_logp_bytes"] = max(PEAK["old_logp_bytes"], buf.old_logps.numel() * buf.old_logps.element_size())
        PEAK["buffer_bytes"] = max(PEAK["buffer_bytes"], sum(t.numel() * t.element_size() for t in
                                                             buf.state_dict().values() if torch.is_tensor(t)))
        return buf

    buffer.RolloutBuffer.build = classmethod(tracking_build)
    code = train.main(argv)
    Path(f"{out_prefix}.rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps({
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, **PEAK}))
    sys.exit(code)


if __name__ == "__main__":
    main()
