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


def starts(tmp_path, argv: list[str], **env) -> list[str]:
    """GLIBC_TUNABLES as each interpreter start of `argv` saw it (a sitecustomize on the path records them)."""
    (tmp_path / "sitecustomize.py").write_text(
        "import os\nwith open(os.path.join(os.path.dirname(__file__), 'starts.txt'), 'a') as f:\n"
        "    f.write(os.environ.get('GLIBC_TUNABLES', '-') + '\\n')\n")
    run_env = rank_env(**env)
    run_env["PYTHONPATH"] = f"{tmp_path}:{run_env.get('PYTHONPATH', '')}"
    subprocess.run([sys.executable, *argv], cwd=REPO, env=run_env, capture_output=True, timeout=120, check=True)
    return (tmp_path / "starts.txt").read_text().splitlines()


def test_the_entry_point_restarts_once_with_huge_pages_where_the_kernel_offers_them(tmp_path):
    from grpo_recipe.dist.allocator import HUGE_PAGES, huge_pages_env

    seen = starts(tmp_path, ["-m", "grpo_recipe.train", "--help"])
    if huge_pages_env(rank_env()) is None:  # no transparent huge pages here: nothing to restart for
        assert seen == ["-"]
    else:
        assert seen == ["-", HUGE_PAGES]


def test_huge_pages_are_used_after_the_restart_and_a_chosen_setting_is_kept(tmp_path):
    from grpo_recipe.dist.allocator import huge_pages_env

    code = ("from grpo_recipe.dist import allocator; allocator.restart_with_huge_pages(); allocator.configure()\n"
            "import torch; x = torch.ones(16 << 20); x.add_(1)\n"
            "print(next(l for l in open('/proc/self/smaps_rollup') if l.startswith('AnonHugePages')).split()[1])")
    if huge_pages_env(rank_env()) is not None:
        out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=rank_env(), capture_output=True, text=True,
                             timeout=120, check=True).stdout.split()
        assert int(out[-1]) > 0, out  # kB in huge pages: the 64 MiB tensor's mapping got them
    seen = starts(tmp_path, ["-c", code], GLIBC_TUNABLES="glibc.malloc.hugetlb=0")
    assert seen == ["glibc.malloc.hugetlb=0"]  # a user's choice: no restart


def test_huge_pages_env_adds_to_other_tunables_and_skips_what_cannot_use_it(tmp_path):
    from grpo_recipe.dist.allocator import HUGE_PAGES, huge_pages_env

    madvise, never = tmp_path / "madvise", tmp_path / "never"
    madvise.write_text("always [madvise] never\n")
    never.write_text("always madvise [never]\n")
    assert huge_pages_env({}, str(madvise))["GLIBC_TUNABLES"] == HUGE_PAGES
    assert huge_pages_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, str(madvise))["GLIBC_TUNABLES"] == \
        f"glibc.malloc.arena_max=2:{HUGE_PAGES}"
    assert huge_pages_env({}, str(never)) is None
    assert huge_pages_env({}, str(tmp_path / "absent")) is None


REUSE = """
import resource
from grpo_recipe.dist import allocator
allocator.configure()
import torch
def rss():
    return int(next(l for l in open("/proc/self/status") if l.startswith("RssAnon:")).split()[1]) << 10
def faults_of_a_round():  # what a decode step does: the same sizes allocated, written and freed again
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    blocks = [torch.ones(512 << 10) for _ in range(150)]  # 150 blocks of 2 MiB
    del blocks
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
before = rss()
with allocator.reusing_heap():
    first, second = faults_of_a_round(), faults_of_a_round()
print(first, second, (rss() - before) >> 20, faults_of_a_round())
"""


def reuse_round(**env) -> list[int]:
    proc = subprocess.run([sys.executable, "-c", REUSE], cwd=REPO, capture_output=True, text=True,
                          env=rank_env(**env), timeout=120, check=True)
    return [int(x) for x in proc.stdout.split()]


def test_the_heap_is_reused_within_the_scope_and_given_back_after():
    """Generation's decode steps allocate the same sizes again and again: within `reusing_heap` the second round
    finds its pages already there; after it the memory is back with the system, and the fixed threshold maps
    afresh again."""
    first, second, kept_mib, after = reuse_round()
    # the second round still faults a little (8-11% of the first while the suite loads the machine, less alone);
    # without the scope it faults as much as the first (the test below)
    assert second < 0.25 * first, (first, second)
    assert kept_mib < 50, kept_mib
    assert after > 0.5 * first, (first, after)


def test_the_scope_leaves_a_threshold_the_environment_chose_alone():
    first, second, _, _ = reuse_round(MALLOC_MMAP_THRESHOLD_="1048576")
    assert second > 0.5 * first, (first, second)  # configure stepped aside: every round maps afresh
