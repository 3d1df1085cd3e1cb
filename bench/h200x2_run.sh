#!/usr/bin/env bash
# The two-H200 session in three calls (wheels from ../shared/device/wheels.sh serve + ray carried in .whl):
#   bash bench/h200x2_run.sh 1   # the GPU suite but the pool's files (TP and server tests included) + TP W1-short
#                                # (NCCL, then TP=2 only with the opt-in tp_all_reduce=symm_mem: the A/B)
#   bash bench/h200x2_run.sh 2   # W2 bf16 vs fp8 KV (+ logprob check), server bars, pool throughput
#   bash bench/h200x2_run.sh 3   # pool weight push bar (0.1 s): replica 0 co-located on GPU 0 by CUDA IPC,
#                                # replica 1 on GPU 1 by NCCL; then the pool's GPU tests (Ray: the rest of the suite)
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
OUT=${OUT:-/tmp/out}
case "${1:-1}" in
1)
  GPU_TESTS="$(ls tests/gpu/test_*.py | grep -v test_pool_ | tr '\n' ' ')" PART=core TEST_TIMEOUT=330 \
    bash scripts/gpu_check.sh
  timeout 200 python3 scripts/bench_tp.py --bar w1-short --out "$OUT/tp.jsonl" 2>&1 | grep -v -i warn | tail -6
  timeout 60 python3 scripts/bench_tp.py --bar w1-short --tp 2 --tp-all-reduce symm_mem --out "$OUT/tp.jsonl" 2>&1 \
    | grep -v -i warn | tail -3  # its TP=1 line is the one above's; records are written as they come
  ;;
2)
  timeout 300 python3 scripts/bench.py --workload W2 --modes async --kv-cache-dtype auto,fp8 --logprob-check 8 \
    --out "$OUT/w2.jsonl" 2>&1 | grep -v -i warn | tail -4
  timeout 150 python3 bench/serve_bench.py --repeats 2 --out "$OUT/serve.jsonl" 2>&1 | grep -v -i warn | tail -6
  timeout 120 python3 bench/pool_bench.py --mode throughput --prompts 16 --out "$OUT/pool.jsonl" 2>&1 \
    | grep -v -i warn | tail -4
  ;;
3)
  timeout 240 python3 bench/pool_bench.py --mode push --colocate --out "$OUT/pool_push.jsonl" 2>&1 \
    | grep -v -i warn | tail -4
  GPU_TESTS="tests/gpu/test_pool_ipc_gpu.py tests/gpu/test_pool_sleep_gpu.py" PART=pool TEST_TIMEOUT=300 \
    bash scripts/gpu_check.sh
  ;;
esac
