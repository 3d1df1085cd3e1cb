"""What lengths a W2-style workload's decode steps see, without a GPU: scripts/bench.py's prompts (same seeded
lengths) through the engine's own scheduler and block manager (bench/membound_sim.py's ``simulate``, with the KV
the workload needs), and per decode step whether the live contexts are even (longest <= 2 x mean: the engine's
fixed-split path, ``rollout.engine.runners.graphs.even_lengths``) and its byte floor (live KV + weights at the
copy bandwidth). Prints the share of steps and of floor time that is even, and the floor time per batch-size
bucket: which decode path and batch sizes a kernel change must serve.

    python bench/w2_lengths.py                      # W2, max_num_seqs 256
    python bench/w2_lengths.py --workload W2-mem --max-num-seqs 512
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


def decode_steps(w: dict, params: list, max_num_seqs: int) -> list[list[int]]:
    """Each decode-only step's live contexts (the new token included), as the scheduler plans them with the KV
    the workload needs (no preemption)."""
    from bench.membound_sim import simulate

    bench = load_bench_script()
    bs = 16
    need = bench.kv_need_blocks(w["prompt_len"], params, bs)
    steps: list[list[int]] = []

    def record(plan) -> None:
        if all(len(s.input_ids) == 1 for s in plan.seqs):
            steps.append([s.seq_len for s in plan.seqs])

    rec = simulate(w, params, need, 0, bench.kv_block_bytes(w["preset"], "auto", bs), "auto", max_num_seqs,
                   on_step=record)
    assert rec["finished"] and rec["preemptions"] == 0, rec
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
    _, params = bench.make_prompts(w, bench.PRESETS[w["preset"]][1]["vocab_size"], "t1")
    rec = dict(workload=args.workload, max_num_seqs=args.max_num_seqs,
               **summarize(decode_steps(w, params, args.max_num_seqs)))
    print(json.dumps(rec))
    return rec


if __name__ == "__main__":
    main()
