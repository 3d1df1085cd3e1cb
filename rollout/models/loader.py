"""Read a Hugging Face checkpoint directory (config.json + *.safetensors, single or sharded).

Tensors are streamed one at a time from memory-mapped safetensors files into the already built
model through ``WeightMapper``, so peak host memory stays about one tensor, not one model.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, PretrainedConfig

from rollout.models.weights import WeightMapper, is_ignored

INDEX_FILE = "model.safetensors.index.json"


def _checkpoint_dir(path: str | Path) -> Path:
    d = Path(path)
    if not d.exists():
        raise FileNotFoundError(f"checkpoint directory {str(path)!r} does not exist")
    if not d.is_dir():
        raise FileNotFoundError(
            f"checkpoint path {str(path)!r} is not a directory (expected config.json + *.safetensors)"
        )
    return d


def safetensors_files(path: str | Path) -> list[Path]:
    """The weight files, in index order when sharded; errors name what is missing."""
    d = _checkpoint_dir(path)
    index = d / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [d / name for name in dict.fromkeys(sorted(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{INDEX_FILE} in {str(d)!r} lists shard(s) that do not exist: {missing}")
        return files
    files = sorted(d.glob("*.safetensors"))
    if not files:
        other = sorted(p.name for p in d.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
        hint = f" (found {other}; only safetensors are read: re-save with save_pretrained)" if other else ""
        raise ValueError(f"no *.safetensors weights in checkpoint directory {str(d)!r}{hint}")
    return files


def load_hf_config(path: str | Path) -> PretrainedConfig:
    """The checkpoint's config, after checking the directory holds weights we can read."""
    d = _checkpoint_dir(path)
    if not (d / "config.json").is_file():
        raise FileNotFoundError(f"checkpoint directory {str(d)!r} has no config.json")
    safetensors_files(d)
    return AutoConfig.from_pretrained(str(d))


def iter_checkpoint(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, CPU tensor) for every tensor of every shard, read lazily."""
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_named_tensors(model: nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy every tensor in (HF names), then insist every parameter of the model was written.

    Accepts ``hf_model.named_parameters()`` as well as a checkpoint stream. Tied weights count as
    written when either of their names arrived.
    """
    mapper = WeightMapper(model)
    names = []
    for name, tensor in named_tensors:
        if is_ignored(name):
            continue
        mapper.copy_(name, tensor.detach())
        names.append(name)
    missing = missing_weights(mapper, names)
    if missing:
        name = type(model).__name__
        raise ValueError(f"{len(missing)} weight(s) of {name} were not provided: {missing[:8]}")


def load_checkpoint(model: nn.Module, path: str | Path) -> None:
    """Load a Hugging Face safetensors checkpoint directory into ``model`` in place."""
    load_named_tensors(model, iter_checkpoint(path))


def missing_weights(mapper: WeightMapper, names: Iterable[str]) -> list[str]:
    """Accepted names none of ``names`` wrote (a tied weight counts as written under either name)."""
    written = {_target_key(mapper, name) for name in names}
    return [name for name in mapper.hf_names() if _target_key(mapper, name) not in written]


def _target_key(mapper: WeightMapper, name: str) -> tuple[int, int | None]:
    target = mapper.resolve(name)
    return id(target.param), None if target.rows is None else target.rows.start
