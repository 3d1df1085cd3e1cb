#!/usr/bin/env bash
# Issue 23's H200 runs, in stages that each fit one device call (<= 10 min); results under $OUT, one log per stage.
#   call 1: source scripts/device_env.sh <commit>; bash bench/h200_issue23.sh w2                     (~6-7 min)
#   call 2: source scripts/device_env.sh <commit>; bash bench/h200_issue23.sh w2_512 fm_profile      (~7 min)
#   call 3: source scripts/device_env.sh <commit>; bash bench/h200_issue23.sh legacy w2mem           (~9 min)
#   later:  kernels, profile, ncu (~3-5 min each)
# KNOBS=V_PAGES=0,FUSED_MERGE=1 passes --decode-knobs to the scripts/bench.py stages (records and logs get a
# _knobs suffix), e.g. KNOBS=FUSED_MERGE=1 ... w2 against the plain w2 stage (V_PAGES is on by default since 1a04ee9).
# Stages:
#   even     the even-lengths split (fixed chunks per batch size): which count is fastest per dtype and batch
#   stream   the stream split (one wave of programs streaming equal runs across sequences) vs the engine's rules
#   w1_stream  the same at W1's decode shape (llama3-8b, B=32, uniform lengths to 2K / 4K / 8K, ~1 min)
#   even_short  the same at W2's 256-sequence steps (lengths in [1K, 3K])
#   gemm     the decode linears, cuBLAS vs a split-K Triton kernel (bench/gemm_bench.py, ~3 min); w1_gemm: W1's
#            linears (llama3-8b, M=32), the same comparison (~1 min)
#   kernels  decode kernels at W2's shapes: balanced / planned / planned_all_waves (the one-wave cut of even
#            lengths off) / fp8 V copied page by page (v_pages) / fixed split (bench/kernels_bench.py)
#   w1       W1 (llama3-8b, 32 x 128 -> 8192) at t1: the floor-ratio bar of 0.90 (~2.5 min)
#   w1tune, w2tune  W1 / W2 bf16 with --gemm-autotune (engine gemm_autotune: each graph size's projections on the
#            GEMM method timed fastest; records carry gemm_picks), against the w1 / w2 stage in the same call
#   w1cmp    W1 with --compare-legacy (~5 min); w1_profile: its step's kernels, plain launches vs PDL (~2 min);
#            w1pdl: W1 with plain launches, then with programmatic dependent launch (PDL=1, ~5 min); w1ab: W1
#            plain, then with each of AB_KNOBS (default "GEMM_SWAP_ROWS=64 SKINNY_GEMM_ROWS=64": cuBLAS's
#            transposed product, then the split-K Triton GEMM, for the projections; ~6 min);
#            w1uniform: W1 with UNIFORM_ONE_WAVE=1 (its uniform steps on one wave's count, ~2.5 min)
#   partial  bench/partial_rollout.py at W2's 16K tail, drain vs partial (PARTIAL_MODES=drain to split calls);
#            PARTIAL_WARMUP rounds (default 1) are left out of steady_handed_out_tok_s, the bar's rate; no round
#            starts that would end past PARTIAL_TIMEOUT - 15 s (the record keeps the rounds that ran)
#   legacy   W1-short and W3 with the live-length split vs the previous fixed split (issue 23.4's bar)
#   w2       W2 bf16 vs fp8 KV with the logprob check (the 1.3x bar), V_PAGES as the tree sets it; W2_TIMEOUT
#            (default 570 s: an H100 takes ~1.4x an H200's ~5.5 min)
#   w2_512   W2 at max_num_seqs 512: eager_decode_steps must be 0 (issue 23.3)
#   w2mem    the memory-bound W2 (fp8 vs bf16, swap vs recompute at 30% of the KV need; issue 23.5)
#   profile  one decode step's kernels, bf16 vs fp8 (bench/step_profile.py)
#   even_profile  the same on even lengths (the fixed split every W2 step takes) at B=128 and 256
#   fm_profile  the same at B=128 and 256 with the fused merge off and on (FUSED_MERGE: no reduce launch)
#   tail_profile  the same for W2's tail steps (B=8 and 16, long tail to 16K, bf16; ~2 min)
#   mid_profile  W2's 160-255-sequence steps (even lengths in [2K, 6K], ~4K mean), B=160, 200 and 232, bf16: on the
#            H100 at 2220a74 the 192- and 224-sequence buckets ran 0.69 / 0.73 of the floor against 0.86 at 160
#            (decode_by_kind, even split), on the H200 0.785 / 0.781 against 0.807 (~2 min)
#   ncu      Nsight Compute of the fp8 decode kernel with V page by page (sectors per copy: ideal is the bar)
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-$PWD} PYTHONUNBUFFERED=1
KNOB_ARGS=(); SUFFIX=""
if [ -n "${KNOBS:-}" ]; then KNOB_ARGS=(--decode-knobs "$KNOBS"); SUFFIX=_knobs; fi
summary() {  # $1: jsonl; prints the fields that decide the issue's bars
  python3 - "$1" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    try:
        r = json.loads(line)
    except ValueError:
        continue
    if r.get("bench") == "decode":
        print(r["kv"], r["B"], r["variant"], r.get("config"), r["ms"], r["gbps"])
    elif "workload" in r:
        keys = ("workload", "kv_cache_dtype", "decode_split", "run", "kv_budget_frac", "preemption", "tok_s",
                "mean_decode_compute_ms", "floor_ratio", "roofline_ratio", "eager_decode_steps", "max_decode_batch",
                "fp8_vs_bf16", "vs_legacy", "decode_compute_vs_legacy", "swap_vs_recompute",
                "logprob_mean_abs_diff_vs_hf")
        print({k: r[k] for k in keys if r.get(k) is not None})
        if r.get("decode_by_batch"):  # [steps, compute ms, floor ms, floor ratio] per 32-sequence bucket
            print("  by batch:", r["decode_by_batch"])
        for kind, table in (r.get("decode_by_kind") or {}).items():  # the same within each split kind
            print(f"  {kind}:", table)
        for p in r.get("gemm_picks") or []:  # --gemm-autotune: the projections that left cuBLAS, and the margins
            if p["method"] != "cublas":
                print("  gemm pick:", p)
PY
}
gemm_summary() {  # bench/gemm_bench.py's lines on stdin: microseconds per linear, cuBLAS against ours
  python3 -c "
import json, sys
for l in sys.stdin:
    r = json.loads(l)
    if r['bench'] == 'gemm':
        print(r['shape'], r['M'], 'cublas', r['cublas_us'], 'swapped', r.get('cublas_swapped_us'), '+copy',
              r.get('cublas_swapped_copy_us'), 'ours', r['ours_us'], 'best', r['best_us'], 'floor', r['floor_us'])
    else:
        print(r)"
}
for stage in "$@"; do
  echo "== $stage $(date -u +%T)"
  case $stage in
    kernels)
      timeout 150 python3 bench/kernels_bench.py --preset qwen2.5-1.5b --lengths long-tail --batches 32,128,256,512 \
        --ctxs 16384 --kv bf16,fp8 --no-prefill --compare-legacy > "$OUT/kernels.jsonl" 2> "$OUT/kernels.err"
      summary "$OUT/kernels.jsonl"
      # even lengths (W2's tail, W1-short, W3): the one-wave cut (planned) against four waves (planned_all_waves)
      timeout 100 python3 bench/kernels_bench.py --preset qwen2.5-1.5b --lengths uniform --batches 16,64 \
        --ctxs 1024,12288 --kv bf16,fp8 --no-prefill --compare-legacy > "$OUT/kernels_even.jsonl" 2>> "$OUT/kernels.err"
      summary "$OUT/kernels_even.jsonl" ;;
    even)
      # the even-lengths split (every W2 step: bench/w2_lengths.py) at W2's batch sizes: the engine's rule, one wave,
      # fp8 sized for 4 programs per SM, the balanced partition at 1 / 2 / 4 / 8 waves, fixed counts 1-16 (~3 min)
      timeout 280 python3 bench/kernels_bench.py --preset qwen2.5-1.5b --lengths even --batches 32,64,128,200,256 \
        --ctxs 8192 --kv bf16,fp8 --no-prefill --compare-even > "$OUT/kernels_even_split.jsonl" 2> "$OUT/even.err"
      python3 bench/even_rule.py "$OUT/kernels_even_split.jsonl" ;;
    stream)
      # the stream split (runs of key tiles across sequences, paged_decode_stream.py) at 1 / 2 / 4 waves against the
      # engine's rules: W2's long tail to 16K, then its 256-sequence steps' even lengths in [1K, 3K] (~3 min)
      timeout 170 python3 bench/kernels_bench.py --preset qwen2.5-1.5b --lengths long-tail --batches 128,256 \
        --ctxs 16384 --kv bf16,fp8 --no-prefill --compare-stream > "$OUT/kernels_stream.jsonl" 2> "$OUT/stream.err"
      timeout 120 python3 bench/kernels_bench.py --preset qwen2.5-1.5b --lengths even --batches 256 \
        --ctxs 3072 --kv bf16,fp8 --no-prefill --compare-stream >> "$OUT/kernels_stream.jsonl" 2>> "$OUT/stream.err"
      tail -3 "$OUT/stream.err"; summary "$OUT/kernels_stream.jsonl" ;;
    w1_stream)
      # W1's decode shape (llama3-8b, 32 equal sequences): the uniform rule (one wave's equal chunks) against the
      # stream split at 1 / 2 / 4 waves and 4 / 5 an SM (its default 6), and fixed counts 1-64 (~1 min); W1 with
      # STREAM_K=1 at 4 an SM ran 0.789 of the floor against the uniform rule's 0.879 (H100, 4739d05)
      timeout 150 python3 bench/kernels_bench.py --preset llama3-8b --lengths uniform --batches 32 \
        --ctxs 2048,4096,8192 --kv bf16 --no-prefill --compare-stream --sweep-splits > "$OUT/kernels_w1_stream.jsonl" \
        2> "$OUT/w1_stream.err"
      tail -3 "$OUT/w1_stream.err"; summary "$OUT/kernels_w1_stream.jsonl" ;;
    even_short)
      # W2's 256-sequence steps (a quarter of its decode time, mean context ~2K: bench/w2_lengths.py): the same
      # comparison at lengths in [1K, 3K], where fp8 ran 3.9% faster with 4-tile chunks than with 8-tile ones (~2 min)
      timeout 200 python3 bench/kernels_bench.py --preset qwen2.5-1.5b --lengths even --batches 192,256 \
        --ctxs 3072 --kv bf16,fp8 --no-prefill --compare-even > "$OUT/kernels_even_short.jsonl" 2> "$OUT/even_short.err"
      python3 bench/even_rule.py "$OUT/kernels_even_short.jsonl" ;;
    gemm)
      # the decode linears: cuBLAS vs rollout/kernels/skinny_gemm.py (split-K Triton) at W2's batch sizes (~3 min)
      timeout 280 python3 bench/gemm_bench.py --preset qwen2.5-1.5b --batches 8,32,128,256 --out "$OUT/gemm.jsonl" \
        2> "$OUT/gemm.err" | gemm_summary ;;
    w1_gemm)  # W1's linears (llama3-8b, M=32): cuBLAS against the split-K Triton GEMM; its qkv and o_proj ran at
      # ~0.77 of their floor in w1_profile (h100_2026-12-07f), where a 64-wide tile leaves SMs idle (~1 min)
      timeout 200 python3 bench/gemm_bench.py --preset llama3-8b --batches 32 --out "$OUT/gemm_w1.jsonl" \
        2> "$OUT/gemm_w1.err" | gemm_summary ;;
    legacy)
      timeout 200 python3 scripts/bench.py --workload W1-short,W3 --modes async --compare-legacy --sampling t1 \
        "${KNOB_ARGS[@]}" --out "$OUT/legacy$SUFFIX.jsonl" > "$OUT/legacy$SUFFIX.log" 2>&1
      summary "$OUT/legacy$SUFFIX.jsonl" ;;
    w2fp8)  # W2 with fp8 KV only (an A/B of a knob against the w2 stage's fp8 record)
      timeout 260 python3 scripts/bench.py --workload W2 --modes async --kv-cache-dtype fp8 --sampling t1 \
        "${KNOB_ARGS[@]}" --out "$OUT/w2fp8$SUFFIX.jsonl" > "$OUT/w2fp8$SUFFIX.log" 2>&1
      summary "$OUT/w2fp8$SUFFIX.jsonl" ;;
    w2)
      timeout ${W2_TIMEOUT:-570} python3 scripts/bench.py --workload W2 --modes async --kv-cache-dtype auto,fp8 --logprob-check 8 \
        --sampling t1 "${KNOB_ARGS[@]}" --out "$OUT/w2$SUFFIX.jsonl" > "$OUT/w2$SUFFIX.log" 2>&1
      summary "$OUT/w2$SUFFIX.jsonl" ;;
    w1tune|w2tune)  # W1 / W2 (bf16) with --gemm-autotune (each graph size's projections on their fastest GEMM);
      # the plain w1 / w2 stage in the same call is the baseline
      wl=W1; [ $stage = w2tune ] && wl=W2
      timeout ${TUNE_TIMEOUT:-300} python3 scripts/bench.py --workload $wl --modes async --sampling t1 --gemm-autotune \
        "${KNOB_ARGS[@]}" --out "$OUT/$stage$SUFFIX.jsonl" > "$OUT/$stage$SUFFIX.log" 2>&1
      summary "$OUT/$stage$SUFFIX.jsonl" ;;
    w1)  # issue 23.2's W1 bar (>= 0.90 of the floor): llama3-8b, 32 x 128 -> 8192, t1
      timeout ${W1_TIMEOUT:-220} python3 scripts/bench.py --workload W1 --modes async --sampling t1 \
        "${KNOB_ARGS[@]}" --out "$OUT/w1$SUFFIX.jsonl" > "$OUT/w1$SUFFIX.log" 2>&1
      summary "$OUT/w1$SUFFIX.jsonl" ;;
    w1cmp)  # W1 against the one-wave split in one run (live, legacy, live again): is the even split W1's lost 6%?
      timeout ${W1_TIMEOUT:-420} python3 scripts/bench.py --workload W1 --modes async --sampling t1 --compare-legacy \
        "${KNOB_ARGS[@]}" --out "$OUT/w1cmp$SUFFIX.jsonl" > "$OUT/w1cmp$SUFFIX.log" 2>&1
      summary "$OUT/w1cmp$SUFFIX.jsonl" ;;
    w1pdl|w1ab)  # W1 plain, then with each of AB_KNOBS (w1pdl: PDL=1; w1ab: the projections' GEMM knobs), on one
      # machine (~2 min a run); w1pdl.jsonl / w1ab.jsonl
      [ $stage = w1pdl ] && ab=PDL=1 || ab=${AB_KNOBS:-GEMM_SWAP_ROWS=64 SKINNY_GEMM_ROWS=64}
      for knobs in "" $ab; do
        timeout ${W1_TIMEOUT:-240} python3 scripts/bench.py --workload W1 --modes async --sampling t1 \
          ${knobs:+--decode-knobs $knobs} --out "$OUT/$stage.jsonl" > "$OUT/$stage${knobs:+_${knobs//[=,]/_}}.log" 2>&1
      done
      summary "$OUT/$stage.jsonl" ;;
    w1uniform)  # W1 with uniform steps on one wave's count (UNIFORM_ONE_WAVE=1) against the w1 stage's record
      timeout ${W1_TIMEOUT:-240} python3 scripts/bench.py --workload W1 --modes async --sampling t1 \
        --decode-knobs UNIFORM_ONE_WAVE=1 --out "$OUT/w1uniform.jsonl" > "$OUT/w1uniform.log" 2>&1
      summary "$OUT/w1uniform.jsonl" ;;
    w1_profile)  # one W1-shaped step (llama3-8b, B=32, every context 4K: W1's uniform steps at its mean) kernel by
      # kernel: plain launches, PDL, the fused merge (no reduce launch), both (W1_PROFILE_KNOBS: another list)
      for knobs in ${W1_PROFILE_KNOBS:-none PDL=1 FUSED_MERGE=1 PDL=1,FUSED_MERGE=1}; do
        [ "$knobs" = none ] && knobs=""
        timeout 150 python3 bench/step_profile.py --preset llama3-8b --kv auto --batch 32 --ctx 4096 --lengths uniform \
          ${knobs:+--decode-knobs $knobs} --out "$OUT/step_profile_w1.jsonl" 2>&1 | tail -8
      done ;;
    partial)  # issue 23.6: partial vs drain at W2's 16K tail (PARTIAL_MODES, PARTIAL_ROUNDS; one mode per call if long;
      # PARTIAL_KEEP_KV=1: pushes keep the in-flight KV, recompute_running=False, PipelineRL's in-flight update;
      # PARTIAL_KV=fp8: both modes on an fp8 KV cache; KNOBS: --decode-knobs, e.g. STREAM_K_FP8=1)
      timeout ${PARTIAL_TIMEOUT:-540} python3 bench/partial_rollout.py --modes "${PARTIAL_MODES:-drain,partial}" \
        --rounds "${PARTIAL_ROUNDS:-3}" --warmup-rounds "${PARTIAL_WARMUP:-1}" ${PARTIAL_KEEP_KV:+--keep-kv} \
        --kv-cache-dtype "${PARTIAL_KV:-auto}" ${KNOBS:+--decode-knobs "$KNOBS"} \
        --time-budget-s $(( ${PARTIAL_TIMEOUT:-540} - 15 )) --out "$OUT/partial.jsonl" > "$OUT/partial.log" 2>&1
      grep -E " round [0-9]+/" "$OUT/partial.log"; tail -3 "$OUT/partial.log"; cat "$OUT/partial.jsonl" 2>/dev/null ;;
    w2_512)
      timeout 200 python3 scripts/bench.py --workload W2 --modes async --max-num-seqs 512 --sampling t1 \
        "${KNOB_ARGS[@]}" --out "$OUT/w2_512$SUFFIX.jsonl" > "$OUT/w2_512$SUFFIX.log" 2>&1
      summary "$OUT/w2_512$SUFFIX.jsonl" ;;
    w2mem)
      timeout 360 python3 scripts/bench.py --workload W2-mem --modes async --kv-cache-dtype auto,fp8 \
        --kv-budget-frac 0.3 --preemption swap,recompute --sampling t1 "${KNOB_ARGS[@]}" --out "$OUT/w2mem$SUFFIX.jsonl" > "$OUT/w2mem$SUFFIX.log" 2>&1
      summary "$OUT/w2mem$SUFFIX.jsonl" ;;
    profile)
      timeout 200 python3 bench/step_profile.py --kv auto,fp8 --out "$OUT/step_profile.jsonl" 2>&1 | tail -9 ;;
    even_profile)  # W2's steps as they run (even lengths: the fixed split), B=128 and 256, bf16 vs fp8
      for b in 128 256; do
        timeout 140 python3 bench/step_profile.py --kv auto,fp8 --batch $b --ctx 8192 --lengths even \
          "${KNOB_ARGS[@]}" --out "$OUT/step_profile_even$SUFFIX.jsonl" 2>&1 | tail -9
      done ;;
    tail_profile)  # W2's tail steps (fewer than 32 sequences, contexts to 16K: 0.62 of the floor on the H200 at
      # 3ba43f7, its lowest bucket), kernel by kernel: where a step of few long sequences loses its time
      for b in 8 16; do
        timeout 120 python3 bench/step_profile.py --kv auto --batch $b "${KNOB_ARGS[@]}" \
          --out "$OUT/step_profile_tail$SUFFIX.jsonl" 2>&1 | tail -8
      done ;;
    mid_profile)
      for b in 160 200 232; do
        timeout 150 python3 bench/step_profile.py --kv auto --batch $b --lengths even --ctx 6144 --max-num-seqs 256 \
          "${KNOB_ARGS[@]}" \
          --out "$OUT/step_profile_mid$SUFFIX.jsonl" 2>&1 | tail -8
      done ;;
    fm_profile)
      for b in 128 256; do
        for fm in 0 1; do
          timeout 120 python3 bench/step_profile.py --kv auto,fp8 --batch $b --decode-knobs FUSED_MERGE=$fm \
            --out "$OUT/step_profile_fm.jsonl" 2>&1 | tail -8
        done
      done ;;
    ncu)
      python3 - > "$OUT/ncu_vpages.py" <<'PY'
print("import rollout.kernels.paged_decode as pd, runpy, sys")
print("pd.V_PAGES = True")
print("sys.argv = ['bench/ncu_decode.py', '--kv', 'fp8']")
print("runpy.run_path('bench/ncu_decode.py', run_name='__main__')")
PY
      timeout 150 ncu --clock-control none --kernel-name regex:_decode_split_kernel --launch-skip 2 --launch-count 1 \
        --section MemoryWorkloadAnalysis --section SourceCounters --section SpeedOfLight --section WarpStateStats \
        -o "$OUT/fp8_vpages" python3 "$OUT/ncu_vpages.py" > "$OUT/ncu.log" 2>&1
      ncu -i "$OUT/fp8_vpages.ncu-rep" --page details > "$OUT/fp8_vpages_details.txt" 2>&1
      ncu -i "$OUT/fp8_vpages.ncu-rep" --page source --print-source sass --csv > "$OUT/fp8_vpages_sass.csv" 2>&1
      grep -E "Duration|DRAM Throughput|L2 Cache Throughput" "$OUT/fp8_vpages_details.txt" ;;
    *) echo "unknown stage $stage" ;;
  esac
done
