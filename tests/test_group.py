"""dist/group.py on real gloo ranks."""
import json

from conftest import torchrun


def test_deepspeed_counts_this_nodes_cpu_ranks_without_a_subprocess(tmp_path):
    """DeepSpeed's CPU accelerator answers device_count (asked at every ZeRO-3 gradient reduction) from
    LOCAL_SIZE, as under the deepspeed launcher, instead of running numactl each time."""
    out = tmp_path / "group.json"
    torchrun(2, ["tests/dist_group.py", str(out)])
    got = json.loads(out.read_text())
    assert [r["local_size"] for r in got] == ["2", "2"] and [r["device_count"] for r in got] == [2, 2]
    assert [r["spawned"] for r in got] == [[], []]


def test_zero3_parameter_gathers_and_gradient_reduce_scatters_over_gloo_give_the_collectives_results(tmp_path):
    """The in-place replacements (broadcasts; an all-reduce and this rank's chunk) against what the collectives
    mean: the concatenated shards, with the input separate or already the output's own chunk; each rank's chunk
    of the mean over ranks, for one tensor and for two, one of them padded."""
    out = tmp_path / "group.json"
    torchrun(2, ["tests/dist_group.py", str(out)])
    got = json.loads(out.read_text())
    assert all(r["all_gather"] and r["all_gather_aliased"] and r["reduce_scatter"] for r in got), got


def test_each_rank_takes_its_own_gpu_or_the_only_one_it_sees(monkeypatch):
    """GPUs as launchers hand them out (no GPU here: the device queries answer as on a node). torchrun, local.sh and
    the sbatch script: every process sees the node's GPUs and takes LOCAL_RANK's. srun --gpus-per-task=1: each
    process sees one GPU, its own, whatever LOCAL_RANK is; LOCAL_RANK becomes 0, which DeepSpeed and vLLM read.
    Fewer GPUs than ranks is one line, never CUDA's 'invalid device ordinal' later."""
    import pytest
    import torch

    from grpo_recipe.dist.env import LaunchError
    from grpo_recipe.dist.group import bf16_capable, own_gpu
    from grpo_recipe.model.ds_config import use_bf16
    from grpo_recipe.config.schema import Config

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert own_gpu() == 3
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert own_gpu() == 0 and __import__("os").environ["LOCAL_RANK"] == "0"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("LOCAL_RANK", "2")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(LaunchError, match=r"LOCAL_RANK is 2 but this process sees 2 GPU\(s\) "
                                          r"\(CUDA_VISIBLE_DEVICES=0,1\): start one rank per visible GPU"):
        own_gpu()
    # bf16: auto is bf16 on the rank's own GPU only where it computes bf16 natively (Ampere on: 8.0)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    asked = []
    for capability, expected in (((7, 0), False), ((7, 5), False), ((8, 0), True), ((9, 0), True)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i, c=capability: asked.append(i) or c)
        assert bf16_capable() is expected and use_bf16(Config(bf16="auto")) is expected
        assert use_bf16(Config(bf16="true")) and not use_bf16(Config(bf16="false"))
    assert set(asked) == {1}  # this rank's GPU, not GPU 0
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not bf16_capable() and not use_bf16(Config(bf16="auto"))
