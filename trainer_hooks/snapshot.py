"""The writer's half of disk hand-over: ``save_snapshot(model, DIR, step)`` -> ``DIR/step_<step>/``.

A snapshot is a Hugging Face safetensors checkpoint directory (config.json + model*.safetensors, an
index when sharded), so ``Engine.from_pretrained``, ``/update_weights_from_disk`` and
``scripts/rollout.py rollout.weights_from=DIR`` all read it the same way. It is written into a hidden
temporary directory beside the target, with an empty ``COMPLETE`` file as its last file, then renamed into
place in one step: a reader never sees a half-written ``step_<N>``, and ``COMPLETE`` marks it done for
readers that check for it. Names are the plain HF names (the same normalisation as ``push_weights``:
DDP, torch.compile, FSDP, PEFT with its adapter merged for the save).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from trainer_hooks.trl import merged_adapter
from trainer_hooks.weights import HFWeights

COMPLETE = "COMPLETE"
INDEX_FILE = "model.safetensors.index.json"


def snapshot_dir(directory: str | os.PathLike[str], step: int) -> Path:
    return Path(directory) / f"step_{step}"


def save_snapshot(model: nn.Module, directory: str | os.PathLike[str], step: int, tokenizer: Any = None,
                  max_shard_bytes: int = 5 << 30) -> Path:
    """Write ``model``'s weights and config to ``directory/step_<step>/`` atomically; returns that path.

    Refuses to overwrite an existing snapshot (a reader may be loading it). ``tokenizer`` is saved too
    when given (a snapshot can then serve as a whole checkpoint).
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"save_snapshot needs a torch.nn.Module, got {type(model).__name__}")
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    final = snapshot_dir(root, step)
    if final.exists():
        raise FileExistsError(f"snapshot {str(final)!r} already exists; snapshots are never overwritten")
    config = _find_config(model)
    tmp = Path(tempfile.mkdtemp(prefix=f".step_{step}.tmp-", dir=root))
    try:
        with merged_adapter(model):
            _write_weights(HFWeights(model), tmp, max_shard_bytes)
        config.save_pretrained(str(tmp))
        generation = getattr(_unwrap(model), "generation_config", None)
        if generation is not None and hasattr(generation, "save_pretrained"):
            generation.save_pretrained(str(tmp))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        (tmp / COMPLETE).touch()  # the last file written
        _fsync_tree(tmp)
        os.rename(tmp, final)  # atomic on one filesystem; fails rather than replace a concurrent writer's
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _write_weights(weights: HFWeights, out: Path, max_shard_bytes: int) -> None:
    """model.safetensors, or model-0000k-of-0000n.safetensors shards plus an index past ``max_shard_bytes``."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = total = 0
    for name, tensor in weights:
        t = tensor.detach().to("cpu", copy=True).contiguous()  # own storage: tied or viewed weights save apart
        nbytes = t.numel() * t.element_size()
        if size and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
        total += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2))


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


def _fsync_tree(path: Path) -> None:
    for p in path.iterdir():
        with open(p, "rb") as f:
            os.fsync(f.fileno())
    _fsync_dir(path)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
