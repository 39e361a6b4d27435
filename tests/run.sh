#!/usr/bin/env bash
# Set up .venv with the test extras and run the whole suite (slow end-to-end tests included).
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup_venv.sh test,examples  # examples: the SmolLM2 smoke test (tests/test_examples.py)
exec .venv/bin/python -m pytest tests "$@"
