#!/usr/bin/env bash
# The GPU check (bench/README.md): one command, on a machine with torch, transformers and peft only.
#
#   bash bench/gpu_check.sh          GPU: bf16 vs fp32 training, generation, memory, tokens/s, MFU
#                                    -> bench/results/gpu_check.json (about 3-5 minutes on one H200)
#   bash bench/gpu_check.sh --cpu    the same steps with a small model on CPU (CI's dry run)
#
# Without DeepSpeed it installs DeepSpeed 0.19.8 from its source package in bench/wheels (plus the few small
# packages it imports that are missing) into a temporary folder: no network, nothing else touched.
# PYTHON=... picks the interpreter (default python3); GPU_CHECK_INSTALL=1 installs from bench/wheels even where
# DeepSpeed is present (CI tests that path with it).
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
  echo "gpu_check: installing ${pkgs[*]} from bench/wheels into $site" >&2
  # the source package builds in an isolated environment from the carried setuptools/wheel/packaging;
  # no DeepSpeed op is compiled (DS_BUILD_OPS=0): the check uses none
  DS_BUILD_OPS=0 "$PY" -m pip install --quiet --no-index --find-links bench/wheels --target "$site" --no-deps \
    "${pkgs[@]}"
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false
if [ "${1:-}" = "--cpu" ]; then
  export DS_ACCELERATOR=cpu OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
fi
exec timeout 450 "$PY" bench/gpu_check.py "$@"
