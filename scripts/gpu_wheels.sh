#!/usr/bin/env bash
# Fetch, on this (networked) machine, the wheels a bare GPU machine needs into .whl/ (ignored by
# git; carry it to the device): fla-core for long KDA prefill, transformers 5.24.0 for the oracle
# tests and the slice benchmark's baseline, pytest-xdist + execnet to spread the GPU tests'
# kernel compilation over the machine's cores. scripts/gpu_env.sh installs them there.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl \
  fla-core==0.6.0 transformers==5.24.0 pytest-xdist==3.8.0 execnet==2.1.1
ls -l .whl
