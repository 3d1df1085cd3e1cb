"""The main job with an environment (``rollout.env=...``): multi-turn rows, checked against transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from rollout.assets import materialize_default_model
from tests import script_helpers
from tests.engine_helpers import hf_logprobs

ENV = ["rollout.env=tests.env_fixtures:ThreeTurns", "rollout.max_turns=4", "rollout.max_turn_tokens=5",
       "sampling.max_tokens=5", "logger.progress=false", "logger.wandb.mode=disabled", "rollout.rounds=1",
       "data.num_prompts=3", "sampling.n=2"]


def run_job(out: Path, cache: Path, *overrides: str) -> list[dict]:
    return script_helpers.run_job(out, cache, *ENV, *overrides)


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
    with pytest.raises(ValueError, match="must be drain with pool.replicas=2"):
        run_job(tmp_path / "b", cache_dir, "pool.replicas=2", "rollout.mode=partial")


PARTIAL = ["rollout.mode=partial", "data.num_prompts=2", "rollout.max_inflight_groups=4"]


def test_partial_mode_carries_conversations_and_writes_each_group_once(cache_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "p"
    rows = run_job(out, cache_dir, *PARTIAL, "rollout.rounds=3")
    groups = sorted({r["group_id"] for r in rows})
    assert len(rows) == 12 and len(groups) == 6  # 3 rounds x 2 groups x n=2, no group twice
    assert sorted((r["group_id"], r["sample_index"]) for r in rows) == [(g, j) for g in groups for j in range(2)]
    assert all(r["num_turns"] == 3 and r["env_error"] is None and r["reward"] == 3.0 for r in rows)
    import json

    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(m["carried_over_groups"] == 2 for m in metrics)  # the engine held 4 groups, 2 handed per round
    # a resume regenerates the groups in flight at the stop (which groups finish first depends on timing, so
    # only what must hold is checked: every group written once, whole)
    again = tmp_path / "q"
    first = run_job(again, cache_dir, *PARTIAL, "rollout.rounds=2")
    resumed = run_job(again, cache_dir, *PARTIAL, "rollout.rounds=3", "rollout.resume=true")
    keys = sorted((r["group_id"], r["sample_index"]) for r in resumed)
    assert len(resumed) == 12 and len(set(keys)) == 12 and resumed[: len(first)] == first
    assert all(sum(g == k[0] for k in keys) == 2 for g, _ in keys)
