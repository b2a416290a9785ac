#!/usr/bin/env bash
# The GPU validation run of the kernels issue, on one bare GPU machine from the repo root:
#   bash scripts/gpu_check.sh tests|kernels|mhc|slice|experts|moe|int4|int4one|gemv|int4dot|kv|rank0|pdl|graphs|serving|adaptive [COMMIT]
#   bash scripts/gpu_check.sh STAGE=SECONDS,STAGE=SECONDS,... [COMMIT]   (stages in turn, each
#        under its own time limit, so that one device call runs a session's plan and a stage
#        that overruns still leaves the later ones their time)
# tests:   every `gpu`-marked test (junit XML + log; the first run compiles every kernel and lets
#          fla autotune: ~10 minutes in one process, spread over GPU_TEST_WORKERS (4) processes
#          when pytest-xdist is carried)
# kernels: benchmarks/kernels.py part by part (each in its own process: a fault poisons the
#          CUDA context; mhc: the mHC sites) and benchmarks/sparse_mla.py
# mhc:     benchmarks/kernels.py --parts mhc alone (decode sites; the prefill mixing pass's
#          tiles, steps and precisions)
# slice:   benchmarks/slice.py, ours vs transformers eager in one run
# experts: the 4-bit routed experts: their gpu tests (EXL3 bit-exact vs exllamav3's fixture),
#          benchmarks/moe_4bit.py (vs bf16, 288 experts and EP2) and benchmarks/rank0.py (the
#          full-depth rank-0 emulation, EXL3 then int4 experts)
# moe:     benchmarks/moe_4bit.py, bf16 against int4 at 1, 8, 64 and 512 tokens (288 experts)
# int4:    the int4 decode GEMV's question: benchmarks/int4_access.py (the bandwidth of its
#          access pattern alone, row-major vs tile-contiguous), then moe_4bit.py with bf16,
#          row-major int4 and tiled int4 (int4t) at 1, 8 and 64 tokens, and int4's dot-free
#          against its tl.dot variant at 32 and 64 tokens (GEMV_MAX_TOKENS 128 vs 16), and
#          the one-token launch's warps and steps ahead for 288 experts and for EP rank 0
# int4one: that last sweep alone (the batch-1 step's expert launch: warps, steps ahead (2-4:
#          bytes in flight, since the one-token launch is latency-bound) and GEMV_BN13_MIN, for
#          288 experts and for EP rank 0)
# gemv:    rank 0's dense projections, cuBLAS vs the Triton GEMV at 1, 2 and 4 rows
#          (benchmarks/dense_gemv.py), then the GEMV's tile constants swept at one row
# int4dot: the tl.dot variant's blocks (DOT_BM_MAX 16 or 64, DOT_TILE) and dequantisation
#          (nibble trick from 16 rows a block or never) at 512 and 2048 tokens, against bf16
# kv:      the quantised latent cache: its gpu tests, then benchmarks/slice.py decode at 32K
#          (batch 1 and 64) and 4K prefill with bf16, fp8 and nvfp4 rows
# rank0:   benchmarks/rank0.py with int4 experts over the three cache formats (GPUs of
#          >= 100 GB; smaller ones run the first 24 layers: not the rank's numbers); RANK0_DECODE,
#          RANK0_PREFILL (e.g. 2048,8192,16384), RANK0_KV (cache formats) and RANK0_PROFILE
#          passed on
# pdl:     programmatic dependent launch (kernels/utils.py: pdl) checked with GLM53_PDL=1: the
#          gpu tests of the kernels that use it, then the rank-0 replay (24 layers, batch 1 and
#          64) captured with it and without (rank0.py --graph-only --compare-pdl)
# graphs:  the graph engine's equality tests (tests/actors/test_gpu_cuda_graphs.py, after the
#          kernel tests in one process, as the run that saw one fail) GRAPHS_REPEAT (4) times
#          with GLM53_PDL=1 and as many without: a count of failures each way (GRAPHS_PDL sets
#          the settings, e.g. "linear int4 mhc router kda": one kernel family's PDL at a time)
# serving: benchmarks/vision.py, prefix_cache.py --slice (10-turn chat) and adaptive.py --slice
# adaptive: adaptive.py --slice alone (ADAPTIVE_ARGS passed on)
# Results go to $OUT (the device tool's return folder) or ./gpu_out.
set -uo pipefail
stage=${1:?stage: tests, kernels or slice}
commit=${2:-unknown}
if [[ $stage == *=* || $stage == *,* ]]; then
  for part in ${stage//,/ }; do
    name=${part%%=*} limit=${part#*=}
    [[ $part == *=* ]] || limit=600
    echo "=== $name (at most $limit s) $(date +%T)"
    timeout "$limit" bash "$0" "$name" "$commit" "${@:3}"
    echo "=== $name: rc $? $(date +%T)"
  done
  exit 0
fi
out=${OUT:-gpu_out}
mkdir -p "$out"
. scripts/gpu_env.sh
# h100, h200, ...: result file names say which card measured them
dev=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1 | grep -oiE '[a-z][0-9]{3}' \
  | head -n 1 | tr '[:upper:]' '[:lower:]')
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
    for part in kda_decode kda_decode_fla kda_prefill moe mhc; do
      python benchmarks/kernels.py --parts $part --commit "$commit" --json "$out/kernels.json" \
        2>&1 | tail -n 40
    done
    [ -f benchmarks/sparse_mla.py ] && python benchmarks/sparse_mla.py --commit "$commit" \
      --json "$out/sparse_mla.json" 2>&1 | tail -n 60 ;;
  mhc)
    python benchmarks/kernels.py --parts mhc --commit "$commit" \
      --json "$out/kernels_mhc_${dev}_$commit.json" 2>&1 | tail -n 60 ;;
  moe)
    python benchmarks/moe_4bit.py --formats bf16,int4 --tokens 1,8,64,512 --repeats 5 \
      --commit "$commit" --json "$out/moe_4bit_${dev}_$commit.json" 2>&1 | tail -n 20 ;;
  slice)
    python benchmarks/slice.py --commit "$commit" --json "$out/slice.json" "${@:3}" 2>&1 ;;
  experts)
    python -m pytest -m gpu -q -p no:cacheprovider tests/kernels/test_gpu_exl3.py \
      tests/kernels/test_gpu_int4.py tests/kernels/test_exl3_golden.py 2>&1 | tail -n 15
    python benchmarks/moe_4bit.py --commit "$commit" --json "$out/moe_4bit_${dev}_$commit.json" \
      --repeats 5 2>&1 | tail -n 20
    for fmt in exl3 int4; do
      python benchmarks/rank0.py --experts $fmt --commit "$commit" \
        --json "$out/rank0_${dev}_${fmt}_$commit.json" 2>&1 | grep "^{'phase'" | cut -c1-300
    done
    python benchmarks/moe_4bit.py --ep2 --commit "$commit" --repeats 5 \
      --json "$out/moe_4bit_ep2_${dev}_$commit.json" 2>&1 | tail -n 12 ;;
  int4)
    python benchmarks/int4_access.py --commit "$commit" \
      --json "$out/int4_access_${dev}_$commit.json" 2>&1 | tail -n 20
    python benchmarks/moe_4bit.py --formats bf16,int4,int4t --tokens 1,8,64 --repeats 5 \
      --commit "$commit" --json "$out/moe_4bit_${dev}_$commit.json" 2>&1 | tail -n 12
    python benchmarks/moe_4bit.py --formats int4 --tokens 32,64 --repeats 5 --int4-sweep \
      --sweep-tokens 32,64 --sweep GEMV_MAX_TOKENS=16,128 --sweep GEMV_BN13=64 \
      --sweep GEMV_BN2=128 --sweep GEMV_WARPS=4 --sweep GEMV_PROGRAMS_PER_SM=4 \
      --sweep GEMV_AHEAD=1 --commit "$commit" \
      --json "$out/moe_4bit_crossover_${dev}_$commit.json" 2>&1 | tail -n 12
    bash "$0" int4one "$commit" ;;
  int4one)
    for ep in "" --ep2; do
      python benchmarks/moe_4bit.py $ep --formats int4 --tokens 1 --repeats 5 --int4-sweep \
        --sweep-tokens 1 --sweep GEMV_WARPS_1=4,8 --sweep GEMV_AHEAD_1=2,3,4 --sweep GEMV_BN13=64 \
        --sweep GEMV_BN13_MIN=8,16 \
        --sweep GEMV_BN2=128 --sweep GEMV_WARPS=4 --sweep GEMV_PROGRAMS_PER_SM=4 \
        --sweep GEMV_AHEAD=1 --commit "$commit" \
        --json "$out/moe_4bit_one_token${ep/--/_}_${dev}_$commit.json" 2>&1 | tail -n 6
    done ;;
  gemv)
    python benchmarks/dense_gemv.py --tokens 1,2 --sweep GEMV_BN_MAX=4,8,16 \
      --sweep GEMV_ACC=2048,4096 --sweep GEMV_WARPS=4,8 --commit "$commit" \
      --json "$out/dense_gemv_${dev}_$commit.json" 2>&1 | tail -n 60 ;;
  int4dot)
    python benchmarks/moe_4bit.py --formats bf16,int4 --tokens 512,2048 --repeats 5 \
      --int4-sweep --sweep-tokens 512,2048 --sweep DOT_BM_MAX=16,64 --sweep DOT_TILE=2048,4096 \
      --sweep DOT_NIBBLE_MIN_ROWS=16,128 --sweep GEMV_BN13=64 --sweep GEMV_BN2=128 \
      --sweep GEMV_WARPS=4 --sweep GEMV_PROGRAMS_PER_SM=4 --sweep GEMV_AHEAD=1 \
      --commit "$commit" --json "$out/moe_4bit_dot_${dev}_$commit.json" 2>&1 | tail -n 12 ;;
  kv)
    python -m pytest -m gpu -q -p no:cacheprovider tests/kernels/test_gpu_latent_quant.py \
      tests/kernels/test_gpu_sparse_mla_decode.py 2>&1 | tail -n 3
    python benchmarks/slice.py --no-transformers --decode 1x32768,64x32768 --prefill 4096 \
      --kv-cache-dtype bf16,fp8,nvfp4 --commit "$commit" --json "$out/slice_kv_$commit.json" \
      2>&1 | grep "'phase'" | cut -c1-240 ;;
  rank0)
    mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -n 1)
    layers=(); name=rank0_${dev}_int4_$commit
    [ "$mem" -lt 100000 ] && layers=(--layers 24) && name=rank0_l24_${dev}_int4_$commit
    python benchmarks/rank0.py --experts int4 "${layers[@]}" \
      --kv-cache-dtype "${RANK0_KV:-bf16,fp8,nvfp4}" \
      --decode "${RANK0_DECODE:-1x8192,16x8192,64x8192,1x131072}" ${RANK0_PROFILE:+--profile} \
      --prefill "${RANK0_PREFILL:-}" \
      --commit "$commit" --json "$out/$name.json" 2>&1 | grep "^{'phase'" \
      | cut -c1-300 ;;
  pdl)
    export GLM53_PDL=1
    python -m pytest -m gpu -q -p no:cacheprovider tests/kernels/test_gpu_kernels.py \
      tests/kernels/test_gpu_int4.py tests/actors/test_gpu_cuda_graphs.py -k "linear or \
      small_ops or pairs or in_cuda_graph or kda_mixer or route or router or graphs_match" \
      2>&1 | tail -n 8
    python benchmarks/rank0.py --experts int4 --layers 24 --kv-cache-dtype bf16 \
      --decode 1x8192,64x8192 --graph-only --compare-pdl --commit "$commit" \
      --json "$out/rank0_l24_${dev}_int4_pdl_$commit.json" 2>&1 | grep "^{'phase'" \
      | cut -c1-300 ;;
  graphs)
    # GRAPHS_PDL: the GLM53_PDL settings in turn (1, 0, or families to bisect: "int4 mhc")
    for pdl in ${GRAPHS_PDL:-1 0}; do
      failed=0 log=$out/graphs_pdl${pdl//,/+}
      for i in $(seq "${GRAPHS_REPEAT:-4}"); do
        GLM53_PDL=$pdl python -m pytest -m gpu -q -p no:cacheprovider \
          tests/kernels/test_gpu_kernels.py tests/actors/test_gpu_cuda_graphs.py \
          > "${log}_$i.log" 2>&1 || failed=$((failed + 1))
        grep -E "^E |^FAILED|passed|failed" "${log}_$i.log" | tail -n 12
      done
      echo "GLM53_PDL=$pdl: $failed of ${GRAPHS_REPEAT:-4} runs failed"
    done ;;
  serving)
    python benchmarks/vision.py --commit "$commit" --json "$out/vision_$commit.json" 2>&1 \
      | tail -n 8
    python benchmarks/prefix_cache.py --slice --device cuda --system 8192 --message 256 \
      --answer 32 --commit "$commit" --json "$out/prefix_cache_$commit.json" 2>&1 | tail -n 14
    python benchmarks/adaptive.py --slice --device cuda --context 1024 --output-len 128 \
      --commit "$commit" --json "$out/adaptive_$commit.json" 2>&1 | tail -n 30 ;;
  adaptive)
    # adaptive.py alone, each `glm53 bench latency` run's JSON kept as it finishes;
    # ADAPTIVE_ARGS (e.g. "--acceptance 0.8,0.6,0.4") narrows it to fit one call
    python benchmarks/adaptive.py --slice --device cuda --context 1024 --output-len 128 \
      --workdir "$out/adaptive_runs" ${ADAPTIVE_ARGS:-} --commit "$commit" \
      --json "$out/adaptive_$commit.json" 2>&1 | grep -v "^\s*$" | tail -n 40 ;;
  *) echo "unknown stage $stage"; exit 2 ;;
esac
