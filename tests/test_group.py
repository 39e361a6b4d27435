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
