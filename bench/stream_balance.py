"""How evenly the stream split's runs share a step's work, per STREAM_SEGS, on the CPU (no GPU, no kernel).

With ``STREAM_SEGS`` the plan pads each sequence's share of the run space to ``vmin`` tiles so no run touches more
than SEGS sequences (rollout/kernels/paged_decode_stream.py). Padding holds no work, so a run over it does less,
and the step waits for the program with the most: this prints, per length profile and SEGS, vmin, the run space
over the live tiles, and the most live tiles a program gets over the mean (1.0: perfect balance).

    python bench/stream_balance.py                 # W2's and W1's decode shapes, SEGS 0 (the loop), 4, 6, 8
    python bench/stream_balance.py --segs 6,8,12 --sms 132 --per-sm 4
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def stream_vmin(total: int, batch: int, programs: int, segs: int, min_chunk: int) -> int:
    """_stream_plan_kernel's vmin (0 where stream_segs takes the loop)."""
    from rollout.kernels.paged_decode_stream import stream_segs

    if stream_segs(segs, programs, batch) == 0:
        return 0
    room = programs * (segs - 2) - batch
    return max(-(-(total - programs) // room) if total > programs else 0, -(-(min_chunk - 2) // (segs - 2)), 1)


def balance(lens: list[int], programs: int, segs: int, block_n: int = 64, min_chunk: int = 2) -> dict:
    """vmin, run space / live tiles, and the most live tiles of one program over the mean, for one kv head."""
    tiles = [-(-n // block_n) for n in lens]
    total = sum(tiles)
    vmin = stream_vmin(total, len(lens), programs, segs, min_chunk)
    space = sum(max(t, vmin) for t in tiles)
    run = max(-(-space // programs), min_chunk)
    work = [0] * programs
    start = 0
    for t in tiles:
        p = start // run
        while t and p < programs and p * run < start + t:
            work[p] += min(start + t, (p + 1) * run) - max(start, p * run)
            p += 1
        start += max(t, vmin)
    return {"vmin": vmin, "live_tiles": total, "run_space": space, "space_over_live": round(space / max(total, 1), 3),
            "max_over_mean": round(max(work) / (total / programs), 3) if total else None}


def profiles() -> list[tuple[str, list[int], int, int]]:
    """(name, lengths, kv heads, resident programs an SM): W2's decode shapes (qwen2.5-1.5b, 2 kv heads; fp8 6 an SM,
    bf16's unrolled stream kernel 4) and W1's (llama3-8b, 8 kv heads)."""
    from kernels_bench import even_lens, long_tail_lens

    return [
        ("W2 even 256 x [1K, 3K] fp8", even_lens(256, 3072, 256), 2, 6),
        ("W2 long tail 256 x 16K fp8", long_tail_lens(256, 16384, 256), 2, 6),
        ("W2 long tail 128 x 16K fp8", long_tail_lens(128, 16384, 128), 2, 6),
        ("W2 even 256 x [1K, 3K] bf16", even_lens(256, 3072, 256), 2, 4),
        ("W2 long tail 256 x 16K bf16", long_tail_lens(256, 16384, 256), 2, 4),
        ("W1 32 x 4K bf16", [4096] * 32, 8, 4),
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--segs", default="0,4,6,8", help="comma list of STREAM_SEGS values (0: the loop)")
    p.add_argument("--sms", type=int, default=132, help="SMs (an H100's or H200's 132)")
    p.add_argument("--per-sm", type=int, default=None, help="resident programs an SM (default: the profile's)")
    args = p.parse_args()
    segs = [int(s) for s in args.segs.split(",")]
    for name, lens, hkv, per_sm in profiles():
        programs = (args.per_sm or per_sm) * args.sms // hkv
        for s in segs:
            print(json.dumps({"profile": name, "programs": programs, "segs": s, **balance(lens, programs, s)}))


if __name__ == "__main__":
    main()
