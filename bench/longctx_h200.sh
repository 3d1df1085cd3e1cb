#!/usr/bin/env bash
# Issue 13 (long sequences at the memory floor) on the H200: one stage per device call, each under
# 10 minutes. JSON lines go to $OUT (default bench/results); run from the repository root.
#
#   bash bench/longctx_h200.sh kernels   # decode kernel, W2 shapes: before (legacy split heuristic) vs after, bf16 + fp8
#   bash bench/longctx_h200.sh tests     # tests/gpu: kernels at W2/32K shapes, 32K generation, workspace, fp8 capacity
#   bash bench/longctx_h200.sh w2        # W2 bf16 KV and fp8 KV in one run (vs_first_kv), 8 samples vs HF each
#   bash bench/longctx_h200.sh w2-32k    # W2-32K: completes, no truncated sample, floor_ratio
#   bash bench/longctx_h200.sh push      # W2 (4K) with one mid-run update_weights, recompute_running True / False
#   bash bench/longctx_h200.sh regress   # W1-short and W3 async: no lower than before
set -euo pipefail
stage=${1:?stage: kernels | tests | w2 | w2-32k | push | regress}
out=${OUT:-bench/results}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # scripts/bench.py imports the package from here
mkdir -p "$out"
tag=$(git rev-parse --short HEAD 2>/dev/null || echo "${COMMIT:-unknown}")
case $stage in
  kernels)
    python bench/kernels_bench.py --preset qwen2.5-1.5b --lengths long-tail --batches 64,256,512 \
      --ctxs 16384,32000 --kv bf16,fp8 --compare-legacy --no-prefill | tee "$out/kernels_w2_longtail_$tag.jsonl"
    python bench/kernels_bench.py --preset qwen2.5-1.5b --batches 1,32,256 --ctxs 4096,16384 \
      --compare-legacy --sweep-decode | tee "$out/kernels_qwen2.5-1.5b_uniform_$tag.jsonl" ;;
  tests)
    python -m pytest -q -s -p no:cacheprovider tests/gpu/test_kernels_gpu.py tests/gpu/test_long_context_gpu.py \
      2>&1 | tee "$out/gpu_tests_longctx_$tag.log" ;;
  w2)
    python scripts/bench.py --workload W2 --modes async --kv-cache-dtype auto,fp8 --logprob-check 8 \
      --out "$out/w2_kv_$tag.jsonl" ;;
  w2-32k)
    python scripts/bench.py --workload W2-32K --modes async --out "$out/w2_32k_$tag.jsonl" ;;
  push)
    python scripts/bench.py --workload W2 --new 4096 --modes async --push-mid-run --out "$out/w2_push_$tag.jsonl" ;;
  regress)
    python scripts/bench.py --workload W1-short,W3 --modes async --out "$out/regress_$tag.jsonl" ;;
  *) echo "unknown stage $stage" >&2; exit 2 ;;
esac
