"""One round's metrics (metrics.jsonl, W&B): throughput, batch occupancy, the long tail, staleness.

The tail batch size is the mean batch over the steps in the last 10% of the round's time: in drain mode
it shows how far the batch shrinks while the round waits for its longest samples; partial mode keeps it
near the full batch.

Time to first token, the prefix-cache hit rate and the floor ratio come from the engine's cumulative
counters (``EngineStats``); a pool's per-replica numbers (``PoolMeter``) go under ``pool/``.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rollout.job.trajectory import Trajectory

FINISH_REASONS = ("stop", "length", "abort")
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


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in (0, 100]); None when there are no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def engine_window_metrics(before: Any, after: Any, copy_bandwidth: float | None) -> dict[str, float | None]:
    """Prefix-cache hit rate (prompt tokens of the requests started in the window that the prefix cache
    held / their prompt tokens) and the floor ratio (the window's bytes read at ``copy_bandwidth``
    bytes/s / its compute-stream seconds; None without a bandwidth, i.e. off CUDA)."""
    started = after.num_started_prompt_tokens - before.num_started_prompt_tokens
    cached = after.num_prefix_cached_tokens - before.num_prefix_cached_tokens
    floor = None
    if copy_bandwidth and after.gpu_compute_s is not None and before.gpu_compute_s is not None:
        compute = after.gpu_compute_s - before.gpu_compute_s
        if compute > 0:
            floor = (after.bytes_read - before.bytes_read) / copy_bandwidth / compute
    return {"prefix_cache_hit_rate": cached / started if started > 0 else None, "floor_ratio": floor}


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


def round_metrics(
    r: int, trajs: Sequence[Trajectory], before: Any, after: Any, trace: RoundTrace, t1: float, partial: bool,
    copy_bandwidth: float | None = None,
) -> dict[str, Any]:
    """``generated_tokens``: drain, the round's completions; partial, what the engine generated in the
    round (carried-over tokens counted once, in the round that made them). ``completion_tokens`` is the
    handed-out rows' total in both modes."""
    elapsed = max(t1 - trace.t0, 1e-9)
    lengths = [len(t.completion_ids) for t in trajs]
    generated = after.num_generated_tokens - before.num_generated_tokens if partial else sum(lengths)
    steps = after.num_steps - before.num_steps
    prompt_tokens = after.num_prompt_tokens - before.num_prompt_tokens
    reasons = Counter(t.finish_reason for t in trajs)
    busy = None
    if after.gpu_compute_s is not None and before.gpu_compute_s is not None:
        busy = min(1.0, (after.gpu_compute_s - before.gpu_compute_s) / elapsed)
    m: dict[str, Any] = {
        "round": r,
        "num_prompts": len({t.group_id for t in trajs}),
        "num_samples": len(trajs),
        "round_time_s": elapsed,
        "generated_tokens": generated,
        "completion_tokens": sum(lengths),
        "prompt_tokens": prompt_tokens,
        "generated_tokens_per_s": generated / elapsed,
        "prompt_tokens_per_s": prompt_tokens / elapsed,
        "num_steps": steps,
        "mean_batch_size": (after.num_scheduled_seqs - before.num_scheduled_seqs) / max(steps, 1),
        "tail_batch_size": tail_batch_size(trace.steps, trace.t0, t1),
        "kv_cache_usage_mean": sum(trace.kv) / len(trace.kv) if trace.kv else 0.0,
        "kv_cache_usage_peak": max(trace.kv, default=0.0),
        "num_preemptions": after.num_preemptions - before.num_preemptions,
        "gpu_busy_frac": busy,
        "completion_len_mean": sum(lengths) / len(lengths) if lengths else 0.0,
        "completion_len_max": max(lengths, default=0),
        "policy_version": after.policy_version,
        **partial_metrics(trace),
        "ttft_requests": len(trace.ttft),
        "ttft_mean_s": sum(trace.ttft) / len(trace.ttft) if trace.ttft else None,
        "ttft_p90_s": percentile(trace.ttft, 90),
        **engine_window_metrics(before, after, copy_bandwidth),
    }
    for reason in sorted(set(FINISH_REASONS) | set(reasons)):
        m[f"finish_{reason}"] = reasons.get(reason, 0)
    rewards = [t.reward for t in trajs if t.reward is not None]
    if rewards:
        mean = sum(rewards) / len(rewards)
        m["reward_mean"] = mean
        m["reward_std"] = math.sqrt(sum((x - mean) ** 2 for x in rewards) / len(rewards))
    return m


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
