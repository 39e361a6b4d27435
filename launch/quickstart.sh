#!/usr/bin/env bash
# Set everything up and run the default config: 2 ranks (GPUs, or CPU processes), ZeRO-3, num_iterations: auto.
# A demo: running it again starts over in its output folder (--overwrite_output_dir), unless you resume.
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup_venv.sh
case " $* " in
  *" --resume_from_checkpoint"* | *" --resume-from-checkpoint"*) OVERWRITE=() ;;
  *) OVERWRITE=(--overwrite_output_dir true) ;;
esac
bash launch/local.sh --config grpo_recipe/configs/quickstart.yaml "${OVERWRITE[@]}" "$@"
