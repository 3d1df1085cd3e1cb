"""save_snapshot: DIR/step_<N>/ as a Hugging Face safetensors checkpoint, atomic, COMPLETE written last."""

from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import AutoModelForCausalLM

from rollout.engine.engine import Engine
from tests.engine_helpers import assert_matches_hf, greedy
from tests.tiny_models import make_tiny_hf_model
from trainer_hooks.snapshot import COMPLETE, INDEX_FILE, save_snapshot


class _DDP(torch.nn.Module):
    """Stands in for DistributedDataParallel: parameters under ``module.``."""

    def __init__(self, module):
        super().__init__()
        self.module = module


def test_snapshot_is_a_checkpoint_the_engine_and_transformers_load(tmp_path):
    model = make_tiny_hf_model("qwen2", seed=3)  # tied embeddings: lm_head is not saved twice
    path = save_snapshot(_DDP(model), tmp_path, step=12)
    assert path == tmp_path / "step_12" and (path / COMPLETE).is_file() and (path / COMPLETE).stat().st_size == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_12"]  # no temporary left behind
    reloaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    for (n, a), (_, b) in zip(model.state_dict().items(), reloaded.state_dict().items()):
        assert torch.equal(a, b), n
    engine = Engine.from_pretrained(str(path), dtype="float32", device="cpu", max_model_len=64)
    prompt = [3, 14, 15, 92]
    out = engine.generate([prompt], greedy(6))[0]
    assert_matches_hf(model, prompt, out.outputs[0])


def test_sharded_snapshot_has_an_index(tmp_path):
    model = make_tiny_hf_model("llama", seed=1)
    path = save_snapshot(model, tmp_path, step=0, max_shard_bytes=40_000)
    index = json.loads((path / INDEX_FILE).read_text())
    files = set(index["weight_map"].values())
    assert len(files) > 1 and all((path / f).is_file() for f in files)
    engine = Engine.from_pretrained(str(path), dtype="float32", device="cpu", max_model_len=64)
    assert_matches_hf(model, [1, 2, 3], engine.generate([[1, 2, 3]], greedy(4))[0].outputs[0])


def test_never_overwrites_and_cleans_up_a_failed_write(tmp_path, monkeypatch):
    model = make_tiny_hf_model("llama", seed=2)
    save_snapshot(model, tmp_path, step=5)
    with pytest.raises(FileExistsError, match="step_5"):
        save_snapshot(model, tmp_path, step=5)

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("rollout.weights.disk.save_file", broken)
    with pytest.raises(OSError, match="disk full"):
        save_snapshot(model, tmp_path, step=6)
    assert sorted(os.listdir(tmp_path)) == ["step_5"]  # no step_6, no temporary
    with pytest.raises(ValueError, match="step must be"):
        save_snapshot(model, tmp_path, step=-1)
    with pytest.raises(ValueError, match="cannot find a Hugging Face config"):
        save_snapshot(torch.nn.Linear(2, 2), tmp_path, step=9)
