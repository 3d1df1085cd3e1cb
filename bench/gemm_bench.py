"""Decode linears on the GPU: cuBLAS (``torch.nn.functional.linear``) against rollout/kernels/skinny_gemm.py, per shape.

    python bench/gemm_bench.py --preset qwen2.5-1.5b --batches 8,32,128,256 --out $OUT/gemm.jsonl   # ~3 min, H200

For each of the preset's linears (fused qkv with its bias, o_proj, fused gate_up, down, lm_head) and each batch
M, one JSON line: microseconds per call for cuBLAS, for the kernel's own config choice (``choose_config``) and
for the best of a sweep of tiles and K splits, each against the weight bytes' floor at the measured copy
bandwidth. Calls are timed as the engine runs them: replayed in a CUDA graph, each reading its own copy of the
weights so that together they outgrow the L2. A summary line per batch adds the step's linears up (times the
layers), cuBLAS against the best.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ROTATE_BYTES = 512 * 2**20  # the weight copies one timing cycles through: well past the H200's 50 MB L2
SPLITS = (1, 2, 4, 8, 16)
BLOCK_NS = (32, 64, 128)


def linears(preset: str) -> list[tuple[str, int, int, bool, int]]:
    """(name, N, K, bias, calls per step) of one decode step's linears, from scripts/bench.py's preset config
    (qwen2 alone has a q/k/v bias)."""
    from bench.score_bench import load_bench_script

    family, c = load_bench_script().PRESETS[preset]
    h, hq, hkv, layers = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["num_hidden_layers"]
    d, inter = c.get("head_dim", h // hq), c["intermediate_size"]
    return [("qkv", (hq + 2 * hkv) * d, h, family == "qwen2", layers), ("o_proj", h, hq * d, False, layers),
            ("gate_up", 2 * inter, h, False, layers), ("down", h, inter, False, layers),
            ("lm_head", c["vocab_size"], h, False, 1)]  # fmt: skip


def sweep(m: int) -> list:
    """Configs to time beside the chosen one: every K split and weight-tile width at the rows' tile."""
    import triton

    from rollout.kernels.skinny_gemm import GemmConfig

    block_m = min(128, max(16, triton.next_power_of_2(m)))
    warps = 4 if block_m <= 64 else 8
    return [GemmConfig(block_m, bn, 64, s, warps) for bn in BLOCK_NS for s in SPLITS]


def time_shape(name: str, n: int, k: int, bias: bool, m: int, bw: float, do_sweep: bool) -> dict:
    from bench.kernels_bench import graph_ms
    from rollout.kernels.skinny_gemm import choose_config, skinny_linear

    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    w_bytes = n * k * 2
    copies = max(1, min(64, math.ceil(ROTATE_BYTES / w_bytes)))
    ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k**0.5 for _ in range(copies)]
    b = torch.randn(n, device=dev, dtype=torch.bfloat16) if bias else None
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    ref = torch.nn.functional.linear(x, ws[0], b)
    counters = torch.zeros(-(-m // 16) * -(-n // 16), dtype=torch.int32, device=dev)  # every tile of any config

    def us(fn) -> float:
        return graph_ms([lambda w=w: fn(w) for w in ws]) * 1e3

    cublas = us(lambda w: torch.nn.functional.linear(x, w, b))
    # cuBLAS on the transposed problem, out^T [N, M] = W @ x^T: cuBLAS sees other dimensions and may pick other
    # tiles (at M=32, W1's qkv and o_proj ran at ~0.77 of their floor in its step profile, h100_2026-12-07f);
    # alone, and with the copy back to the [M, N] the next kernel reads (bias-free shapes only)
    swapped = us(lambda w: torch.mm(w, x.t())) if b is None else None
    swapped_copy = us(lambda w: torch.mm(w, x.t()).t().contiguous()) if b is None else None
    chosen = choose_config(m, n, k, sms)
    err = (skinny_linear(x, ws[0], b, chosen, sms, counters).float() - ref.float()).abs().max().item()
    ours = us(lambda w: skinny_linear(x, w, b, chosen, sms, counters))
    best, best_cfg = ours, chosen
    extra = [dataclasses.replace(chosen, fused=False)] if chosen.split_k > 1 else []
    for cfg in (sweep(m) + extra) if do_sweep else []:
        if cfg == chosen:
            continue
        t = us(lambda w, c=cfg: skinny_linear(x, w, b, c, sms, counters))
        if t < best:
            best, best_cfg = t, cfg
    floor = w_bytes / (bw * 1e12) * 1e6
    ws.clear()
    torch.cuda.empty_cache()
    return dict(bench="gemm", shape=name, M=m, N=n, K=k, bias=bias, cublas_us=round(cublas, 2),
                cublas_swapped_us=swapped and round(swapped, 2),
                cublas_swapped_copy_us=swapped_copy and round(swapped_copy, 2),
                ours_us=round(ours, 2), best_us=round(best, 2), best_config=dataclasses.asdict(best_cfg),
                chosen_config=dataclasses.asdict(chosen), floor_us=round(floor, 2),
                cublas_floor_ratio=round(floor / cublas, 3), best_floor_ratio=round(floor / best, 3),
                best_vs_cublas=round(cublas / best, 3), max_abs_err=err)  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", choices=("qwen2.5-1.5b", "qwen3-0.6b", "llama3-8b"), default="qwen2.5-1.5b")
    p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[8, 32, 128, 256])
    p.add_argument("--shapes", default=None, help="comma list of qkv, o_proj, gate_up, down, lm_head (default all)")
    p.add_argument("--no-sweep", action="store_true", help="time only cuBLAS and the chosen config")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("gemm_bench.py needs a CUDA GPU")
    from bench.score_bench import load_bench_script

    bw = load_bench_script().copy_bandwidth_tbps()
    shapes = linears(args.preset)
    if args.shapes:
        want = set(args.shapes.split(","))
        unknown = want - {s[0] for s in shapes}
        if unknown:
            p.error(f"unknown --shapes {sorted(unknown)}; allowed: {[s[0] for s in shapes]}")
        shapes = [s for s in shapes if s[0] in want]
    recs = []
    for m in args.batches:
        step = dict(cublas=0.0, best=0.0, floor=0.0)
        for name, n, k, bias, calls in shapes:
            rec = dict(time_shape(name, n, k, bias, m, bw, not args.no_sweep), preset=args.preset, calls=calls)
            recs.append(rec)
            print(json.dumps(rec), flush=True)
            step["cublas"] += rec["cublas_us"] * calls
            step["best"] += min(rec["best_us"], rec["cublas_us"]) * calls
            step["floor"] += rec["floor_us"] * calls
        recs.append(dict(bench="gemm_step", preset=args.preset, M=m, copy_bw_tbps=round(bw, 3),
                         **{f"{k}_ms": round(v / 1e3, 3) for k, v in step.items()},
                         saving_ms=round((step["cublas"] - step["best"]) / 1e3, 3)))  # fmt: skip
        print(json.dumps(recs[-1]), flush=True)
    if args.out:
        with open(args.out, "a") as f:
            for r in recs:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
