#!/usr/bin/env bash
# Download what bench/gpu_check.sh installs on a GPU machine that has no network and no DeepSpeed, into a folder
# that git ignores; the machine gets it as an untracked copy (GPU_CHECK_WHEELS=FOLDER), never from git.
#
#   bash bench/fetch_gpu_wheels.sh [FOLDER]      default: .gpu_wheels (ignored); PY_VERSIONS="3.11 3.12"
#
# DeepSpeed as its source package (built there with no op compiled) and, per Python version, a wheel of each
# package it imports that such a machine may lack, plus the build requirements of the source package.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST="${1:-.gpu_wheels}"
PY=${PYTHON:-python3}
mkdir -p "$DEST"
"$PY" -m pip download --quiet --disable-pip-version-check --no-deps --no-binary :all: --dest "$DEST" deepspeed==0.19.8
PURE=(hjson==3.1.0 py-cpuinfo==9.0.0 einops==0.8.2 nvidia-ml-py==13.615.71 pydantic==2.14.4 annotated-types==0.8.0
      typing-inspection==0.4.5 setuptools==84.2.1 wheel==0.48.0 packaging==26.4)
BINARY=(msgpack==1.2.4 pydantic-core==2.50.5 ninja==1.13.2)
for v in ${PY_VERSIONS:-3.11 3.12}; do
  "$PY" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary :all: --python-version "$v" \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    --dest "$DEST" "${PURE[@]}" "${BINARY[@]}"
done
echo "fetch_gpu_wheels: $(ls "$DEST" | wc -l) files in $DEST"
