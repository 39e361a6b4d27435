#!/usr/bin/env bash
# Set up .venv with the test extras and run the whole suite (slow end-to-end tests included).
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup_venv.sh test
# The Slurm launcher tests start a real local cluster (tests/slurm_cluster.py): install its Debian packages.
if [ "$(id -u)" = 0 ] && [ ! -x /usr/sbin/slurmctld ] && command -v apt-get >/dev/null; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
fi
exec .venv/bin/python -m pytest tests "$@"
