#!/usr/bin/env bash
# The GPU validation run of the kernels issue, on one bare GPU machine from the repo root:
#   bash scripts/gpu_check.sh tests|kernels|slice|experts [COMMIT]
# tests:   every `gpu`-marked test (junit XML + log; the first run compiles every kernel and lets
#          fla autotune: ~10 minutes in one process, spread over GPU_TEST_WORKERS (4) processes
#          when pytest-xdist is carried)
# kernels: benchmarks/kernels.py part by part (each in its own process: a fault poisons the
#          CUDA context) and benchmarks/sparse_mla.py
# slice:   benchmarks/slice.py, ours vs transformers eager in one run
# experts: the 4-bit routed experts: their gpu tests (EXL3 bit-exact vs exllamav3's fixture),
#          benchmarks/moe_4bit.py (vs bf16, 288 experts and EP2) and benchmarks/rank0.py (the
#          full-depth rank-0 emulation, EXL3 then int4 experts)
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
  experts)
    python -m pytest -m gpu -q -p no:cacheprovider tests/kernels/test_gpu_exl3.py \
      tests/kernels/test_gpu_int4.py tests/kernels/test_exl3_golden.py 2>&1 | tail -n 15
    python benchmarks/moe_4bit.py --commit "$commit" --json "$out/moe_4bit_h200_$commit.json" \
      --repeats 5 2>&1 | tail -n 20
    for fmt in exl3 int4; do
      python benchmarks/rank0.py --experts $fmt --commit "$commit" \
        --json "$out/rank0_h200_${fmt}_$commit.json" 2>&1 | grep "^{'phase'" | cut -c1-300
    done
    python benchmarks/moe_4bit.py --ep2 --commit "$commit" --repeats 5 \
      --json "$out/moe_4bit_ep2_h200_$commit.json" 2>&1 | tail -n 12 ;;
  *) echo "unknown stage $stage"; exit 2 ;;
esac
