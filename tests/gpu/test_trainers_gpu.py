"""The training scripts on the GPU (skipped without CUDA, trl or hydra): GRPO with the engine co-located
(sleep/wake around every generation) and PPO, on the embedded tiny model; the engine-vs-trainer gap logged."""

import json
import math

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
pytest.importorskip("trl")
pytest.importorskip("hydra")

from rollout.cli import train_grpo, train_ppo  # noqa: E402
from tests.script_helpers import compose  # noqa: E402

SMALL = ("sampling.n=4", "sampling.max_tokens=64", "data.num_prompts=4", "logger.wandb.mode=disabled",
         "train.torch_threads=null", "train.steps=3")


def _lines(out):
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_grpo_co_located_on_gpu(tmp_path):
    out = train_grpo.run(compose(
        "train_grpo", f"output_dir={tmp_path}", f"model.cache_dir={tmp_path / 'cache'}", "train.sleep_level=1",
        "engine=h200", "engine.gpu_memory_utilization=0.3", "engine.max_num_seqs=16", *SMALL))
    lines = _lines(out)
    assert len(lines) == 3
    for x in lines:
        assert x["rollout/tokens_per_s"] > 0 and math.isfinite(x["loss"])
        # the engine samples in the checkpoint's dtype, the trainer scores under bf16 autocast: a small gap
        assert x["sampling/sampling_logp_difference/mean"] < 0.05, x
    times = json.loads((out / "step_times.json").read_text())["steps"]
    assert all(t["generation_s"] > 0 and t["train_s"] > 0 for t in times)


def test_ppo_on_gpu(tmp_path):
    out = train_ppo.run(compose(
        "train_ppo", f"output_dir={tmp_path}", f"model.cache_dir={tmp_path / 'cache'}", "train.sleep_level=1",
        "engine=h200", "engine.gpu_memory_utilization=0.3", "engine.max_num_seqs=16", *SMALL))
    for x in _lines(out):
        assert all(math.isfinite(x[k]) for k in ("ppo/policy_loss", "ppo/value_loss", "rollout/logprob_gap_mean"))
        assert x["rollout/logprob_gap_mean"] < 0.05 and x["ppo/optimizer_steps"] == 4
