"""How this process's memory goes back to the system. glibc's default keeps freed blocks below a threshold that
grows up to 32 MiB in its heap (a model's per-layer tensors are that size), so a rank's private memory keeps the
high-water mark of every phase; a fixed threshold of 1 MiB gives every block of that size or more (a layer's
weights, a micro-batch's activations) its own mapping, returned when freed, while smaller blocks are reused from
the heap (at 128 KiB a small model's step paid a mapping per activation: 40% slower). Set from the rank's first
line (before torch allocates), for every launcher; an environment that sets MALLOC_MMAP_THRESHOLD_ itself keeps its
choice. Standard library only.

On a CPU rank glibc also maps its large blocks with transparent huge pages (where the kernel offers them on
request): a 2 MiB page is one fault in place of 512, which a block mapped afresh at every allocation pays, for
the same private memory. glibc reads that setting (GLIBC_TUNABLES) only at start-up, so the recipe's entry point
restarts itself once with it."""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import glob
import os
import platform
import sys

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)
MMAP_THRESHOLD, TRIM_THRESHOLD = 1 << 20, 4 << 20
REUSE_THRESHOLD = 32 << 20  # glibc's own ceiling for its dynamic threshold
_configured = None  # libc, where `configure` set the threshold in this process (then `reusing_heap` may move it)
HUGE_PAGES = "glibc.malloc.hugetlb=1"  # madvise(MADV_HUGEPAGE) on what malloc maps (glibc >= 2.35; older ignore it)
THP = "/sys/kernel/mm/transparent_hugepage/enabled"


def _libc():
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


def has_gpu(env=os.environ, dev: str = "/dev") -> bool:
    """Whether this process would see an NVIDIA GPU, asked without torch (which it precedes): a device file, and
    no CUDA_VISIBLE_DEVICES that hides them all."""
    if env.get("CUDA_VISIBLE_DEVICES", "unset").strip() in ("", "-1", "NoDevFiles"):
        return False
    return bool(glob.glob(os.path.join(dev, "nvidia[0-9]*")))


def configure() -> bool:
    """Fix glibc's mmap threshold at 1 MiB (returns whether it was set here). Not on a GPU rank: its host memory
    holds no model, and its large host buffers (pinned staging, an offloaded optimizer) do not come from the heap."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or has_gpu():
        return False
    libc = _libc()
    if libc is None or not hasattr(libc, "mallopt"):  # not glibc (musl, macOS): nothing to tune
        return False
    global _configured
    done = bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    _configured = libc if done else None
    return done


@contextlib.contextmanager
def reusing_heap():
    """Within: blocks up to 32 MiB come from the heap and freed ones stay there for reuse; after: back to the fixed
    threshold, the heap's free pages returned. For a phase that frees and allocates the same sizes many times and
    holds little of its own: generation's decode steps (each grown K/V block, the logits and the sampler's
    temporaries) would otherwise map and fault each afresh. Nothing where `configure` did not set the threshold."""
    libc = _configured
    if libc is None:
        yield
        return
    libc.mallopt(M_MMAP_THRESHOLD, REUSE_THRESHOLD)
    libc.mallopt(M_TRIM_THRESHOLD, -1)
    try:
        yield
    finally:
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
        libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
        libc.malloc_trim(0)


def release() -> None:
    """Give the heap's free pages back to the system (after a phase that freed much: loading, a checkpoint)."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def huge_pages_env(env=os.environ, thp: str = THP) -> dict | None:
    """`env` with glibc's huge-page tunable added, or None where it is not wanted: a GPU rank (as `configure`),
    not glibc, a kernel without transparent huge pages (or set to never), or a GLIBC_TUNABLES that already
    chose (a user's glibc.malloc.hugetlb=0 keeps its choice)."""
    tunables = env.get("GLIBC_TUNABLES", "")
    if "glibc.malloc.hugetlb" in tunables or has_gpu(env) or platform.libc_ver()[0] != "glibc":
        return None
    try:
        with open(thp) as f:
            mode = f.read()
    except OSError:
        return None
    if "[never]" in mode:
        return None
    return {**env, "GLIBC_TUNABLES": f"{tunables}:{HUGE_PAGES}" if tunables else HUGE_PAGES}


def restart_with_huge_pages() -> None:
    """Replace this process by itself (same pid, arguments and descriptors) under `huge_pages_env`, when that adds
    the tunable. Only for a process that is the recipe's own entry point and has done nothing yet: the restarted
    one finds the tunable set and goes on."""
    env = huge_pages_env()
    if env is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, env)
