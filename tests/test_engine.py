"""The engines' own operations on real ZeRO-3 shards (model/engine.py): TR-DPO's reference mix and the
synced reference's checkpoint shard. Exact resumes with a synced reference: tests/test_checkpoint.py."""
import os

import pytest
import torch
from conftest import torchrun

trl = pytest.importorskip("trl", reason="trl not installed (bash launch/setup_venv.sh test,bench-trl)") \
    if not os.environ.get("GRPO_REQUIRE_TRL") else __import__("trl")
from trl.trainer.callbacks import SyncRefModelCallback  # noqa: E402


def trls_mix(policy: dict, ref: dict, alpha: float) -> dict:
    """TRL 1.16's own SyncRefModelCallback mix on copies of the gathered tensors."""
    target = torch.nn.ParameterList([torch.nn.Parameter(ref[k].clone()) for k in ref])
    source = torch.nn.ParameterList([torch.nn.Parameter(policy[k].clone()) for k in ref])
    SyncRefModelCallback._sync_target_model(source, target, alpha)
    return {k: p.data for k, p in zip(ref, target)}


def test_reference_mix_equals_trls_on_the_gathered_weights_and_its_shard_restores(tmp_path):
    """2 ZeRO-3 ranks: the shard-wise mix equals TRL's callback on the whole tensors; a saved shard restored over
    a reference mixed since gives back the reference as it was."""
    out = tmp_path / "engine.pt"
    torchrun(2, ["tests/dist_engine.py", str(out)])
    got = torch.load(out, weights_only=True)
    assert got["zero3"] and got["persistent"], "the case must cover partitioned and persistent parameters"
    want, moved = trls_mix(got["policy"], got["before"], 0.3), 0
    for name, pol in got["policy"].items():
        torch.testing.assert_close(got["mixed"][name], want[name], atol=1e-7, rtol=1e-6)
        assert torch.equal(got["restored"][name], got["before"][name]), name
        moved += int(not torch.equal(pol, got["before"][name]))
    assert moved > len(got["policy"]) // 2  # the policy had moved away from the reference
