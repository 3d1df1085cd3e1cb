"""One decode-attention call per cache kind at a W2 shape, for Nsight Compute to read.

The H200's machine runs Firecracker, where ``ncu`` reads the hardware counters: this builds the same inputs as
``bench/kernels_bench.py`` (qwen2.5-1.5b heads, B=256, long-tail contexts to 16K, scattered pages), warms the
kernel up, then makes ``--calls`` more calls for the profiler to pick one of:

    ncu --clock-control none --kernel-name regex:_decode_split_kernel --launch-skip 2 --launch-count 1 \
        --set full -o $OUT/fp8 python3 bench/ncu_decode.py --kv fp8
    ncu -i $OUT/fp8.ncu-rep --page source --print-source sass --csv > $OUT/fp8_sass.csv   # stalls per instruction
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.kernels_bench import PRESETS, long_tail_lens, make_cache  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--kv", choices=["bf16", "fp8"], default="fp8")
    p.add_argument("--preset", choices=list(PRESETS), default="qwen2.5-1.5b")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--ctx", type=int, default=16384)
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--swap-ab", type=int, choices=[0, 1], default=None)
    p.add_argument("--config", default=None, help="BLOCK_N,num_warps,num_stages[,maxnreg]: the tile to launch")
    args = p.parse_args()
    import rollout.kernels.paged_decode as pd

    hq, hkv, d = PRESETS[args.preset]
    lens = long_tail_lens(args.batch, args.ctx, seed=args.batch)
    cache, tables, seq_lens, scales = make_cache(args.batch, args.ctx, hkv, d, 16, torch.bfloat16, lens=lens,
                                                 kv=args.kv)  # fmt: skip
    q = torch.randn(args.batch, hq, d, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    if args.config:
        cfg = tuple(int(x) for x in args.config.split(","))
        pd.decode_config = lambda *_: cfg if len(cfg) == 4 else (*cfg, None)
    kw = {} if args.swap_ab is None else {"swap_ab": bool(args.swap_ab)}
    for _ in range(2 + args.calls):
        pd.paged_decode_attention(q, cache, tables, seq_lens, d**-0.5, out=out, kv_scales=scales, **kw)
    torch.cuda.synchronize()
    print(f"kv={args.kv} B={args.batch} mean_ctx={sum(lens) / len(lens):.0f} out_norm={out.float().norm():.3f}")


if __name__ == "__main__":
    main()
