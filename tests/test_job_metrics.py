"""The main job's engine metrics: time to first token, prefix-cache hit rate, floor ratio, pool replicas."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import datasets
import pytest

from rollout import SamplingParams
from rollout.job.data import PromptDataset
from rollout.job.round_metrics import engine_window_metrics, percentile
from rollout.job.rounds import RoundDriver
from rollout.rl.metrics import PoolMeter
from tests.engine_helpers import make_engine
from tests.job_fakes import FakeEngine, zero_stats
from tests.tiny_models import make_tiny_hf_model


def _dataset(tokenizer, prompts) -> PromptDataset:
    return PromptDataset(datasets.Dataset.from_dict({"prompt": prompts}), tokenizer, "prompt", "answer")


def test_engine_counts_first_tokens_and_prefix_hits() -> None:
    engine = make_engine(make_tiny_hf_model("llama", seed=0), block_size=4, num_blocks=64)
    prompt = list(range(3, 24))  # 21 tokens: 5 full blocks
    params = SamplingParams(n=3, max_tokens=3, ignore_eos=True, seed=1)
    s0 = engine.get_stats()
    engine.generate([prompt], params)
    s1 = engine.get_stats()
    assert s1.num_first_tokens - s0.num_first_tokens == 1  # one request of 3 samples
    assert s1.num_started_prompt_tokens - s0.num_started_prompt_tokens == 21
    assert s1.num_prefix_cached_tokens == s0.num_prefix_cached_tokens  # the cache was cold
    engine.generate([prompt, [5, 6, 7]], [params, SamplingParams(max_tokens=1)])  # second: a 1-token request
    s2 = engine.get_stats()
    assert s2.num_first_tokens - s1.num_first_tokens == 2
    assert s2.num_started_prompt_tokens - s1.num_started_prompt_tokens == 24
    assert s2.num_prefix_cached_tokens - s1.num_prefix_cached_tokens == 20  # the prompt's 5 full blocks
    assert engine_window_metrics(s1, s2, None) == {"prefix_cache_hit_rate": 20 / 24, "floor_ratio": None}


def test_floor_ratio_and_percentile() -> None:
    before = dataclasses.replace(zero_stats(), gpu_compute_s=1.0, bytes_read=0)
    after = dataclasses.replace(zero_stats(), gpu_compute_s=3.0, bytes_read=4 * 10**12)
    assert engine_window_metrics(before, after, 4e12)["floor_ratio"] == pytest.approx(0.5)  # 1 s floor in 2 s
    assert engine_window_metrics(before, after, None)["floor_ratio"] is None  # no bandwidth: the CPU
    cpu = dataclasses.replace(zero_stats())
    assert engine_window_metrics(cpu, cpu, 4e12) == {"prefix_cache_hit_rate": None, "floor_ratio": None}
    assert percentile([], 90) is None and percentile([3.0], 90) == 3.0
    assert percentile([float(i) for i in range(1, 11)], 90) == 9.0


@pytest.mark.parametrize("mode", ["drain", "partial"])
def test_round_reports_time_to_first_token_per_request(tokenizer, mode) -> None:
    engine = FakeEngine()
    actor = RoundDriver(engine, _dataset(tokenizer, ["a", "bb", "ccc"]), SamplingParams(n=2, max_tokens=4),
                         num_prompts=3, mode=mode, max_inflight_groups=4 if mode == "partial" else None)
    m = actor.run_round().metrics
    assert m["ttft_mean_s"] > 0 and m["ttft_p90_s"] >= m["ttft_mean_s"] * 0.5
    assert m["prefix_cache_hit_rate"] == 0.0 and m["floor_ratio"] is None
    # every request's first token seen, once (partial mode also starts groups it hands out in a later round)
    assert m["ttft_requests"] == 3 if mode == "drain" else m["ttft_requests"] >= 3
    assert "pool/alive" not in m


class _FakePool:
    def __init__(self) -> None:
        self.generated = [0, 0]

    def stats(self) -> dict:
        reps = [{"index": i, "num_generated_tokens": g, "tokens_per_s": 10.0 * (i + 1), "kv_cache_usage": 0.25,
                 "gpu_busy_frac": None, "num_preemptions": 0} for i, g in enumerate(self.generated)]
        return {"pool": {"alive": 2, "failures": 0, "tokens_per_s": 30.0}, "replicas": reps, "last_round": {}}


def test_pool_replica_metrics_per_round(tokenizer) -> None:
    engine = FakeEngine()
    engine.pool = _FakePool()  # what PoolEngine exposes
    engine.pool.generated = [40, 60]
    actor = RoundDriver(engine, _dataset(tokenizer, ["a", "bb"]), SamplingParams(n=2, max_tokens=4), num_prompts=2)
    m = actor.run_round().metrics
    assert m["pool/alive"] == 2 and m["pool/replica_1/tokens_per_s"] == 20.0
    assert m["pool/replica_0/round_tokens_per_s"] == pytest.approx(40 / m["round_time_s"])
    meter = PoolMeter()
    meter.metrics(engine.pool.stats(), 1.0)
    engine.pool.generated = [50, 5]  # replica 1 was replaced: its counters started again
    stats = engine.pool.stats()
    stats["replicas"].append({"index": 2, "alive": False})
    m = meter.metrics(stats, 2.0)
    assert m["pool/replica_0/round_tokens_per_s"] == 5.0 and m["pool/replica_1/round_tokens_per_s"] == 2.5
    assert m["pool/replica_2/alive"] == 0 and "pool/replica_2/tokens_per_s" not in m


def test_wandb_logs_pool_keys_against_the_round(tmp_path: Path) -> None:
    from rollout.rl.wandb_logger import WandbLogger
    from rollout.settings.schema import WandbConfig

    logged = []
    logger = WandbLogger(WandbConfig(mode="disabled"), tmp_path, {})
    logger.run = SimpleNamespace(log=logged.append)
    logger.log_round({"round": 1, "ttft_p90_s": 0.5, "floor_ratio": None, "pool/replica_0/tokens_per_s": 3.0}, {})
    assert logged == [{"round": 1, "round/ttft_p90_s": 0.5, "pool/replica_0/tokens_per_s": 3.0}]
