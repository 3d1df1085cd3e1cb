"""One stats line every few seconds while the server is busy (what vLLM's "Avg prompt throughput" line tells):
generated and prompt tokens/s over the interval, running / waiting sequences, KV use, the policy version.
Quiet while idle, so an idle server's log stays empty."""

from __future__ import annotations

import asyncio
import time
from typing import Any


def stats_line(prev: tuple[float, int, int], now: float, stats: Any) -> str:
    t0, gen0, prompt0 = prev
    dt = max(now - t0, 1e-9)
    return (f"rollout server: generation {(stats.num_generated_tokens - gen0) / dt:.1f} tok/s, prompt "
            f"{(stats.num_prompt_tokens - prompt0) / dt:.1f} tok/s, running {stats.num_running_seqs} seqs, "
            f"waiting {stats.num_waiting_seqs}, KV cache {100 * stats.kv_cache_usage:.1f}%, "
            f"policy version {stats.policy_version}")


async def log_stats(st: Any, every_s: float, emit: Any = None) -> None:
    """Until cancelled: every ``every_s`` seconds, one line if anything ran or is queued since the last."""
    emit = emit or (lambda line: print(line, flush=True))
    stats = await st.run(st.engine.get_stats)
    prev = (time.monotonic(), stats.num_generated_tokens, stats.num_prompt_tokens)
    while True:
        await asyncio.sleep(every_s)
        try:
            stats = await st.run(st.engine.get_stats)
        except RuntimeError:  # the engine loop is closing
            return
        now = time.monotonic()
        busy = stats.num_running_seqs or stats.num_waiting_seqs or stats.num_generated_tokens != prev[1] \
            or stats.num_prompt_tokens != prev[2]
        if busy:
            emit(stats_line(prev, now, stats))
        prev = (now, stats.num_generated_tokens, stats.num_prompt_tokens)
