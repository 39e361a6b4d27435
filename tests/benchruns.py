"""Running a benchmark script as its user does, and reading what it wrote (the bench test files share these)."""
import json
import subprocess
import sys

from conftest import REPO

from grpo_recipe.dist.env import rank_env


def assert_plot(path, width, height):
    """A drawn figure: the PNG of the script's figsize x dpi, with more on it than a blank canvas."""
    import matplotlib.image
    import numpy as np

    img = matplotlib.image.imread(path)
    assert img.shape[:2] == (height, width), img.shape
    assert len(np.unique(img.reshape(-1, img.shape[-1]), axis=0)) > 20  # lines, markers and text in many shades


def written(path) -> dict:
    """A results file as its script wrote it: with who wrote it (bench/common.save_json)."""
    r = json.loads(path.read_text())
    assert {"command", "commit", "written_at", "machine", "load_average"} <= r["provenance"].keys(), path
    return r


def bench(tmp_path, script, *args, timeout=600):
    proc = subprocess.run([sys.executable, script, *args], cwd=REPO / "bench", capture_output=True, text=True,
                          env=rank_env(BENCH_RESULTS=tmp_path), timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc
