"""grpo_recipe/dist/allocator.py: with the threshold fixed, memory a phase frees goes back to the system; with
glibc's default it stays in the process (after its threshold has grown past the blocks' size, as it does once a
large block was freed), counted in the run's private memory."""
import subprocess
import sys

from conftest import REPO

from grpo_recipe.dist.env import rank_env

CODE = """
import sys
from grpo_recipe.dist import allocator
configured = allocator.configure() if sys.argv[1] == "1" else False
import torch
def rss():
    return int(next(l for l in open("/proc/self/status") if l.startswith("RssAnon:")).split()[1]) << 10
big = torch.ones(4 << 20)  # 16 MiB, freed: glibc's default threshold grows to it
del big
before = rss()
blocks = [torch.ones(512 << 10) for _ in range(150)]  # 150 blocks of 2 MiB (a layer's weights, at least)
del blocks
print(configured, (rss() - before) >> 20)
"""


def kept_mib(configure: bool, **env) -> tuple[bool, int]:
    proc = subprocess.run([sys.executable, "-c", CODE, "1" if configure else "0"], cwd=REPO, capture_output=True,
                          text=True, env=rank_env(**env), timeout=120, check=True)
    configured, kept = proc.stdout.split()
    return configured == "True", int(kept)


def test_freed_memory_goes_back_with_the_fixed_threshold_and_stays_without():
    configured, kept = kept_mib(True)
    assert configured and kept < 50, kept
    configured, kept = kept_mib(False)
    assert not configured and kept > 200, kept  # what a run kept before: the high-water mark of every phase


def test_an_environment_that_chose_a_threshold_keeps_it():
    configured, _ = kept_mib(True, MALLOC_MMAP_THRESHOLD_="1048576")
    assert not configured


def test_gpu_ranks_keep_glibcs_defaults(tmp_path):
    """A GPU rank's host heap holds no model (and pinned buffers bypass it): the threshold is set on CPU ranks only."""
    from grpo_recipe.dist.allocator import has_gpu

    assert not has_gpu({}, str(tmp_path))
    (tmp_path / "nvidia0").touch()
    (tmp_path / "nvidiactl").touch()
    assert has_gpu({}, str(tmp_path)) and has_gpu({"CUDA_VISIBLE_DEVICES": "1,2"}, str(tmp_path))
    assert not has_gpu({"CUDA_VISIBLE_DEVICES": ""}, str(tmp_path))
    assert not has_gpu({"CUDA_VISIBLE_DEVICES": "-1"}, str(tmp_path))
