"""The writer's half of disk hand-over: ``save_snapshot(model, DIR, step)`` -> ``DIR/step_<step>/``.

A snapshot is a Hugging Face safetensors checkpoint directory (config.json + model*.safetensors, an
index when sharded), so ``Engine.from_pretrained``, ``/update_weights_from_disk`` and
``scripts/rollout.py rollout.weights_from=DIR`` all read it the same way (``rollout.weights.disk``, which
also writes it: atomically, ``COMPLETE`` last). Names are the plain HF names (the same normalisation as
``push_weights``: DDP, torch.compile, FSDP, PEFT with its adapter merged for the save).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from torch import nn

from rollout.models.loader import INDEX_FILE
from rollout.weights.disk import COMPLETE, snapshot_dir, write_snapshot
from rollout.weights.names import HFWeights
from trainer_hooks.trl import merged_adapter

__all__ = ["COMPLETE", "INDEX_FILE", "save_snapshot", "snapshot_dir"]


def save_snapshot(model: nn.Module, directory: str | os.PathLike[str], step: int, tokenizer: Any = None,
                  max_shard_bytes: int = 5 << 30) -> Path:
    """Write ``model``'s weights and config to ``directory/step_<step>/`` atomically; returns that path.

    Refuses to overwrite an existing snapshot (a reader may be loading it). ``tokenizer`` is saved too
    when given (a snapshot can then serve as a whole checkpoint).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"save_snapshot needs a torch.nn.Module, got {type(model).__name__}")
    config = _find_config(model)

    def extras(tmp: Path) -> None:
        config.save_pretrained(str(tmp))
        generation = getattr(_unwrap(model), "generation_config", None)
        if generation is not None and hasattr(generation, "save_pretrained"):
            generation.save_pretrained(str(tmp))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))

    with merged_adapter(model):
        return write_snapshot(HFWeights(model), directory, step, extras, max_shard_bytes)


def _unwrap(model: nn.Module) -> Any:
    """Through DDP / FSDP1 (``.module``) and torch.compile (``._orig_mod``) to the model that has a config."""
    m: Any = model
    for _ in range(8):
        if hasattr(m, "config") and hasattr(m.config, "save_pretrained"):
            return m
        inner = getattr(m, "module", None) or getattr(m, "_orig_mod", None)
        if inner is None:
            break
        m = inner
    return m


def _find_config(model: nn.Module) -> Any:
    config = getattr(_unwrap(model), "config", None)
    if config is None or not hasattr(config, "save_pretrained"):
        raise ValueError(f"cannot find a Hugging Face config on {type(model).__name__} (or the model it wraps); "
                         "a snapshot needs config.json")
    return config
