#!/usr/bin/env bash
# Fetch, on this (networked) machine, the wheels a bare GPU machine needs into .whl/ (ignored by
# git; carry it to the device): fla-core for long KDA prefill, transformers 5.24.0 for the oracle
# tests and the slice benchmark's baseline, pytest-xdist + execnet to spread the GPU tests'
# kernel compilation over the machine's cores, and the engine's structured-output stack the
# image lacks (xgrammar + apache-tvm-ffi, pydantic, jsonschema; the engine imports them).
# scripts/gpu_env.sh installs them there.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl \
  fla-core==0.6.0 transformers==5.24.0 pytest-xdist==3.8.0 execnet==2.1.1 \
  xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2 pydantic==2.14.4 pydantic-core==2.50.5 \
  annotated-types==0.8.0 typing-inspection==0.4.5 jsonschema==4.26.0 \
  jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1 \
  typing-extensions==4.16.0
ls -l .whl
