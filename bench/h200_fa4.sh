#!/usr/bin/env bash
# FlashAttention-4 on the H200 (issue 23.7), in stages after its wheels are installed. The wheels travel in two
# parts over two calls on ONE warm machine (../shared/device/fa4.sh builds .fa4/ and .fa4b/ here):
#   call 1, carry [".fa4", ...]:  mkdir -p /tmp/fa4 && cp .fa4/* /tmp/fa4/; <any other work, e.g. gpu_check>
#   call 2, carry [".fa4b"]:      COMMIT=<sha> bash bench/h200_fa4.sh install tests kernels score
#   call 3 (same machine):        COMMIT=<sha> bash bench/h200_fa4.sh suite w2
# Stages:
#   install  join the two parts of the cutlass-dsl-libs wheel and pip install everything into /tmp/fa4site
#   tests    tests/gpu/test_fa4_backend_gpu.py (kernel level vs the torch reference / Triton; engine vs Triton)
#   kernels  bench/kernels_bench.py --fa4: the prefill shapes (bar 1.8x) and a mixed step, qwen2.5-1.5b heads
#   score    bench/score_bench.py, 64 x 4,096 at block 128, Triton then FA4, under the profiler
#   suite    the whole GPU suite with FA4 importable (auto picks fa4 only at block_size 128)
#   w2       W2 with FA4 prefill (block 128) and the logprob check
# Results under $OUT; stdout carries the lines that decide the bars.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
COMMIT=${COMMIT:-unknown}
export PYTHONPATH=$PWD:/tmp/site:/tmp/fa4site:/tmp/fa4site/nvidia_cutlass_dsl/dsl_packages PYTHONUNBUFFERED=1
for stage in "$@"; do
  echo "== $stage $(date -u +%T)"
  case $stage in
    install)
      if [ ! -d /tmp/fa4site/flash_attn ]; then
        cat /tmp/fa4/cu13.part.aa .fa4b/cu13.part.ab \
          > /tmp/fa4/nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl \
          && rm /tmp/fa4/cu13.part.aa && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
          --target /tmp/fa4site /tmp/fa4/*.whl 2>&1 | tail -2
      fi
      python3 -c "from flash_attn.cute import flash_attn_varlen_func; print('fa4 imports')" || exit 1 ;;
    tests)
      timeout 240 python3 -m pytest -q -s -rs -p no:cacheprovider tests/gpu/test_fa4_backend_gpu.py 2>&1 \
        | grep -v -E "Warning|warnings.warn|exe_args|_warn_once" > "$OUT/fa4_tests_$COMMIT.log"
      echo "pytest exit ${PIPESTATUS[0]}" >> "$OUT/fa4_tests_$COMMIT.log"  # its summary line has gone missing twice
      grep -E "fa4 vs|triton vs|logprob - HF|passed|failed|Error|pytest exit" "$OUT/fa4_tests_$COMMIT.log" | tail -12 ;;
    kernels)
      timeout 150 python3 bench/kernels_bench.py --preset qwen2.5-1.5b --page 128 --fa4 --no-decode --no-prefill \
        > "$OUT/kernels_fa4.jsonl" 2> "$OUT/kernels_fa4.err"
      grep fa4_vs_triton "$OUT/kernels_fa4.jsonl" ;;
    score)
      for b in triton fa4; do
        timeout 150 python3 bench/score_bench.py --seqs ${SCORE_SEQS:-64} --block-size 128 --attention-backend $b --profile \
          --out "$OUT/score_fa4.jsonl" 2>&1 | grep -E '"bench": "score' | cut -c1-400
      done ;;
    suite)
      PART=fa4 TEST_TIMEOUT=${TEST_TIMEOUT:-330} bash scripts/gpu_check.sh ;;
    w2)
      timeout 300 python3 scripts/bench.py --workload W2 --modes async --block-size 128 --attention-backend fa4 \
        --logprob-check 8 --sampling t1 --out "$OUT/w2_fa4.jsonl" > "$OUT/w2_fa4.log" 2>&1
      tail -3 "$OUT/w2_fa4.log" ;;
    *) echo "unknown stage $stage" ;;
  esac
done
