"""What users watch in the main job: trajectories keep their dataset row's columns (prefixed where a
trajectory column has the name) and the stop reason; the progress bar counts generated tokens per round."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from rollout.job import main as script
from rollout.job.trajectory import group_trajectories
from rollout.job.trajectory_writer import read_trajectories
from tests.script_helpers import compose


def _run(tmp_path: Path, cache_dir: Path, *overrides: str) -> Path:
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {i} + 1?", "answer": str(i + 1), "difficulty": i % 3,
                                        "round": f"r{i}", "meta": {"source": "test"}}) + "\n" for i in range(4)))
    cfg = compose("config", f"output_dir={tmp_path / 'o'}", f"model.cache_dir={cache_dir}",
                  "logger.wandb.mode=disabled", "sampling.max_tokens=3", f"data.path={data}", "data.num_prompts=2",
                  "sampling.n=2", "rollout.rounds=2", *overrides)
    return script.run(cfg)


def test_trajectories_keep_every_dataset_column(cache_dir, tmp_path):
    rows = read_trajectories(_run(tmp_path, cache_dir, "logger.progress=false")).to_pylist()
    assert len(rows) == 8
    for r in rows:
        assert r["answer"] == str(r["prompt_index"] + 1) and r["difficulty"] == r["prompt_index"] % 3
        assert r["data_round"] == f"r{r['prompt_index']}" and isinstance(r["round"], int)  # collision: prefixed
        assert r["data_prompt"] == f"What is {r['prompt_index']} + 1?" and r["meta"] == {"source": "test"}
        assert "stop_reason" in r


def test_the_progress_bar_counts_tokens_per_round(cache_dir, tmp_path, capfd):
    _run(tmp_path, cache_dir, "logger.progress=true")
    err = capfd.readouterr().err
    assert "round 1/2" in err and "round 2/2" in err and "tok" in err and "groups" in err and "KV" in err


def test_the_progress_bar_ends_full_when_samples_stop_early(cache_dir, tmp_path, capfd):
    """The bar's total is every sample at max_tokens; samples that stop sooner used to leave it short of 100%."""
    _run(tmp_path, cache_dir, "logger.progress=true", "sampling.max_tokens=48", "sampling.stop=[' ']")
    err = capfd.readouterr().err
    for r in (1, 2):
        last = [part for part in err.replace("\r", "\n").splitlines() if part.startswith(f"round {r}/2")][-1]
        assert "100%" in last, last


def test_stop_reason_is_kept_as_text():
    c = SimpleNamespace(index=0, token_ids=[5, 7], logprobs=[-1.0, -2.0], finish_reason="stop", text="ab",
                        policy_versions=[0, 0], stop_reason=7)
    out = SimpleNamespace(request_id="r", prompt_token_ids=[1], outputs=[c])
    prompt = SimpleNamespace(index=3, text="p", answer=None, columns=(("answer", "x"),))
    t = group_trajectories(0, 0, prompt, out, 1, lambda ids: "", None, 0)[0]
    assert t.stop_reason == "7" and t.columns == {"answer": "x"}
