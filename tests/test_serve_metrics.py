"""``/metrics`` rendering (no server): GPU-only series appear only with a GPU, vLLM's names mirror ours."""

from __future__ import annotations

from types import SimpleNamespace

from rollout.serve.metrics import render


def _state():
    loop = SimpleNamespace(rate=SimpleNamespace(rate=lambda now, n: 12.5), paused=False, num_pending=lambda: 3)
    return SimpleNamespace(loop=loop, counters={"weight_updates": 1, "last_update_s": 0.2},
                           engine=SimpleNamespace(is_sleeping=False), receiver=SimpleNamespace(staging_bytes=0),
                           model_name='m"x')


def _stats(**kw):
    base = dict(num_generated_tokens=40, num_prompt_tokens=9, num_started_prompt_tokens=9, num_prefix_cached_tokens=0,
                num_running_seqs=2, num_waiting_seqs=1, kv_cache_usage=0.25, num_preemptions=0, num_steps=7,
                policy_version=2, gpu_busy_frac=None, gpu_compute_s=None)
    return SimpleNamespace(**{**base, **kw})


def _values(text: str) -> dict[str, float]:
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def test_gpu_compute_seconds_is_a_counter_only_on_a_gpu():
    """serve_bench's stream cost reads it: a window's busy = its delta / the window's wall."""
    cpu = _values(render(_stats(), _state()))
    assert "rollout_gpu_compute_seconds_total" not in cpu and "rollout_gpu_busy_ratio" not in cpu
    gpu = render(_stats(gpu_busy_frac=0.99, gpu_compute_s=315.0571), _state())
    assert "# TYPE rollout_gpu_compute_seconds_total counter" in gpu
    assert _values(gpu)["rollout_gpu_compute_seconds_total"] == 315.057
    assert _values(gpu)['vllm:generation_tokens_total{model_name="m\\"x"}'] == 40
