"""GPU microbenchmark of the Triton paged-attention kernels; prints one JSON line per measurement.

Decode is judged by achieved bandwidth: the K/V bytes each step must read over the median time per
call, replayed from a CUDA graph as the engine runs it (no launch overhead; inputs rotated so none is
served from L2). Compare ``gbps`` with the H200's measured copy bandwidth (~4300 GB/s read + write).
Prefill (eager launches, ``triton.testing.do_bench``) is judged by causal TFLOP/s.

    python bench/kernels_bench.py                       # llama3-8b shape, B x ctx grid
    python bench/kernels_bench.py --preset qwen2.5-1.5b --sweep-splits --sweep-prefill
    python bench/kernels_bench.py --preset qwen2.5-1.5b --lengths long-tail --batches 64,256,512 \
        --ctxs 16384,32000 --kv bf16,fp8 --compare-legacy --no-prefill   # W2 shapes: before/after, fp8
    python bench/kernels_bench.py --preset qwen2.5-1.5b --page 128 --fa4 --no-decode   # FA4 vs Triton prefill
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

ROTATE_BYTES = 512 * 2**20  # inputs per timed graph: several times the H200's 60 MB L2
PRESETS = {"llama3-8b": (32, 8, 128), "qwen3-0.6b": (16, 8, 128), "qwen2.5-1.5b": (12, 2, 128)}


def make_cache(batch: int, ctx: int, hkv: int, d: int, page: int, dtype: torch.dtype, seed: int = 0,
               lens: list[int] | None = None, kv: str = "bf16"):
    """A cache holding exactly ``batch`` contexts (``ctx`` tokens each, or ``lens``), pages scattered at
    random. Returns (cache, tables, seq_lens, kv_scales); fp8: the value view and its scales."""
    lens = lens or [ctx] * batch
    nblk = [-(-n // page) for n in lens]
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randperm(sum(nblk) + 1, generator=gen)
    tables = torch.zeros(batch, max(nblk), dtype=torch.int32)
    at = 0
    for i, k in enumerate(nblk):
        tables[i, :k] = pool[at : at + k]
        at += k
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    if kv == "fp8":
        from rollout.layers.kv_quant import fp8_block_bytes, fp8_views

        raw = torch.empty(2, sum(nblk) + 1, fp8_block_bytes(page, hkv, d), dtype=torch.uint8, device="cuda")
        values, scales = fp8_views(raw, hkv, d)
        for half in values:  # K token-major, V token-contiguous (rollout.layers.kv_quant)
            half.view(torch.uint8).copy_(torch.randn(half.shape, device="cuda").to(half.dtype).view(torch.uint8))
        scales.fill_(0.01)
        return values, tables.cuda(), seq_lens, scales
    cache = torch.empty(2, sum(nblk) + 1, page, hkv, d, device="cuda", dtype=dtype).normal_()
    return cache, tables.cuda(), seq_lens, None


def long_tail_lens(batch: int, ctx: int, seed: int, lo: int = 512) -> list[int]:
    """W2-like live contexts: log-uniform in [lo, ctx] (a 512-token prompt plus a long-tailed
    generation so far), the longest always present."""
    gen = torch.Generator().manual_seed(seed)
    u = torch.rand(batch, generator=gen)
    lens = torch.exp(math.log(lo) * (1 - u) + math.log(ctx) * u).long().tolist()
    lens[0] = ctx
    return lens


def even_lens(batch: int, ctx: int, seed: int) -> list[int]:
    """Even live contexts (longest <= 2 x mean, as every W2 step's: bench/w2_lengths.py): uniform in
    [ctx / 3, ctx], the longest always present; the engine gives such a step the fixed split."""
    gen = torch.Generator().manual_seed(seed)
    lens = (ctx / 3 + torch.rand(batch, generator=gen) * (ctx - ctx / 3)).long().tolist()
    lens[0] = ctx
    return lens


def graph_ms(calls: list) -> float:
    """Median ms per call, replaying all ``calls`` in one CUDA graph (as the engine runs decode).

    Each call reads its own copy of the inputs, so together they outgrow the L2 (which do_bench
    flushes before every replay) and no call is served from cache; the graph removes launch overhead.
    """
    from triton.testing import do_bench

    for call in calls:  # compile and warm up outside the capture
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    return do_bench(graph.replay, warmup=25, rep=100, return_mode="median") / len(calls)


# (BLOCK_N, num_warps, num_stages[, maxnreg]); fp8's default is (128, 4, 2, 168)
DECODE_CONFIGS = [(64, 4, 2), (64, 4, 3), (128, 4, 2), (128, 4, 2, 168), (128, 4, 3, 168), (128, 8, 2), (32, 4, 3),
                  (64, 8, 3), (256, 8, 2)]


# swapped products (--swap-ab): tiles to time beside the default. Timed at 5bc5e35 (B=256, fp8): (128, 4, 2, 168)
# 0.258 ms, (64, 4, 2) 0.272, (128, 4, 3) 0.304, (256, 8, 2) 0.428, (128, 8, 2) 0.481 (one program per SM by
# registers). bench/kernel_sass.py (Triton 3.6, sm_90) ranks the untimed ones: the fp8 default holds 3 programs
# (12 warps) per SM at 11.0 KV bytes per warp-instruction, bf16's 5 (20 warps) at 15.3; the ones below keep
# ~11 bytes with 6-11 programs per SM (shared memory bounds them: two stages of K and V).
SWAP_CONFIGS = [(64, 4, 2), (128, 4, 3), (64, 2, 2), (64, 2, 2, 144), (64, 2, 3, 168), (32, 1, 2), (128, 4, 1, 168),
                (128, 4, 2, 144)]

# --sweep-fp8 (issue 23.1): the swapped fp8 kernel's tiles (the default first). H200, B=256 / 512, 16K tail
# (bench/results/h200_2026-12-03_kernels_fp8_sweep_c6fd372.jsonl): (64, 2, 3, 168) 0.234 / 0.477 ms, (64, 2, 4, 168)
# 0.234 / 0.476, (32, 1, 3) 0.241 / 0.480, the previous default (128, 4, 2, 168) 0.257 / 0.500; bf16 0.307 / 0.613.
# The same sweep found no gain in loading the scales' block ids two tiles ahead (Nsight Compute had put 8% of the
# stall samples there) nor in widening e4m3 by integer ops instead of F2FP (even a timing-only stand-in of two byte
# permutes per four values ran no faster: 0.237 ms), so neither is kept.
FP8_CONFIGS = [(64, 2, 3, 168), (64, 2, 4, 168), (128, 4, 2, 168), (64, 2, 3, 128), (64, 1, 3), (32, 1, 3),
               (32, 1, 4), (128, 4, 3, 128)]


def decode_variants(args, batch: int, hkv: int, max_tiles: int, kv: str = "bf16") -> list[dict]:
    """What to time: the balanced partition (default), the previous fixed-split heuristic ("legacy") and
    the balanced one with its merge fused into the split kernel ("fused"), fixed split counts
    (--sweep-splits), tile configs and wave counts (--sweep-decode)."""
    from rollout.kernels.paged_decode import choose_num_splits, choose_split_target, num_sms

    sms = num_sms(torch.device("cuda"))
    # "planned": the partition made once (as the engine does per step for all its layers), then only the split
    # kernel timed; "balanced": every call's programs partition for themselves
    out = [dict(variant="balanced"), dict(variant="planned", plan=True)]
    if kv == "fp8":  # token-contiguous V copied page by page (each copy 512 contiguous bytes): on, and off
        from rollout.kernels.paged_decode import V_PAGES

        out.append(dict(variant="planned_v_pages" if not V_PAGES else "planned_no_v_pages", plan=True,
                        v_pages=not V_PAGES))
    if args.compare_legacy:
        out.append(dict(variant="legacy", num_splits=choose_num_splits(batch, hkv, max_tiles, sms)))
        out.append(dict(variant="fused", fused_merge=True))  # balanced, the merge in the split kernel
        out.append(dict(variant="planned_fused", plan=True, fused_merge=True))  # and planned: no reduce launch
        # every length profile cut for all DECODE_WAVES waves (before even lengths got one wave)
        out.append(dict(variant="planned_all_waves", plan=True, split_target=choose_split_target(hkv, sms)))
    if getattr(args, "compare_even", False):  # the even path's split: its rules, then fixed counts around them
        from rollout.kernels.paged_decode import resident_programs

        per_sm = resident_programs(torch.float8_e4m3fn if kv == "fp8" else torch.bfloat16)
        out.append(dict(variant="even", even_lengths=True, plan=True))  # as the engine runs it (the module's rule)
        out.append(dict(variant="even_fused", even_lengths=True, plan=True, fused_merge=True))
        out.append(dict(variant="even_one_wave", num_splits=choose_num_splits(batch, hkv, max_tiles, sms, per_sm),
                        fixed_min_chunk=0))  # the rule before EVEN_WAVES and EVEN_MIN_CHUNK_TILES
        if kv == "fp8":  # one wave sized for bf16's 4 resident programs (before FP8_PROGRAMS_PER_SM)
            out.append(dict(variant="even_ps4", num_splits=choose_num_splits(batch, hkv, max_tiles, sms, 4),
                            fixed_min_chunk=0))
        # the balanced partition cut for several waves (its even-lengths default is one wave, like the old fixed
        # rule): chunks of equal tiles, so a long sequence gets more of them, where a fixed count cuts every
        # sequence alike
        out += [dict(variant=f"planned_w{w}", plan=True, split_target=choose_split_target(hkv, sms * per_sm // 4, w))
                for w in (2, 4, 8)]  # fmt: skip
        out += [dict(variant="fixed", num_splits=s) for s in (1, 2, 3, 4, 6, 8, 12, 16)]
    if getattr(args, "compare_stream", False):  # the stream split: runs across sequences, 1-4 waves of programs
        out.append(dict(variant="even", even_lengths=True, plan=True))  # what the engine runs for even lengths
        if getattr(args, "lengths", None) == "uniform":  # W1's steps: one wave's equal chunks (UNIFORM_ONE_WAVE)
            out.append(dict(variant="uniform", even_lengths=2, plan=True))
        out += [dict(variant=f"stream_w{w}", stream=True, stream_waves=w, plan=True) for w in (1, 2, 4)]
        # one wave sized by other residencies (fp8: 6 resident programs an SM; bf16's stream kernel: 3 at its 153
        # registers, so its default 6 is two waves; capped at 128 / 96 registers: 4 / 5 resident)
        name = "FP8_PROGRAMS_PER_SM" if kv == "fp8" else "STREAM_PROGRAMS_PER_SM"
        out += [dict(variant=f"stream_w1_ps{n}", stream=True, stream_waves=1, plan=True, knobs={name: n})
                for n in ((5, 7) if kv == "fp8" else (3, 4, 5))]
        if kv != "fp8":
            out += [dict(variant=f"stream_r{r}_ps{n}", stream=True, stream_waves=1, plan=True,
                         knobs={"STREAM_MAXNREG": r, name: n}) for r, n in ((128, 4), (128, 8), (96, 5), (96, 10))]
            # other tiles (kernel_sass with Triton 3.6): 32 keys x 4 warps at 96 registers holds 5 an SM; 64 x 8
            # warps at 108 holds 2 (16 warps)
            out += [dict(variant=f"stream_c{c[0]}w{c[1]}_ps{n}", stream=True, stream_waves=1, plan=True, config=c,
                         knobs={name: n}) for c, n in (((32, 4, 2, None), 5), ((32, 4, 2, None), 10),
                                                       ((64, 8, 2, None), 2), ((64, 8, 2, None), 4))]
            # the run's sequences unrolled (STREAM_SEGS 8: 116 registers, 4 an SM; capped at 96: 5 an SM; 32 keys:
            # 96 registers, 5 an SM). 8, not 4: the padding that bounds a run to SEGS sequences unbalances the runs
            # (the most work a program gets over the mean, W2's 16K long tail at 264 programs: 1.34 at 4, 1.05 at 6,
            # 1.02 at 8; docs/benchmarks.md)
            out += [dict(variant=v, stream=True, stream_waves=1, plan=True, knobs={"STREAM_SEGS": 8, **k}, **c)
                    for v, k, c in (("stream_s8_ps4", {name: 4}, {}),
                                    ("stream_s8_r96_ps5", {name: 5, "STREAM_MAXNREG": 96}, {}),
                                    ("stream_s8_c32w4_ps5", {name: 5}, {"config": (32, 4, 2, None)}))]
        else:  # fp8's stream kernel reloads 13 spilled values in its loops at 168 registers (none at 32 keys; 8 at
            # 200 registers, 5 an SM; none with the run's sequences unrolled, STREAM_SEGS, and 5% fewer instructions
            # a key tile)
            out += [dict(variant=f"stream_c{c[0]}r{c[3]}_ps{n}", stream=True, stream_waves=1, plan=True, config=c,
                         knobs={name: n}) for c, n in (((32, 2, 3, 168), 6), ((64, 2, 3, 200), 5))]
            out += [dict(variant=f"stream_s{s}", stream=True, stream_waves=1, plan=True, knobs={"STREAM_SEGS": s})
                    for s in (6, 8)]
    if args.sweep_splits:
        out += [dict(variant="fixed", num_splits=s) for s in (1, 2, 4, 8, 16, 32, 64)]
    if args.swap_ab:  # the products swapped (key tile as M): default tile, then a few others
        out.append(dict(variant="swap", swap_ab=True))
        out += [dict(variant="swap", swap_ab=True, config=c) for c in SWAP_CONFIGS]
    if getattr(args, "sweep_fp8", False) and kv == "fp8":  # issue 23.1: the swapped fp8 kernel's tiles and waves
        out += [dict(variant="fp8", swap_ab=True, config=c) for c in FP8_CONFIGS]
        out += [dict(variant="fp8_waves", swap_ab=True, config=FP8_CONFIGS[0], split_target=choose_split_target(
            hkv, sms, w)) for w in (2, 6, 8, 12)]  # fmt: skip
    if args.sweep_decode:
        out += [dict(variant="waves", split_target=choose_split_target(hkv, sms, w)) for w in (1, 2, 8, 16)]
        out += [dict(variant="config", config=c) for c in DECODE_CONFIGS]
    return out


def time_decode(args, batch: int, ctx: int, hq: int, hkv: int, d: int, dtype: torch.dtype, kv: str) -> list[dict]:
    import rollout.kernels.paged_decode as pd
    from rollout.kernels.knobs import knob_module

    lens = {"long-tail": long_tail_lens, "even": even_lens}.get(args.lengths, lambda b, c, seed: [c] * b)(
        batch, ctx, seed=batch)
    fp8 = kv == "fp8"
    token_bytes = 2 * hkv * (d + 2 if fp8 else d * (torch.finfo(dtype).bits // 8))  # K + V, scales included
    kv_bytes = sum(lens) * token_bytes
    copies = max(1, min(64, -(-ROTATE_BYTES // kv_bytes)))
    inputs = []
    for i in range(copies):
        cache, tables, seq_lens, scales = make_cache(batch, ctx, hkv, d, args.page, dtype, seed=i, lens=lens, kv=kv)
        q = torch.randn(batch, hq, d, device="cuda", dtype=dtype)
        inputs.append((q, cache, tables, seq_lens, torch.empty_like(q), scales))
    kv_dtype = inputs[0][1][0].dtype  # the K half's: a [2, ...] cache or fp8's KVPair
    max_tiles = -(-inputs[0][2].shape[1] * args.page // pd.decode_config(args.page, d, kv_dtype)[0])
    default_config = pd.decode_config
    recs = []
    for var in decode_variants(args, batch, hkv, max_tiles, kv):
        keys = ("num_splits", "split_target", "fused_merge", "swap_ab", "v_pages", "even_lengths", "fixed_min_chunk",
                "stream", "stream_waves")
        kw = {k: var[k] for k in keys if k in var}
        kw.setdefault("stream", False)  # the chunked rules by name (fp8's engine default is stream_w1)
        planned = var.get("plan", False)
        if "config" in var:
            pd.decode_config = lambda *_, c=var["config"]: c  # bench-only override of the tile choice
        mods = {name: knob_module(name) for name in var.get("knobs", {})}
        saved = {name: getattr(mods[name], name) for name in mods}
        for name, value in var.get("knobs", {}).items():  # module constants for this variant only
            setattr(mods[name], name, value)
        try:
            calls = [
                lambda x=x, kw=kw, p=({} if planned else None): pd.paged_decode_attention(  # a plan per input
                    x[0], x[1], x[2], x[3], d**-0.5, out=x[4], kv_scales=x[5], plans=p, **kw
                )
                for x in inputs
            ]
            ms = graph_ms(calls)
        finally:
            pd.decode_config = default_config
            for name, value in saved.items():
                setattr(mods[name], name, value)
        rec = {
            "bench": "decode", "preset": args.preset, "dtype": str(dtype).removeprefix("torch."), "kv": kv,
            "lengths": args.lengths, "B": batch, "ctx": ctx, "mean_ctx": round(sum(lens) / batch),
            **{k: v for k, v in var.items() if k != "config"}, "config": var.get("config", default_config(
                args.page, d, kv_dtype)), "ms": round(ms, 4),
            "kv_gib": round(kv_bytes / 2**30, 3), "gbps": round(kv_bytes / ms / 1e6, 1), "graph_copies": copies,
        }  # fmt: skip
        print(json.dumps(rec), flush=True)
        recs.append(rec)
    return recs


def kv_summary(recs: list[dict]) -> None:
    """One line per (B, ctx): the default fp8 decode against the default bf16 one, same inputs' lengths; then
    per (kv, B, ctx) the fastest variant timed."""
    best = {(r["kv"], r["B"], r["ctx"]): r for r in recs if r["variant"] == "balanced"}
    for (kv, batch, ctx), r in best.items():
        ref = best.get(("bf16", batch, ctx))
        if kv == "fp8" and ref:
            rec = {
                "bench": "fp8_vs_bf16", "B": batch, "ctx": ctx, "bf16_ms": ref["ms"], "fp8_ms": r["ms"],
                "speedup": round(ref["ms"] / r["ms"], 3), "bf16_gbps": ref["gbps"], "fp8_gbps": r["gbps"],
            }  # fmt: skip
            print(json.dumps(rec), flush=True)
    for (kv, batch, ctx), r in best.items():
        top = min((x for x in recs if (x["kv"], x["B"], x["ctx"]) == (kv, batch, ctx)), key=lambda x: x["ms"])
        rec = {"bench": "fastest", "kv": kv, "B": batch, "ctx": ctx, "variant": top["variant"],
               "swap_ab": top.get("swap_ab", False), "config": top["config"], "ms": top["ms"],
               "vs_default": round(r["ms"] / top["ms"], 3), "gbps": top["gbps"]}  # fmt: skip
        print(json.dumps(rec), flush=True)


PREFILL_CONFIGS = [
    (64, 64, 4, 2),
    (64, 64, 4, 3),
    (128, 64, 8, 2),
    (128, 64, 8, 3),
    (128, 128, 8, 2),
    (128, 32, 4, 3),
]


def time_prefill(args, batch: int, q_len: int, prefix: int, hq: int, hkv: int, d: int, dtype, kv: str) -> None:
    from triton.testing import do_bench

    import rollout.kernels.paged_prefill as pp

    cache, tables, seq_lens, scales = make_cache(batch, q_len + prefix, hkv, d, args.page, dtype, kv=kv)
    q = torch.randn(batch * q_len, hq, d, device="cuda", dtype=dtype)
    qsl = torch.arange(0, batch + 1, device="cuda", dtype=torch.int32) * q_len
    visible = batch * (q_len * prefix + q_len * (q_len + 1) / 2)  # causal (query, key) pairs
    default = pp.prefill_blocks
    for cfg in PREFILL_CONFIGS if args.sweep_prefill else [default(d, args.page)]:
        pp.prefill_blocks = lambda *_, cfg=cfg: cfg  # bench-only override of the tile choice
        try:
            fn = lambda: pp.paged_prefill_attention(q, cache, qsl, seq_lens, tables, d**-0.5, q_len, kv_scales=scales)
            ms = do_bench(fn, warmup=10, rep=50, return_mode="median")
        finally:
            pp.prefill_blocks = default
        rec = {
            "bench": "prefill", "preset": args.preset, "dtype": str(dtype).removeprefix("torch."), "kv": kv,
            "B": batch, "q_len": q_len, "prefix": prefix, "config": cfg, "ms": round(ms, 4),
            "tflops": round(4 * hq * d * visible / ms / 1e9, 1),
        }  # fmt: skip
        print(json.dumps(rec), flush=True)


PREFILL_SHAPES = [(1, 4096, 0), (4, 2048, 0), (8, 512, 4096), (1, 8192, 0)]  # (sequences, new tokens, cached prefix)


def prefill_meta(q_lens: list[int], seq_lens: torch.Tensor, tables: torch.Tensor):
    """AttentionMetadata of one step (new tokens at the end of each context; no K/V to store: slots -1)."""
    from rollout.layers.attention_metadata import AttentionMetadata

    t = sum(q_lens)
    qsl = torch.tensor([0, *q_lens], device="cuda").cumsum(0).to(torch.int32)
    return AttentionMetadata(
        positions=torch.zeros(t, dtype=torch.int64, device="cuda"),
        slot_mapping=torch.full((t,), -1, dtype=torch.int64, device="cuda"), query_start_loc=qsl,
        seq_lens=seq_lens, block_tables=tables, max_query_len=max(q_lens), max_seq_len=int(seq_lens.max()),
        decode_only=all(n == 1 for n in q_lens),
    )  # fmt: skip


def eager_and_graph_ms(fn) -> tuple[float, float | None, str | None]:
    """(ms per call launched from Python, as an eager engine step launches it; ms per call replayed from a CUDA
    graph: the kernels' device time, without the host's dispatch; the capture's error, if it failed). FA4's
    CuTe DSL dispatch runs ~1,200 lines of Python per call, so at small shapes the eager time is the host's."""
    from triton.testing import do_bench

    eager = do_bench(fn, warmup=10, rep=50, return_mode="median")
    try:
        return eager, graph_ms([fn]), None
    except Exception as e:  # noqa: BLE001 - reported in the record, the eager time still stands
        torch.cuda.synchronize()
        return eager, None, f"{type(e).__name__}: {e}"[:200]


def time_prefill_fa4(args, batch: int, q_len: int, prefix: int, hq: int, hkv: int, d: int, dtype) -> None:
    """The prefill phase through both backends on one step (issue 23.7): ``TritonAttentionBackend`` against
    ``FA4PrefillBackend`` (FA4's paged varlen kernel), same cache, block tables and metadata; then their
    outputs' largest difference relative to the Triton output's largest magnitude."""

    from rollout.layers.fa4_backend import FA4PrefillBackend
    from rollout.layers.triton_backend import TritonAttentionBackend

    cache, tables, seq_lens, _ = make_cache(batch, q_len + prefix, hkv, d, args.page, dtype)
    q = torch.randn(batch * q_len, hq, d, device="cuda", dtype=dtype)
    meta = prefill_meta([q_len] * batch, seq_lens, tables)
    visible = batch * (q_len * prefix + q_len * (q_len + 1) / 2)  # causal (query, key) pairs
    ms, gms, outs = {}, {}, {}
    for name, backend in (("triton", TritonAttentionBackend()), ("fa4", FA4PrefillBackend(args.page))):
        fn = lambda b=backend: b._prefill_rows(q, cache, None, meta, d**-0.5, None)
        outs[name] = fn()  # compiles (FA4: its JIT, seconds) outside the timing
        ms[name], gms[name], err = eager_and_graph_ms(fn)
        rec = {
            "bench": "prefill_backend", "backend": name, "preset": args.preset,
            "dtype": str(dtype).removeprefix("torch."), "page": args.page, "B": batch, "q_len": q_len,
            "prefix": prefix, "ms": round(ms[name], 4),
            "tflops": round(4 * hq * d * visible / ms[name] / 1e9, 1),
            "graph_ms": gms[name] and round(gms[name], 4),
            "graph_tflops": gms[name] and round(4 * hq * d * visible / gms[name] / 1e9, 1), "graph_error": err,
        }  # fmt: skip
        print(json.dumps(rec), flush=True)
    diff = (outs["fa4"].float() - outs["triton"].float()).abs().max() / outs["triton"].float().abs().max()
    graph = gms["triton"] / gms["fa4"] if gms["triton"] and gms["fa4"] else None
    rec = {"bench": "fa4_vs_triton_prefill", "preset": args.preset, "page": args.page, "B": batch, "q_len": q_len,
           "prefix": prefix, "speedup": round(ms["triton"] / ms["fa4"], 3),
           "graph_speedup": graph and round(graph, 3), "max_rel_diff": round(diff.item(), 5)}  # fmt: skip
    print(json.dumps(rec), flush=True)


def time_mixed_fa4(args, hq: int, hkv: int, d: int, dtype, decodes: int = 64, ctx: int = 16384) -> None:
    """A W2-like mixed step through each backend's whole ``forward``: a 2048-token prompt beside ``decodes``
    one-token rows of long-tailed contexts (``decode_rows`` set, as the CUDA runner sets it): FA4 prefill plus
    Triton decode rows against Triton for both."""

    from rollout.layers.attention_metadata import DecodeRows
    from rollout.layers.fa4_backend import FA4PrefillBackend
    from rollout.layers.triton_backend import TritonAttentionBackend

    lens = [2048, *long_tail_lens(decodes, ctx, seed=decodes)]
    q_lens = [2048] + [1] * decodes
    cache, tables, seq_lens, _ = make_cache(len(lens), ctx, hkv, d, args.page, dtype, lens=lens)
    meta = prefill_meta(q_lens, seq_lens, tables)
    idx = torch.arange(1, len(lens), device="cuda")
    meta.decode_rows = DecodeRows(meta.query_start_loc[idx].long(), tables[idx], seq_lens[idx])
    t = sum(q_lens)
    q = torch.randn(t, hq, d, device="cuda", dtype=dtype)
    k, v = (torch.randn(t, hkv, d, device="cuda", dtype=dtype) for _ in range(2))
    ms, gms, errs = {}, {}, {}
    for name, backend in (("triton", TritonAttentionBackend()), ("fa4", FA4PrefillBackend(args.page))):
        fn = lambda b=backend: b.forward(q, k, v, cache, meta, d**-0.5)
        fn()
        ms[name], gms[name], errs[name] = eager_and_graph_ms(fn)
    graph = gms["triton"] / gms["fa4"] if gms["triton"] and gms["fa4"] else None
    rec = {"bench": "fa4_vs_triton_mixed", "preset": args.preset, "page": args.page, "prefill_tokens": 2048,
           "decode_rows": decodes, "ctx": ctx, "mean_decode_ctx": round(sum(lens[1:]) / decodes),
           "triton_ms": round(ms["triton"], 4), "fa4_ms": round(ms["fa4"], 4),
           "speedup": round(ms["triton"] / ms["fa4"], 3),
           "triton_graph_ms": gms["triton"] and round(gms["triton"], 4),
           "fa4_graph_ms": gms["fa4"] and round(gms["fa4"], 4),
           "graph_speedup": graph and round(graph, 3), "graph_errors": errs}  # fmt: skip
    print(json.dumps(rec), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", choices=list(PRESETS), default="llama3-8b")
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    parser.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 32, 128, 256])
    parser.add_argument(
        "--ctxs", type=lambda s: [int(x) for x in s.split(",")], default=[1024, 4096, 8192, 16384]
    )
    parser.add_argument("--page", type=int, default=16)
    parser.add_argument("--sweep-splits", action="store_true", help="also time fixed num_splits values")
    parser.add_argument("--compare-legacy", action="store_true",
                        help="also time the previous scheme (one split count per batch size) on the same inputs")
    parser.add_argument("--swap-ab", action="store_true",
                        help="also time the decode kernel with its products swapped (key tile as the M side)")
    parser.add_argument("--sweep-fp8", action="store_true",
                        help="also time the swapped fp8 kernel's tiles and wave counts (issue 23.1)")
    parser.add_argument("--sweep-decode", action="store_true", help="also time decode tile configs and wave counts")
    parser.add_argument("--compare-stream", action="store_true",
                        help="also time the stream split (runs of key tiles across sequences) at 1, 2 and 4 waves, "
                             "beside the even-lengths rule")
    parser.add_argument("--compare-even", action="store_true",
                        help="time the even split: the engine's rule, the one-wave rule (before EVEN_WAVES), "
                             "fp8 sized for 4 programs per SM, the balanced partition at 2/4/8 waves, fixed counts "
                             "1-16 (use with --lengths even)")
    parser.add_argument("--lengths", choices=["uniform", "long-tail", "even"], default="uniform",
                        help="every context ctx tokens, or W2-like log-uniform in [512, ctx]")
    parser.add_argument("--kv", default="bf16", help="comma list of bf16, fp8 (cache types to time decode and prefill)")
    parser.add_argument("--sweep-prefill", action="store_true", help="time several prefill tile configs")
    parser.add_argument("--no-prefill", action="store_true")
    parser.add_argument("--no-decode", action="store_true", help="skip the decode grid")
    parser.add_argument("--fa4", action="store_true",
                        help="time the prefill phase through FA4PrefillBackend vs TritonAttentionBackend (bf16; needs "
                             "flash-attn-4; use --page 128, FA4's TMA page) and a W2-like mixed step")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("kernels_bench.py needs a CUDA GPU")
    import triton

    hq, hkv, d = PRESETS[args.preset]
    dtype = getattr(torch, args.dtype)
    header = {
        "bench": "env", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "triton": triton.__version__, "preset": args.preset, "hq": hq, "hkv": hkv, "head_dim": d,
    }  # fmt: skip
    print(json.dumps(header), flush=True)
    recs = []
    for kv in args.kv.split(",") if not args.no_decode else []:
        for batch in args.batches:
            for ctx in args.ctxs:
                recs += time_decode(args, batch, ctx, hq, hkv, d, dtype, kv)
                torch.cuda.empty_cache()
    kv_summary(recs)
    if not args.no_prefill:
        for kv in args.kv.split(","):
            for batch, q_len, prefix in PREFILL_SHAPES:
                time_prefill(args, batch, q_len, prefix, hq, hkv, d, dtype, kv)
                torch.cuda.empty_cache()
    if args.fa4:
        for batch, q_len, prefix in PREFILL_SHAPES:
            time_prefill_fa4(args, batch, q_len, prefix, hq, hkv, d, dtype)
            torch.cuda.empty_cache()
        time_mixed_fa4(args, hq, hkv, d, dtype)


if __name__ == "__main__":
    main()
