"""What lengths a W2-style workload's decode steps see, without a GPU: the FIFO schedule of scripts/bench.py's
prompts (same seeded lengths), one token per running sequence per step, and per step whether the live contexts are
even (longest <= 2 x mean: the engine's fixed-split path, ``rollout.engine.runners.graphs.even_lengths``) and its
byte floor (live KV + weights at the copy bandwidth). Prints the share of steps and of floor time that is even,
and the floor time per batch-size bucket: which decode path and batch sizes a kernel change must serve.

    python bench/w2_lengths.py                      # W2, max_num_seqs 256
    python bench/w2_lengths.py --workload W2-mem --max-num-seqs 256
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.score_bench import load_bench_script  # noqa: E402
from rollout.engine.runners.graphs import even_lengths  # noqa: E402

# qwen2.5-1.5b: K and V of 28 layers x 2 kv heads x 128 dims, bf16 (28,672 bytes a token); 3.1 GB of weights
TOKEN_BYTES = 28 * 2 * 2 * 128 * 2
WEIGHT_BYTES = 3.1e9
COPY_BW = 4.27e12  # H200, measured by scripts/bench.py


def schedule(max_tokens: list[int], prompt_len: int, max_num_seqs: int) -> list[list[int]]:
    """Each decode step's live contexts (prompt + generated + the new token), FIFO admission, no preemption."""
    waiting = collections.deque(range(len(max_tokens)))
    running: dict[int, int] = {}
    steps = []
    while waiting or running:
        while waiting and len(running) < max_num_seqs:
            running[waiting.popleft()] = 0
        steps.append([prompt_len + g + 1 for g in running.values()])
        for i in list(running):
            running[i] += 1
            if running[i] >= max_tokens[i]:
                del running[i]
    return steps


def summarize(steps: list[list[int]], bucket: int = 32) -> dict:
    floor = [(sum(c) * TOKEN_BYTES + WEIGHT_BYTES) / COPY_BW * 1e3 for c in steps]
    even = [even_lengths(c) for c in steps]
    by_batch: dict[int, float] = collections.Counter()
    for c, ms in zip(steps, floor):
        by_batch[len(c) // bucket * bucket] += ms
    total = sum(floor)
    return dict(steps=len(steps), even_steps=sum(even), even_floor_share=round(sum(f for f, e in zip(floor, even)
                                                                                    if e) / total, 4),
                mean_batch=round(sum(map(len, steps)) / len(steps), 1), floor_s=round(total / 1e3, 2),
                floor_share_by_batch={k: round(v / total, 3) for k, v in sorted(by_batch.items())})


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workload", default="W2")
    p.add_argument("--max-num-seqs", type=int, default=256)
    args = p.parse_args(argv)
    bench = load_bench_script()
    w = bench.WORKLOADS.get(args.workload)
    if w is None or "n" not in w:
        p.error(f"--workload must be one with sampled lengths (n per prompt), got {args.workload!r}")
    _, params = bench.make_prompts(w, 151936, "t1")
    max_tokens = [sp.max_tokens for sp in params for _ in range(sp.n)]
    rec = dict(workload=args.workload, max_num_seqs=args.max_num_seqs,
               **summarize(schedule(max_tokens, w["prompt_len"], args.max_num_seqs)))
    print(json.dumps(rec))
    return rec


if __name__ == "__main__":
    main()
