#!/usr/bin/env bash
# The GPU check (bench/README.md): one command, on a machine with torch, transformers and peft only.
#
#   bash bench/gpu_check.sh          GPU: the training loop with forced collectives, checkpoint and resume, LoRA
#                                    with beta > 0, bf16 vs fp32, log-prob paths, generation, memory, tokens/s,
#                                    MFU -> bench/results/gpu_check.json (each section written as it finishes)
#   bash bench/gpu_check.sh --cpu    the same steps with a small model on CPU (CI's dry run)
#
# Without DeepSpeed it installs DeepSpeed 0.19.8 (plus the few small packages it imports that are missing) into
# a temporary folder, nothing else touched: from the wheel folder GPU_CHECK_WHEELS when set (offline: made by
# bench/fetch_gpu_wheels.sh, carried as an untracked copy), else from the package index.
# PYTHON=... picks the interpreter (default python3); GPU_CHECK_INSTALL=1 installs even where DeepSpeed is
# present (CI tests that path with it).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -c "import torch, transformers, peft" || { echo "gpu_check: needs torch, transformers and peft" >&2; exit 2; }
if [ -n "${GPU_CHECK_INSTALL:-}" ] || ! "$PY" -c "import deepspeed" 2>/dev/null; then
  site=$(mktemp -d)/site
  pkgs=(deepspeed==0.19.8)
  for pair in hjson:hjson cpuinfo:py-cpuinfo msgpack:msgpack einops:einops ninja:ninja pynvml:nvidia-ml-py; do
    "$PY" -c "import ${pair%%:*}" 2>/dev/null || pkgs+=("${pair#*:}")
  done
  "$PY" -c "import pydantic" 2>/dev/null || pkgs+=(pydantic pydantic-core annotated-types typing-inspection)
  if [ -n "${GPU_CHECK_WHEELS:-}" ]; then
    [ -d "$GPU_CHECK_WHEELS" ] || { echo "gpu_check: GPU_CHECK_WHEELS=$GPU_CHECK_WHEELS is not a folder" >&2; exit 2; }
    from=("--no-index" "--find-links" "$GPU_CHECK_WHEELS"); where="$GPU_CHECK_WHEELS"
  else
    from=(); where="the package index"
  fi
  echo "gpu_check: installing ${pkgs[*]} from $where into $site" >&2
  # the source package builds in an isolated environment (from the same folder when offline); no DeepSpeed op
  # is compiled (DS_BUILD_OPS=0): the check uses none
  DS_BUILD_OPS=0 "$PY" -m pip install --quiet --disable-pip-version-check "${from[@]}" --target "$site" --no-deps \
    "${pkgs[@]}"
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false
if [ "${1:-}" = "--cpu" ]; then
  export DS_ACCELERATOR=cpu OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
fi
exec timeout 570 "$PY" bench/gpu_check.py "$@"  # under the device tool's 10 minutes a call
