"""The engine's side of a training run, as ``rollout/*`` metrics for the trainer's W&B run.

One vocabulary for the three trainers (GRPO through ``TRLRollout``, async GRPO through the engine worker,
PPO): every number is a difference of the engine's cumulative counters (``Engine.get_stats``) over a window,
so windows never overlap and nothing in the engine is reset.

- ``rollout/generation_s``, ``rollout/tokens_per_s``, ``rollout/generated_tokens``, ``rollout/engine_steps``
- ``rollout/kv_cache_usage_mean`` (mean over the window's steps), ``rollout/preemptions``
- ``rollout/weight_push_s``, ``rollout/policy_version``, ``rollout/policy_lag_mean`` / ``_max`` (trainer
  version minus the oldest version among a completion's tokens)
- ``rollout/logprob_gap_mean`` / ``_max``: |trainer logprob - engine logprob| per completion token
- partial rollouts, named as the main job's round metrics (``rollout.rl.metrics.partial_metrics``):
  ``rollout/staleness_mean`` / ``_max`` (of the groups handed out), ``rollout/dropped_groups``,
  ``rollout/regenerated_groups``, ``rollout/carried_over_groups`` / ``_tokens`` (still running at the end of
  the call, or at a weight push for the async worker), ``rollout/tail_batch_size``
- a ``RolloutPool``'s per-replica numbers, named as the rollout job names them (``PoolMeter``) under
  ``rollout/``: ``rollout/pool/replica_<i>/{round_tokens_per_s,tokens_per_s,kv_cache_usage,alive,...}``
  (``round_tokens_per_s`` over the window) and ``rollout/pool/{alive,failures,tokens_per_s}``
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from rollout.rl.metrics import PoolMeter, RoundTrace, partial_metrics, tail_batch_size


class EngineWindow:
    """Counters of one engine (or pool) between ``start`` (construction) and ``close``."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.before = engine.get_stats()
        self.replicas = PoolMeter()
        if self.before.pool is not None:
            self.replicas.metrics(self.before.pool, 1.0)  # each replica's counters at the window's start
        self.t0 = time.perf_counter()

    def close(self) -> dict[str, float]:
        after = self.engine.get_stats()
        seconds = time.perf_counter() - self.t0
        steps = after.num_steps - self.before.num_steps
        tokens = after.num_generated_tokens - self.before.num_generated_tokens
        kv = after.kv_cache_usage_sum - self.before.kv_cache_usage_sum
        per_replica = {} if after.pool is None else self.replicas.metrics(after.pool, seconds)
        return {
            **{f"rollout/{k}": float(v) for k, v in per_replica.items()},
            "rollout/generation_s": seconds,
            "rollout/generated_tokens": float(tokens),
            "rollout/tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
            "rollout/engine_steps": float(steps),
            "rollout/kv_cache_usage_mean": kv / steps if steps else 0.0,
            "rollout/preemptions": float(after.num_preemptions - self.before.num_preemptions),
            "rollout/policy_version": float(after.policy_version),
        }


def policy_lag(current_version: int, completions_versions: Iterable[Sequence[int]]) -> dict[str, float]:
    """Lag of each completion: ``current_version`` minus the oldest weights that produced one of its tokens."""
    lags = [current_version - min(v) for v in completions_versions if len(v)]
    if not lags:
        return {}
    return {"rollout/policy_lag_mean": sum(lags) / len(lags), "rollout/policy_lag_max": float(max(lags))}


def partial_rollout_metrics(trace: RoundTrace, t1: float) -> dict[str, float]:
    """The job's partial-rollout numbers for one call (``trace`` from its start to ``t1``), as ``rollout/*``."""
    m = {f"rollout/{k}": float(v) for k, v in partial_metrics(trace).items() if k != "staleness_hist"}
    m["rollout/tail_batch_size"] = tail_batch_size(trace.steps, trace.t0, t1)
    return m


def reports_to_wandb(report_to: Any) -> bool:
    names = [report_to] if isinstance(report_to, str) else list(report_to or [])
    return "wandb" in names or "all" in names


def add_to_wandb_config(config: Mapping[str, Any]) -> bool:
    """Merge ``config`` into the active W&B run's config; False when there is no run (or no wandb)."""
    try:
        import wandb
    except ImportError:
        return False
    if wandb.run is None:
        return False
    wandb.run.config.update(dict(config), allow_val_change=True)
    return True


class StepTimes:
    """Wall time of each training step split into generation / weight push / the rest (training), saved as
    JSON so a run's time budget can be read without W&B."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.steps: list[dict[str, float]] = []

    def add(self, step: int, total_s: float, generation_s: float, weight_push_s: float) -> dict[str, float]:
        row = {"step": step, "total_s": total_s, "generation_s": generation_s, "weight_push_s": weight_push_s,
               "train_s": max(0.0, total_s - generation_s - weight_push_s)}
        self.steps.append(row)
        self.save()
        return row

    def summary(self) -> dict[str, float]:
        if not self.steps:
            return {}
        keys = ("total_s", "generation_s", "weight_push_s", "train_s")
        return {f"mean_{k}": sum(r[k] for r in self.steps) / len(self.steps) for k in keys}

    def save(self, extra: Mapping[str, Any] | None = None) -> None:
        payload = {"steps": self.steps, "summary": self.summary(), **(extra or {})}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(payload, indent=1))
