#!/usr/bin/env bash
# One device call: GPU tests, then benchmarks. Usage: bash scripts/gpu_check.sh "<bench args>" ...
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv | tee "$OUT/nvidia-smi.txt"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -x -s tests/gpu 2>&1 | tail -40 | tee "$OUT/gpu_tests.log"
fi
for args in "$@"; do
  echo "== bench.py $args"
  timeout "${BENCH_TIMEOUT:-400}" python3 scripts/bench.py $args --out "$OUT/bench.jsonl" 2>&1 | grep -v Warning | tail -15
done
