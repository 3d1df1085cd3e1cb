"""The main job's floor ratio on the GPU (skipped without CUDA): a bandwidth is measured and each round
reports a floor ratio in (0, 1.5] next to its prefix-cache hit rate and time to first token."""

import json

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_copy_bandwidth_is_measured_on_cuda_only() -> None:
    from rollout.job.bandwidth import copy_bandwidth

    assert copy_bandwidth("cpu") is None
    bw = copy_bandwidth("cuda")
    assert bw is not None and 1e11 < bw < 2e13  # 0.1 .. 20 TB/s


def test_rollout_rounds_report_floor_ratio(tmp_path) -> None:
    from rollout.job.main import run
    from tests.script_helpers import compose

    out = run(compose(
        "config", f"output_dir={tmp_path}", f"model.cache_dir={tmp_path / 'cache'}", "logger.wandb.mode=disabled",
        "rollout.rounds=2", "model.device=cuda",
    ))
    rounds = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rounds) == 2
    for m in rounds:
        assert m["floor_ratio"] is not None and 0 < m["floor_ratio"] <= 1.5, m["floor_ratio"]
        assert m["ttft_p90_s"] > 0 and m["prefix_cache_hit_rate"] is not None
