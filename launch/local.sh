#!/usr/bin/env bash
# Single node: all GPUs of this machine, or NPROC CPU ranks (default 2) when there are none.
#   launch/local.sh --config recipe/configs/quickstart.yaml [--key value ...]
# Env: NPROC (ranks; default = number of GPUs, or 2 on CPU), MASTER_PORT (default: a free port).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${VENV_PY:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if [ "$NGPU" -gt 0 ]; then
  NPROC="${NPROC:-$NGPU}"
else
  NPROC="${NPROC:-2}"
  export DS_ACCELERATOR=cpu
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"  # one thread per rank: 2 threads per rank ran ~10x slower here
echo "local.sh: $NPROC ranks on $([ "$NGPU" -gt 0 ] && echo GPU || echo CPU), OMP_NUM_THREADS=$OMP_NUM_THREADS" >&2
PORT="${MASTER_PORT:-$("$PY" -c 'from recipe.launch import free_port; print(free_port())')}"
exec "$PY" -m torch.distributed.run --nnodes 1 --nproc_per_node "$NPROC" --master_addr 127.0.0.1 \
  --master_port "$PORT" -m recipe.train "$@"
