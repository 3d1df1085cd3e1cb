"""What the job and the trainers measure alike: a round's (or a call's) trace, its partial-rollout numbers and a
pool's per-replica ones.

The tail batch size is the mean batch over the steps in the last 10% of the round's time: in drain mode
it shows how far the batch shrinks while the round waits for its longest samples; partial mode keeps it
near the full batch.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

TAIL_FRACTION = 0.1


@dataclass(slots=True)
class RoundTrace:
    """What the actor records while a round runs."""

    t0: float
    steps: list[tuple[float, int]] = field(default_factory=list)  # (time after the step, its batch size)
    kv: list[float] = field(default_factory=list)  # KV usage after each step
    staleness: list[int] = field(default_factory=list)  # per group handed out
    dropped_groups: int = 0
    regenerated_groups: int = 0
    carried_over_groups: int = 0  # not handed out at the round's end: they continue into the next round
    carried_over_tokens: int = 0  # the tokens those groups already hold
    first_tokens: int = 0  # the engine's num_first_tokens when last observed
    ttft: list[float] = field(default_factory=list)  # seconds from submission to first token, per request


def tail_batch_size(steps: Sequence[tuple[float, int]], t0: float, t1: float) -> float:
    """Mean batch size of the steps that ended in the last 10% of [t0, t1] (the last step if none did)."""
    if not steps:
        return 0.0
    cut = t1 - TAIL_FRACTION * (t1 - t0)
    tail = [b for t, b in steps if t >= cut] or [steps[-1][1]]
    return sum(tail) / len(tail)


def partial_metrics(trace: RoundTrace) -> dict[str, Any]:
    """Staleness of the groups handed out (mean, max, histogram), groups dropped or regenerated for it, and
    the groups (and their tokens) carried over. ``trainer_hooks`` logs the same numbers under ``rollout/``."""
    return {
        "staleness_mean": sum(trace.staleness) / len(trace.staleness) if trace.staleness else 0.0,
        "staleness_max": max(trace.staleness, default=0),
        "staleness_hist": {str(k): v for k, v in sorted(Counter(trace.staleness).items())},
        "dropped_groups": trace.dropped_groups,
        "regenerated_groups": trace.regenerated_groups,
        "carried_over_groups": trace.carried_over_groups,
        "carried_over_tokens": trace.carried_over_tokens,
    }


class PoolMeter:
    """Per-replica metrics of a ``RolloutPool`` each round, as ``pool/replica_<i>/<name>`` (and the pooled
    ones as ``pool/<name>``). ``round_tokens_per_s``: the replica's tokens generated since the previous
    round over this round's wall time (a replacement's counters start again from 0)."""

    def __init__(self) -> None:
        self._generated: dict[int, int] = {}

    def metrics(self, stats: dict[str, Any], round_time_s: float) -> dict[str, Any]:
        pooled = stats.get("pool", {})
        m: dict[str, Any] = {f"pool/{k}": pooled[k] for k in ("alive", "failures", "tokens_per_s") if k in pooled}
        for rep in stats.get("replicas", []):
            i = rep.get("index")
            prefix = f"pool/replica_{i}/"
            m[prefix + "alive"] = int(rep.get("alive", True))
            if not rep.get("alive", True):
                continue
            generated = int(rep.get("num_generated_tokens", 0))
            previous = self._generated.get(i, 0)
            delta = generated - previous if generated >= previous else generated
            self._generated[i] = generated
            m[prefix + "round_tokens_per_s"] = delta / max(round_time_s, 1e-9)
            for key in ("tokens_per_s", "kv_cache_usage", "gpu_busy_frac", "num_generated_tokens",
                        "num_preemptions"):
                if rep.get(key) is not None:
                    m[prefix + key] = rep[key]
        return m
