#!/usr/bin/env bash
# Issue 24's runs on nvidia-h200-x2 (or nvidia-h100-x2), one stage per device call (each under the 600 s limit; the
# machine stays warm 30 s between calls, so send the next at once). Wheels: ../shared/device/wheels.sh serve, then
# job (into .whl/, carried as [".whl"]); ray (moved to .wray/, carried as [".wray"] in the `ray` call, the first:
# it stays installed in /tmp/site while the machine is warm). Every stage sources scripts/device_env.sh, which
# installs what was carried. Pass the commit: COMMIT=<sha> bash bench/h200x2_run.sh <stage>. Records land in $OUT.
#
#   ray      (carry .wray) the pool: 1 vs 2 replicas on W2 (bar >= 1.9x), then a replica killed mid-round (no
#            group lost, each whole)                                                     ~5 min
#   suite    (carry .whl)  tests/gpu's one-GPU files (all but TP, serve, drop-in and pool)  ~7.5 min
#   suite2   the two-GPU test files: TP=2 (NCCL, symm_mem), the server's NCCL push and killed trainer, TRL's and
#            SGLang's / slime's NCCL pushes into scripts/serve.py                        ~5 min (never timed)
#   pool     the pool's GPU tests (CUDA IPC into a co-located replica, sleep) and the co-located push at
#            llama3-8b's shape (16 GB; bar <= 0.1 s)                                      ~8 min (never timed)
#   tp       TP=2 vs TP=1 on W1-short (llama3-8b; bar: TP=2's step <= 0.65x), NCCL then symm_mem  ~4.5 min
#   tp70b    a llama3-70b shape at TP=2 on W1-short: tok/s and floor_ratio           never timed (<= 9 min cap)
#   w2serve  W2 bf16 vs fp8 KV (+ logprob check); the server bars: HTTP >= 0.9 of in-process, a 16 GB push over
#            NCCL <= 0.15 s end to end                                                  ~8 min
set -uo pipefail
source scripts/device_env.sh "${COMMIT:-unknown}" > /dev/null
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
quiet() { grep -v -i warn | tail -"${1:-6}"; }
TWO_GPU="tests/gpu/test_tp_gpu.py tests/gpu/test_tp_symm_mem_gpu.py tests/gpu/test_serve_gpu.py tests/gpu/test_dropin_weights_gpu.py"
case "${1:-}" in
  ray)
    timeout 250 python3 bench/pool_bench.py --mode throughput --prompts 16 --out "$OUT/pool.jsonl" 2>&1 | quiet 4
    timeout 300 python3 bench/pool_bench.py --mode kill --prompts 16 --out "$OUT/pool.jsonl" 2>&1 | quiet 3 ;;
  suite)
    GPU_TESTS="$(ls tests/gpu/test_*.py | grep -v -E 'test_pool_|test_tp_|test_serve_gpu|test_dropin' | tr '\n' ' ')" \
      PART=core TEST_TIMEOUT=560 bash scripts/gpu_check.sh ;;
  suite2)
    GPU_TESTS="$TWO_GPU" PART=two_gpu TEST_TIMEOUT=560 bash scripts/gpu_check.sh ;;
  pool)
    GPU_TESTS="tests/gpu/test_pool_ipc_gpu.py tests/gpu/test_pool_sleep_gpu.py" PART=pool TEST_TIMEOUT=300 \
      bash scripts/gpu_check.sh
    timeout 270 python3 bench/pool_bench.py --mode push --colocate --preset llama3-8b --out "$OUT/pool_push.jsonl" \
      2>&1 | quiet 4 ;;
  tp)
    timeout 330 python3 scripts/bench_tp.py --bar w1-short --out "$OUT/tp.jsonl" 2>&1 | quiet 6
    # its TP=1 line is the one above's; records are written as they come
    timeout 200 python3 scripts/bench_tp.py --bar w1-short --tp 2 --tp-all-reduce symm_mem --out "$OUT/tp.jsonl" 2>&1 \
      | quiet 3 ;;
  tp70b)
    timeout 560 python3 scripts/bench_tp.py --bar 70b --out "$OUT/tp.jsonl" 2>&1 | quiet 6 ;;
  w2serve)
    timeout 330 python3 scripts/bench.py --workload W2 --modes async --kv-cache-dtype auto,fp8 --logprob-check 8 \
      --sampling t1 --out "$OUT/w2.jsonl" 2>&1 | quiet 4
    timeout 220 python3 bench/serve_bench.py --repeats 2 --out "$OUT/serve.jsonl" 2>&1 | quiet 6 ;;
  *)
    echo "usage: COMMIT=<sha> bash bench/h200x2_run.sh ray|suite|suite2|pool|tp|tp70b|w2serve" >&2; exit 2 ;;
esac
