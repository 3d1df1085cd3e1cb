"""Where one decode step's GPU time goes, per kernel, for each KV cache dtype (issue 23: FP8 KV that pays).

Builds the engine on a random-init model of a real shape, B sequences whose contexts are W2-like (log-uniform
from 512 to --ctx tokens, the longest always present; ``bench/kernels_bench.py``'s ``long_tail_lens``), and
steps the engine until every prompt is prefilled, then runs ``--steps`` steps of the whole batch decoding (CUDA
graph replays) under ``torch.profiler``: per kernel name, one decode step's device time (attention, GEMMs, the
KV store, norms, sampling), the step's wall time, its kernel count and the device's idle time between its
kernels (``inner_gap_ms``: what a graph of many small kernels pays per launch; ``outer_gap_ms``: between steps).
One JSON line per dtype, then a side-by-side table.

    python bench/step_profile.py --kv auto,fp8 --out $OUT/step_profile.jsonl      # qwen2.5-1.5b, B=256, 16K tail
    python bench/step_profile.py --kv auto,fp8 --batch 128 --ctx 8192 --lengths even   # W2's fixed-split steps
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.kernels_bench import even_lens, long_tail_lens  # noqa: E402
from bench.score_bench import load_bench_script  # noqa: E402
from rollout import Engine, SamplingParams  # noqa: E402
from rollout.layers.gemm_tune import route_knobs  # noqa: E402

CLASSES = (("attn_decode", ("_decode_split", "_decode_reduce")), ("kv_store", ("store", "quant", "reshape_and_cache")),
           ("gemm", ("gemm", "gemv", "cutlass", "nvjet", "sm90_xmma", "ampere", "splitk", "cublas")),
           ("sampler", ("sample", "gumbel", "argmax", "softmax", "topk", "logsumexp")),
           ("norm_rope_act", ("rms", "norm", "rotary", "rope", "silu", "act_and_mul")))  # fmt: skip


STEP_GAP_US = 30.0  # a device gap at least this long is between steps (the host's turn), not inside one graph


def device_gaps(intervals: list[tuple[float, float]], step_gap_us: float = STEP_GAP_US) -> dict[str, float]:
    """What a run's device intervals (start, end in us; kernels and copies) say about the time between them:
    ``kernels`` (how many), ``busy_us`` (the union of the intervals), ``inner_gap_us`` (idle time between one
    interval's end and the next's start when shorter than ``step_gap_us``: launch and ramp-up inside a graph
    replay, what a step of many small kernels pays per kernel) and ``outer_gap_us`` (the longer gaps: between
    steps). Overlapping intervals (two streams) count once."""
    busy = inner = outer = 0.0
    end = None
    for s, e in sorted(intervals):
        if end is None or s >= end:
            if end is not None:
                gap = s - end
                if gap < step_gap_us:
                    inner += gap
                else:
                    outer += gap
            busy += e - s
            end = e
        elif e > end:
            busy += e - end
            end = e
    return dict(kernels=len(intervals), busy_us=busy, inner_gap_us=inner, outer_gap_us=outer)


def kernel_times(fn) -> tuple[dict[str, float], float, dict[str, float]]:
    """Per-kernel device time (us) of one call of ``fn``, its wall time (s), and ``device_gaps`` of its device
    intervals."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()  # on a CPU (the tests) the profile holds no device events: empty tables
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        wall = time.perf_counter() - t0
    times: dict[str, float] = collections.Counter()
    for e in prof.key_averages() if cuda else ():
        if e.device_time_total > 0:
            times[e.key] += e.device_time_total
    spans = [(e.time_range.start, e.time_range.end) for e in prof.events()
             if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start]
    return times, wall, device_gaps(spans)


def classify(name: str) -> str:
    low = name.lower()
    for cls, keys in CLASSES:
        if any(k in low for k in keys):
            return cls
    return "other"


def profile_kv(hf, prompts: list[list[int]], kv: str, args) -> tuple[dict[str, float], float, dict | None, dict]:
    """One decode step's device time per kernel name (us) with ``kv_cache_dtype=kv``, its wall (ms), the mixed
    steps' record (``--mixed``) and the step's bytes (live KV, weights) for the floors: every
    prompt is prefilled first (steps until the engine has computed them all), then ``--steps`` steps of the
    whole batch decoding (graph replays) run under the profiler."""
    engine = Engine.from_pretrained(hf, dtype="bfloat16", max_model_len=args.ctx + 4 * args.steps + 64,
                                    enable_prefix_caching=False, max_num_seqs=args.max_num_seqs or args.batch,
                                    kv_cache_dtype=kv)
    route_knobs(engine.model, args.decode_knobs)  # the GEMM knobs (parsed by main) are per layer
    engine.generate([q[:600] for q in prompts[:8]], SamplingParams(max_tokens=16, ignore_eos=True))  # compile
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=4 * args.steps + 32, ignore_eos=True)
    for q in prompts:
        engine.add_request(q, params)
    need = sum(len(q) for q in prompts)
    base = engine.get_stats().num_prefill_tokens
    while engine.get_stats().num_prefill_tokens - base < need:
        engine.step()
    for _ in range(4):  # the last prefill's samples collected, graphs for this batch captured
        engine.step()

    def run() -> None:
        for _ in range(args.steps):
            engine.step()

    ctx = [len(q) + 4 + args.steps // 2 for q in prompts]  # mean context over the profiled steps (approx.)
    floors = dict(attn_floor_ms=sum(ctx) * engine.kv.token_bytes, gemm_floor_ms=engine.model.weight_bytes_per_step())
    times, wall, gaps = kernel_times(run)
    mixed = None
    if args.mixed:  # a new prompt joins the decoding batch: the mixed step runs eagerly (no decode graph)
        gen = torch.Generator().manual_seed(1)
        engine.add_request(torch.randint(100, 1000, (args.mixed,), generator=gen).tolist(), params)

        def run_mixed() -> None:
            for _ in range(3):  # the async engine's step() may return before the mixed step's kernels run
                engine.step()

        m_times, m_wall, _ = kernel_times(run_mixed)
        top = sorted(m_times.items(), key=lambda kv: -kv[1])[:25]
        mixed = dict(mixed_prompt=args.mixed, three_steps_wall_ms=round(m_wall * 1e3, 3),
                     three_steps_kernel_ms=round(sum(m_times.values()) / 1e3, 3),
                     decode_step_wall_ms=round(wall / args.steps * 1e3, 3),
                     top_ms=[(k[:90], round(v / 1e3, 4)) for k, v in top])  # fmt: skip
    while engine.has_unfinished_requests():
        engine.step()
    per_step = dict(kernels_per_step=round(gaps["kernels"] / args.steps, 1),
                    busy_ms=round(gaps["busy_us"] / args.steps / 1e3, 4),
                    inner_gap_ms=round(gaps["inner_gap_us"] / args.steps / 1e3, 4),
                    outer_gap_ms=round(gaps["outer_gap_us"] / args.steps / 1e3, 4))
    return {k: v / args.steps for k, v in times.items()}, wall / args.steps * 1e3, mixed, floors, per_step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen2.5-1.5b")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--ctx", type=int, default=16384, help="longest context; the others log-uniform from 512")
    p.add_argument("--lengths", choices=["long-tail", "even", "uniform"], default="long-tail",
                   help="long-tail: the balanced partition's steps; even (uniform in [ctx / 3, ctx]): the fixed "
                        "split's, which every W2 step takes (bench/w2_lengths.py); uniform: every prompt ctx long, "
                        "W1's steps (one wave's equal chunks)")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--max-num-seqs", type=int, default=0,
                   help="the engine's max_num_seqs (0: --batch). Above --batch, the step replays the next captured "
                        "size up (padded, as W2's steps between graph sizes do: 200 sequences in the 224 graph at 256)")
    p.add_argument("--kv", default="auto,fp8", help="comma list of kv_cache_dtype values")
    p.add_argument("--mixed", type=int, default=0, metavar="TOKENS",
                   help="also time the steps around a TOKENS-long prompt joining the batch (an eager mixed step)")
    p.add_argument("--decode-knobs", default="", metavar="NAME=INT[,...]",
                   help="rollout.kernels.paged_decode switches, as scripts/bench.py's (e.g. FUSED_MERGE=1)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("step_profile.py needs a CUDA GPU")
    bench = load_bench_script()
    bw = bench.copy_bandwidth_tbps()
    args.decode_knobs = knobs = bench.parse_decode_knobs(args.decode_knobs) if args.decode_knobs else {}
    bench.apply_decode_knobs(knobs)
    hf = bench.build_hf(args.preset)
    vocab = hf.config.vocab_size
    if args.lengths == "uniform":
        lens = [args.ctx] * args.batch
    else:
        lens = (even_lens if args.lengths == "even" else long_tail_lens)(args.batch, args.ctx, seed=args.batch)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, vocab - 100, (n,), generator=gen).tolist() for n in lens]
    rows = {}
    for kv in args.kv.split(","):
        step, wall_ms, mixed, nbytes, per_step = profile_kv(hf, prompts, kv, args)
        by_class: dict[str, float] = collections.Counter()
        for k, us in step.items():
            by_class[classify(k)] += us
        # each class against its bytes at the copy bandwidth: attention's live KV, the GEMMs' weights
        floors = {k: round(v / (bw * 1e12) * 1e3, 3) for k, v in nbytes.items()}
        eff = {"attn_decode": round(floors["attn_floor_ms"] / (by_class["attn_decode"] / 1e3), 3),
               "gemm": round(floors["gemm_floor_ms"] / (by_class["gemm"] / 1e3), 3)}
        top = sorted(step.items(), key=lambda kv: -kv[1])[:40]
        rec = dict(bench="step_profile", preset=args.preset, kv_cache_dtype=kv, batch=args.batch, lengths=args.lengths,
                   max_num_seqs=args.max_num_seqs or args.batch,
                   mean_ctx=round(sum(lens) / len(lens)), steps=args.steps, commit=bench._commit(),
                   step_kernel_ms=round(sum(step.values()) / 1e3, 3), step_wall_ms=round(wall_ms, 3),
                   by_class_ms={k: round(v / 1e3, 3) for k, v in sorted(by_class.items(), key=lambda kv: -kv[1])},
                   top_ms=[(k[:90], round(v / 1e3, 4)) for k, v in top], decode_knobs=knobs, mixed=mixed,
                   copy_bw_tbps=round(bw, 3), **floors, floor_over_kernel=eff, **per_step)  # fmt: skip
        rows[kv] = rec
        print(json.dumps(rec), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(rec) + "\n")
        torch.cuda.empty_cache()
    classes = sorted({c for r in rows.values() for c in r["by_class_ms"]})
    print("class".ljust(16) + "".join(k.rjust(12) for k in rows))
    for c in classes + ["step_kernel_ms", "kernels_per_step", "inner_gap_ms", "outer_gap_ms"]:
        vals = [r["by_class_ms"].get(c, 0.0) if c in r["by_class_ms"] else r[c] for r in rows.values()]
        print(c.ljust(16) + "".join(f"{v:12.3f}" for v in vals))


if __name__ == "__main__":
    main()
