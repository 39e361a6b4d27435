#!/usr/bin/env bash
# Set everything up and run the default config: 2 ranks (GPUs, or CPU processes), ZeRO-3, mu = 4.
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup_venv.sh
bash launch/local.sh --config recipe/configs/quickstart.yaml "$@"
