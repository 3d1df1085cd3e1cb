"""Summarize ``kernels_bench.py --lengths even --compare-even``: per cache dtype and batch, each variant's ms and
its ratio to the fastest fixed split count, so the even split's rule (paged_decode.choose_num_splits) is picked
from one run.

    python bench/even_rule.py bench/results/<run>_kernels_even_split.jsonl
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict


def load(path: str) -> list[dict]:
    recs = []
    for line in open(path):
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("bench") == "decode":
            recs.append(rec)
    return recs


def summarize(recs: list[dict]) -> list[dict]:
    """One row per (kv, B, ctx): the fastest fixed count and every variant's ms / that count's ms."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for rec in recs:
        groups[(rec["kv"], rec["B"], rec["ctx"])].append(rec)
    rows = []
    for (kv, batch, ctx), group in sorted(groups.items()):
        fixed = [r for r in group if r["variant"] == "fixed"]
        if not fixed:
            continue
        best = min(fixed, key=lambda r: r["ms"])
        ratios = {}
        for r in group:
            name = r["variant"] if r["variant"] != "fixed" else f"fixed{r['num_splits']}"
            if r["variant"] != "fixed" and r.get("num_splits"):
                name += f"({r['num_splits']})"
            ratios[name] = round(r["ms"] / best["ms"], 3)
        rows.append(dict(kv=kv, B=batch, ctx=ctx, best_splits=best["num_splits"], best_ms=best["ms"], vs_best=ratios))
    return rows


def main(argv: list[str]) -> None:
    if len(argv) != 1:
        raise SystemExit(__doc__)
    for row in summarize(load(argv[0])):
        print(json.dumps(row))


if __name__ == "__main__":
    main(sys.argv[1:])
