"""The main job with an environment (``rollout.env=...``): multi-turn rows, checked against transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from rollout.assets import materialize_default_model
from rollout.job import main as script
from rollout.job.trajectory_writer import read_trajectories
from tests.engine_helpers import hf_logprobs
from tests.script_helpers import compose

ENV = ["rollout.env=tests.env_fixtures:ThreeTurns", "rollout.max_turns=4", "rollout.max_turn_tokens=5",
       "sampling.max_tokens=5", "logger.progress=false", "logger.wandb.mode=disabled", "rollout.rounds=1",
       "data.num_prompts=3", "sampling.n=2"]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("rollout-cache")
    materialize_default_model(path)
    return path


def run_job(out: Path, cache: Path, *overrides: str) -> list[dict]:
    script.run(compose("config", f"output_dir={out}", f"model.cache_dir={cache}", *ENV, *overrides))
    return read_trajectories(out).to_pylist()


def test_job_writes_multi_turn_rows_matching_hf(cache_dir: Path, tmp_path: Path) -> None:
    rows = run_job(tmp_path / "out", cache_dir)
    assert len(rows) == 6 and sorted((r["group_id"], r["sample_index"]) for r in rows) == [
        (g, j) for g in range(3) for j in range(2)]
    hf = AutoModelForCausalLM.from_pretrained(materialize_default_model(cache_dir), dtype=torch.float32).eval()
    for r in rows:
        mask, ids, lps = r["env_mask"], r["completion_ids"], r["logprobs"]
        assert len(mask) == len(ids) == len(lps) == len(r["policy_versions"])
        turns = sum(1 for i, m in enumerate(mask) if m == 1 and (i == 0 or mask[i - 1] == 0))
        assert r["num_turns"] == turns == 3 and r["reward"] == 3.0 and r["env_error"] is None
        assert all(lp == 0.0 for lp, m in zip(lps, mask) if m == 0) and 0 in mask
        ref = hf_logprobs(hf, r["prompt_ids"], ids)
        want = ref[torch.arange(len(ids)), torch.tensor(ids)]
        model = torch.tensor(mask, dtype=torch.bool)
        assert torch.allclose(torch.tensor(lps)[model], want[model], atol=1e-4)
    m = [line for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert '"prefill_over_given": 1.0' in m[0] and '"turns_mean": 3.0' in m[0]


def test_job_refuses_a_bad_environment(cache_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="rollout.env='tests.env_fixtures:Nope'"):
        run_job(tmp_path / "a", cache_dir, "rollout.env=tests.env_fixtures:Nope")
    with pytest.raises(ValueError, match="rollout.mode='partial' is invalid: must be drain with rollout.env"):
        run_job(tmp_path / "b", cache_dir, "rollout.mode=partial")
