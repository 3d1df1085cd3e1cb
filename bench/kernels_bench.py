"""GPU microbenchmark of the Triton paged-attention kernels; prints one JSON line per measurement.

Decode is judged by achieved bandwidth: the K/V bytes each step must read over the median time per
call, replayed from a CUDA graph as the engine runs it (no launch overhead; inputs rotated so none is
served from L2). Compare ``gbps`` with the H200's measured copy bandwidth (~4300 GB/s read + write).
Prefill (eager launches, ``triton.testing.do_bench``) is judged by causal TFLOP/s.

    python bench/kernels_bench.py                       # llama3-8b shape, B x ctx grid
    python bench/kernels_bench.py --preset qwen2.5-1.5b --sweep-splits --sweep-prefill
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

ROTATE_BYTES = 512 * 2**20  # inputs per timed graph: several times the H200's 60 MB L2
PRESETS = {"llama3-8b": (32, 8, 128), "qwen3-0.6b": (16, 8, 128), "qwen2.5-1.5b": (12, 2, 128)}


def make_cache(batch: int, ctx: int, hkv: int, d: int, page: int, dtype: torch.dtype, seed: int = 0):
    """A cache holding exactly ``batch`` contexts of ``ctx`` tokens, pages scattered at random."""
    nblk = -(-ctx // page)
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randperm(batch * nblk + 1, generator=gen)[: batch * nblk]
    tables = pool.view(batch, nblk).to("cuda", torch.int32)
    cache = torch.empty(2, batch * nblk + 1, page, hkv, d, device="cuda", dtype=dtype).normal_()
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    return cache, tables, seq_lens


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


def time_decode(args, batch: int, ctx: int, hq: int, hkv: int, d: int, dtype: torch.dtype) -> None:
    from rollout.kernels.paged_decode import (
        choose_num_splits,
        decode_block_n,
        num_sms,
        paged_decode_attention,
    )

    kv_bytes = 2 * batch * ctx * hkv * d * (torch.finfo(dtype).bits // 8)
    copies = max(1, min(64, -(-ROTATE_BYTES // kv_bytes)))
    inputs = []
    for i in range(copies):
        cache, tables, seq_lens = make_cache(batch, ctx, hkv, d, args.page, dtype, seed=i)
        q = torch.randn(batch, hq, d, device="cuda", dtype=dtype)
        inputs.append((q, cache, tables, seq_lens, torch.empty_like(q)))
    max_tiles = -(-inputs[0][2].shape[1] * args.page // decode_block_n(args.page, d))
    auto = choose_num_splits(batch, hkv, max_tiles, num_sms(torch.device("cuda")))
    for s in sorted({auto, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64}) if args.sweep_splits else [auto]:
        calls = [
            lambda s=s, x=x: paged_decode_attention(x[0], x[1], x[2], x[3], d**-0.5, out=x[4], num_splits=s)
            for x in inputs
        ]
        ms = graph_ms(calls)
        rec = {
            "bench": "decode", "preset": args.preset, "dtype": str(dtype).removeprefix("torch."),
            "B": batch, "ctx": ctx, "num_splits": s, "auto_splits": s == auto, "ms": round(ms, 4),
            "kv_gib": round(kv_bytes / 2**30, 3), "gbps": round(kv_bytes / ms / 1e6, 1),
            "graph_copies": copies,
        }  # fmt: skip
        print(json.dumps(rec), flush=True)


PREFILL_CONFIGS = [
    (64, 64, 4, 2),
    (64, 64, 4, 3),
    (128, 64, 8, 2),
    (128, 64, 8, 3),
    (128, 128, 8, 2),
    (128, 32, 4, 3),
]


def time_prefill(args, batch: int, q_len: int, prefix: int, hq: int, hkv: int, d: int, dtype) -> None:
    from triton.testing import do_bench

    import rollout.kernels.paged_prefill as pp

    cache, tables, seq_lens = make_cache(batch, q_len + prefix, hkv, d, args.page, dtype)
    q = torch.randn(batch * q_len, hq, d, device="cuda", dtype=dtype)
    qsl = torch.arange(0, batch + 1, device="cuda", dtype=torch.int32) * q_len
    visible = batch * (q_len * prefix + q_len * (q_len + 1) / 2)  # causal (query, key) pairs
    default = pp.prefill_blocks
    for cfg in PREFILL_CONFIGS if args.sweep_prefill else [default(d, args.page)]:
        pp.prefill_blocks = lambda *_, cfg=cfg: cfg  # bench-only override of the tile choice
        try:
            fn = lambda: pp.paged_prefill_attention(q, cache, qsl, seq_lens, tables, d**-0.5, q_len)
            ms = do_bench(fn, warmup=10, rep=50, return_mode="median")
        finally:
            pp.prefill_blocks = default
        rec = {
            "bench": "prefill", "preset": args.preset, "dtype": str(dtype).removeprefix("torch."),
            "B": batch, "q_len": q_len, "prefix": prefix, "config": cfg, "ms": round(ms, 4),
            "tflops": round(4 * hq * d * visible / ms / 1e9, 1),
        }  # fmt: skip
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
    parser.add_argument("--sweep-prefill", action="store_true", help="time several prefill tile configs")
    parser.add_argument("--no-prefill", action="store_true")
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
    for batch in args.batches:
        for ctx in args.ctxs:
            time_decode(args, batch, ctx, hq, hkv, d, dtype)
            torch.cuda.empty_cache()
    if not args.no_prefill:  # (sequences, new tokens each, cached prefix each)
        for batch, q_len, prefix in [(1, 4096, 0), (4, 2048, 0), (8, 512, 4096), (1, 8192, 0)]:
            time_prefill(args, batch, q_len, prefix, hq, hkv, d, dtype)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
