#!/usr/bin/env bash
# Single node: all GPUs of this machine, or NPROC CPU ranks (default 2) when there are none.
#   launch/local.sh --config grpo_recipe/configs/quickstart.yaml [--key value ...]
# Env: NPROC (ranks; default = number of GPUs, or 2 on CPU), MASTER_PORT (default: a free port).
# The ranks are started and owned by launch/node.py: their exit code comes back unchanged (0 done, 2 config
# error, 75 checkpointed on a signal, 1 failed), SIGTERM/SIGUSR1/Ctrl-C reach them (checkpoint, exit 75), no
# rank outlives this script, and the rendezvous listens on loopback only.
# Relative paths (--config, --output_dir, dataset files) are the caller's, as with any command; the shipped
# configs and data are also found from the repository.
set -euo pipefail
trap '' USR1 TERM  # until launch/node.py records them (ignored, not fatal, in this brief shell)
REPO="$(cd "$(dirname "$0")/.." && pwd)"
PY="${VENV_PY:-$REPO/.venv/bin/python}"
[ -x "$PY" ] || PY=python3
export NPROC_PER_NODE="${NPROC:-${NPROC_PER_NODE:-}}" NNODES=1 NODE_RANK=0 MASTER_ADDR=127.0.0.1 LAUNCHER_NAME=local.sh
exec "$PY" "$REPO/launch/node.py" "$@"
