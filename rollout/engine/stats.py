"""What the engine counts: a snapshot type for users and the small object that keeps the counters."""

from __future__ import annotations

import time
from dataclasses import dataclass

from rollout.engine.plan import BatchPlan


@dataclass(slots=True)
class EngineStats:
    num_running_seqs: int
    num_waiting_seqs: int
    kv_cache_usage: float
    num_steps: int
    num_preemptions: int
    num_generated_tokens: int
    num_prompt_tokens: int
    num_scheduled_seqs: int
    gpu_busy_frac: float | None  # compute-stream time / wall time, first to latest step (None on CPU)
    policy_version: int
    gpu_compute_s: float | None = None  # cumulative compute-stream time: a window's busy = delta / its wall
    bytes_read: int = 0  # cumulative bytes the steps had to read (weights + live KV): the byte floor's numerator
    kv_cache_bytes: int = 0  # memory the KV cache holds now (0 while asleep)
    kv_cache_tokens: int = 0  # KV capacity in tokens
    num_failed_steps: int = 0  # steps that raised and were rolled back
    kv_cache_usage_sum: float = 0.0  # kv_cache_usage summed over steps: a window's mean = delta / delta num_steps
    num_first_tokens: int = 0  # requests whose first sampled token has landed (time to first token: observe deltas)
    num_started_prompt_tokens: int = 0  # the prompt tokens of those requests
    num_prefix_cached_tokens: int = 0  # of which found in the prefix cache: a window's hit rate = delta / delta above
    num_swap_outs: int = 0  # preemptions that swapped the sequence's KV to the host pool (swap_space_gib)
    num_swapped_out_blocks: int = 0  # KV blocks copied to the host pool
    swapped_out_bytes: int = 0  # their bytes
    num_swap_ins: int = 0  # swapped sequences resumed without recompute
    num_prefill_tokens: int = 0  # tokens computed that were not the newest sample: prompt, environment, recompute
    pool: dict | None = None  # a RolloutPool's per-replica numbers (RolloutPool.stats()); None for one engine


@dataclass(slots=True)
class StepCounters:
    """Per-step counters of the engine loop (the scheduler counts preemptions and generated tokens)."""

    weight_bytes: int  # what every step reads of the weights
    kv_token_bytes: int  # what attention reads per context token
    steps: int = 0
    scheduled: int = 0
    prompt: int = 0
    bytes: int = 0
    failed: int = 0
    kv_usage: float = 0.0  # block usage summed over launched steps
    t_first: float | None = None
    t_last: float = 0.0

    def on_launch(self, plan: BatchPlan, kv_usage: float = 0.0) -> None:
        if self.t_first is None:
            self.t_first = time.perf_counter()
        self.steps += 1
        self.kv_usage += kv_usage
        self.scheduled += len(plan.seqs)
        self.prompt += plan.num_prompt_tokens
        self.bytes += self.weight_bytes + plan.num_context_tokens * self.kv_token_bytes

    def on_step_end(self) -> None:
        self.t_last = time.perf_counter()

    def busy_frac(self, compute_s: float | None) -> float | None:
        if not compute_s or self.t_first is None or self.t_last <= self.t_first:
            return None
        return min(1.0, compute_s / (self.t_last - self.t_first))
