"""Smoke runs of every benchmark script with a tiny budget, so they cannot rot (results go to a temp dir)."""
import json
import subprocess
import sys

import pytest

from conftest import REPO, cpu_env


def bench(tmp_path, script, *args, timeout=600):
    proc = subprocess.run([sys.executable, script, *args], cwd=REPO / "bench", capture_output=True, text=True,
                          env=cpu_env(BENCH_RESULTS=tmp_path), timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.slow
def test_mu_sweep_smoke(tmp_path):
    bench(tmp_path, "mu_sweep.py", "--mus", "1", "2", "--seeds", "0", "--steps", "4")
    r = json.loads((tmp_path / "mu_sweep.json").read_text())
    assert set(r["speedup_vs_mu1"]) == {"1", "2"} and "threshold" in r and "threshold_rule" in r
    assert (tmp_path / "mu_sweep.png").stat().st_size > 0
    assert [len(run["rows"]) for run in r["runs"]] == [4, 2]  # same steps: mu = 2 generated half the rollouts


@pytest.mark.slow
def test_breakdown_smoke(tmp_path):
    bench(tmp_path, "breakdown.py", "--steps", "2", "--no-grid")
    r = json.loads((tmp_path / "breakdown.json").read_text())
    shares = r["base"]["shares"]
    assert 0 <= r["overhead_share"] < 1 and abs(sum(shares.values()) - 1) < 1e-6
    assert r["base"]["phases_s"]["forward"] > 0 and r["base"]["phases_s"]["backward"] > 0


@pytest.mark.slow
def test_memory_smoke(tmp_path):
    bench(tmp_path, "memory.py", "--steps", "2", "--worlds", "1", "--mus", "1")
    r = json.loads((tmp_path / "memory.json").read_text())
    assert r["rows"][0]["peak_rss_mib_per_rank"][0] > 100
    (old,) = r["rows"][0]["old_logp_bytes_per_rank"]
    assert old % (16 * 4) == 0 and 0 < old <= 16 * 32 * 4  # 16 completions x up to 32 tokens, float32


@pytest.mark.slow
def test_lora_memory_smoke(tmp_path):
    bench(tmp_path, "lora_memory.py", "--models", "tiny", "--out", str(tmp_path / "lora_memory.json"))
    assert json.loads((tmp_path / "lora_memory.json").read_text())
