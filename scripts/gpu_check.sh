#!/usr/bin/env bash
# The GPU validation run of the kernels issue, on one bare GPU machine from the repo root:
#   bash scripts/gpu_check.sh tests|kernels|slice [COMMIT]
# tests:   every `gpu`-marked test (junit XML + log; the first run compiles every kernel and lets
#          fla autotune: ~10 minutes in one process, spread over GPU_TEST_WORKERS (4) processes
#          when pytest-xdist is carried)
# kernels: benchmarks/kernels.py part by part (each in its own process: a fault poisons the
#          CUDA context) and benchmarks/sparse_mla.py
# slice:   benchmarks/slice.py, ours vs transformers eager in one run
# Results go to $OUT (the device tool's return folder) or ./gpu_out.
set -uo pipefail
stage=${1:?stage: tests, kernels or slice}
commit=${2:-unknown}
out=${OUT:-gpu_out}
mkdir -p "$out"
. scripts/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
case $stage in
  tests)
    # with pytest-xdist carried (scripts/gpu_wheels.sh), files spread over workers: the first
    # run is dominated by Triton compiling every kernel, which uses one core per process
    par=()
    python -c "import xdist" 2>/dev/null && par=(-n "${GPU_TEST_WORKERS:-4}" --dist loadfile)
    # tests/deployments holds no GPU test and imports the HTTP edge (pydantic, openai), which
    # the device image lacks
    python -m pytest -m gpu tests -q -p no:cacheprovider --ignore=tests/deployments "${par[@]}" \
      --junitxml "$out/gpu_tests.xml" 2>&1 | tee "$out/gpu_tests.log" ;;
  kernels)
    for part in kda_decode kda_decode_fla kda_prefill moe; do
      python benchmarks/kernels.py --parts $part --commit "$commit" --json "$out/kernels.json" \
        2>&1 | tail -n 40
    done
    [ -f benchmarks/sparse_mla.py ] && python benchmarks/sparse_mla.py --commit "$commit" \
      --json "$out/sparse_mla.json" 2>&1 | tail -n 60 ;;
  slice)
    python benchmarks/slice.py --commit "$commit" --json "$out/slice.json" "${@:3}" 2>&1 ;;
  *) echo "unknown stage $stage"; exit 2 ;;
esac
