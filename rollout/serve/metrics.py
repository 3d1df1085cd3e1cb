"""``GET /metrics`` in the Prometheus text format (written by hand: no client library needed).

Every counter is there twice: under its ``rollout_`` name and, for dashboards built for vLLM, under vLLM's
``vllm:`` name with vLLM's ``model_name`` label (sequences stand in for vLLM's requests: a group of n
samples is n sequences here).
"""

from __future__ import annotations

import time
from typing import Any

# (name, type, help, value getter over (stats, server state, tokens/s))
_METRICS: list[tuple[str, str, str, Any]] = [
    ("rollout_generation_tokens_per_second", "gauge", "Generated tokens per second over the last ~10 s.",
     lambda s, st, rate: rate),
    ("rollout_generation_tokens_total", "counter", "Tokens generated since start.",
     lambda s, st, rate: s.num_generated_tokens),
    ("rollout_prompt_tokens_total", "counter", "Prompt tokens computed (prefill) since start.",
     lambda s, st, rate: s.num_prompt_tokens),
    ("rollout_prefix_cache_queried_tokens_total", "counter",
     "Prompt tokens of the requests started since start (the prefix cache's hit-rate denominator).",
     lambda s, st, rate: s.num_started_prompt_tokens),
    ("rollout_prefix_cache_hit_tokens_total", "counter",
     "Of those, tokens found in the prefix cache (not computed): a multi-turn agent's earlier turns.",
     lambda s, st, rate: s.num_prefix_cached_tokens),
    ("rollout_running_seqs", "gauge", "Sequences running (holding KV blocks).",
     lambda s, st, rate: s.num_running_seqs),
    ("rollout_waiting_seqs", "gauge", "Sequences waiting to be scheduled.",
     lambda s, st, rate: s.num_waiting_seqs),
    ("rollout_kv_cache_usage_ratio", "gauge", "Fraction of KV-cache blocks in use (0..1).",
     lambda s, st, rate: s.kv_cache_usage),
    ("rollout_preemptions_total", "counter", "Sequences preempted (KV freed, recomputed later).",
     lambda s, st, rate: s.num_preemptions),
    ("rollout_engine_steps_total", "counter", "Engine steps run.", lambda s, st, rate: s.num_steps),
    ("rollout_policy_version", "gauge", "Version of the weights now serving.",
     lambda s, st, rate: s.policy_version),
    ("rollout_weight_updates_total", "counter", "Weight updates applied through this server.",
     lambda s, st, rate: st.counters["weight_updates"]),
    ("rollout_weight_update_last_seconds", "gauge", "Wall time of the last weight update (receive + apply).",
     lambda s, st, rate: st.counters["last_update_s"]),
    ("rollout_gpu_busy_ratio", "gauge", "Compute-stream busy time over wall time (GPU only).",
     lambda s, st, rate: s.gpu_busy_frac),
    ("rollout_gpu_compute_seconds_total", "counter",
     "Compute-stream time of the engine's steps (GPU only): its delta over a window's wall is that window's busy.",
     lambda s, st, rate: s.gpu_compute_s),
    ("rollout_paused", "gauge", "1 while generation is paused.", lambda s, st, rate: int(st.loop.paused)),
    ("rollout_sleeping", "gauge", "1 while the KV cache is released (sleep).",
     lambda s, st, rate: int(st.engine.is_sleeping)),
    ("rollout_weight_staging_bytes", "gauge", "Bytes kept for receiving pushes (a model's worth; none while asleep).",
     lambda s, st, rate: st.receiver.staging_bytes),
    ("rollout_http_requests_in_flight", "gauge", "Generation requests waiting on the engine.",
     lambda s, st, rate: st.loop.num_pending()),
]


# vLLM's name -> ours (the same number)
VLLM_NAMES = {
    "vllm:num_requests_running": "rollout_running_seqs",
    "vllm:num_requests_waiting": "rollout_waiting_seqs",
    "vllm:kv_cache_usage_perc": "rollout_kv_cache_usage_ratio",
    "vllm:gpu_cache_usage_perc": "rollout_kv_cache_usage_ratio",  # vLLM's name before 0.10
    "vllm:prompt_tokens_total": "rollout_prompt_tokens_total",
    "vllm:generation_tokens_total": "rollout_generation_tokens_total",
    "vllm:num_preemptions_total": "rollout_preemptions_total",
    "vllm:avg_generation_throughput_toks_per_s": "rollout_generation_tokens_per_second",
}


def render(stats: Any, st: Any) -> str:
    rate = st.loop.rate.rate(time.monotonic(), stats.num_generated_tokens)
    lines, values = [], {}
    for name, kind, help_text, get in _METRICS:
        value = get(stats, st, rate)
        if value is None:
            continue
        values[name] = (kind, help_text, value)
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {float(value):.6g}"]
    escaped = st.model_name.replace("\\", "\\\\").replace('"', '\\"')
    label = f'{{model_name="{escaped}"}}'
    for name, ours in VLLM_NAMES.items():
        if ours in values:
            kind, help_text, value = values[ours]
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name}{label} {float(value):.6g}"]
    return "\n".join(lines) + "\n"
