#!/usr/bin/env bash
# A/B on one H200, in one device call: the same workloads at a base commit and at this tree, run base, new,
# base (ABA), so drift over the call shows. The base tree travels as an ignored worktree:
#   here:  git worktree add .ab/base <base-commit> && echo /.ab/ >> .git/info/exclude
#   call:  carry [".ab"], command: BASE=<base-commit> COMMIT=<head> bash bench/ab_h200.sh "W1-short,W3" t1
# Records go to $OUT/ab.jsonl, each with its commit.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
WORKLOADS=${1:-W1-short,W3}; SAMPLING=${2:-t1}
export PYTHONUNBUFFERED=1
run() {  # $1: tree, $2: commit label
  (cd "$1" && COMMIT=$2 PYTHONPATH=$PWD timeout "${BENCH_TIMEOUT:-200}" python3 scripts/bench.py --workload "$WORKLOADS" \
    --modes async --sampling "$SAMPLING" --out "$OUT/ab.jsonl" 2>&1 | grep -v -i warn | tail -4)
}
run .ab/base "${BASE:?set BASE}"
run . "${COMMIT:-new}"
run .ab/base "$BASE"
