#!/usr/bin/env bash
# One device call: the GPU test suite, then benchmarks. The log's first line names the commit it ran at.
#   COMMIT=$(git rev-parse --short HEAD) bash scripts/gpu_check.sh "--workload W3 --modes async" ...
# (on the GPU machine there is no .git: pass COMMIT). Writes $OUT/gpu_tests_<date>_<commit>[_<PART>].log and
# $OUT/bench.jsonl; commit both to bench/results/. GPU_TESTS picks test files (default: all of tests/gpu),
# PART names the log of a suite split over several calls. TEST_TIMEOUT (default 540 s): the whole suite took 443 s on
# an H100 at 8858c88, and 450 s caught the interpreter's exit after the summary (pytest exit 124). The log ends with
# the 12 slowest tests (--durations): where a shorter suite would save device time.
set -uo pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
COMMIT=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
export COMMIT
LOG="$OUT/gpu_tests_$(date -u +%F)_${COMMIT}${PART:+_$PART}.log"
{
  echo "commit $COMMIT"
  echo "tests ${GPU_TESTS:-tests/gpu}"
  echo "date $(date -u +%FT%TZ)"
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
} > "$LOG" 2>&1
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout "${TEST_TIMEOUT:-540}" python3 -m pytest -x -s -p no:cacheprovider --durations=12 ${GPU_TESTS:-tests/gpu} 2>&1 \
    | grep -v -E "Warning|warnings.warn" | tail -"${LOG_LINES:-80}" >> "$LOG"
  echo "pytest exit ${PIPESTATUS[0]}" >> "$LOG"
  tail -3 "$LOG"
fi
for args in "$@"; do
  echo "== bench.py $args"
  timeout "${BENCH_TIMEOUT:-400}" python3 scripts/bench.py $args --out "$OUT/bench.jsonl" 2>&1 | grep -v Warning | tail -15
done
