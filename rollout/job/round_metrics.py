"""One round's metrics (metrics.jsonl, W&B): throughput, batch occupancy, the long tail, staleness
(the trace and the numbers the trainers share: ``rollout.rl.metrics``).

Time to first token, the prefix-cache hit rate and the floor ratio come from the engine's cumulative
counters (``EngineStats``); a pool's per-replica numbers (``PoolMeter``) go under ``pool/``.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

from rollout.job.trajectory import Trajectory
from rollout.rl.metrics import RoundTrace, partial_metrics, tail_batch_size

FINISH_REASONS = ("stop", "length", "abort")


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
