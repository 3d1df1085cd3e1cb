"""Hugging Face parameter name -> our parameter (and row slice): the one mapping used by checkpoint
loading and by ``Engine.update_weights``.

The mapping is derived from the model itself: every parameter maps to the name it has, except those
of a ``MergedLinear``, whose rows are split back into the stacked HF projections (``q_proj`` /
``k_proj`` / ``v_proj`` -> ``qkv_proj``; ``gate_proj`` / ``up_proj`` -> ``gate_up_proj``). With tied
embeddings ``lm_head.weight`` is the embedding's Parameter, so it maps onto that same storage.
"""

from __future__ import annotations

import torch
from torch import nn

# Buffers some checkpoints and state dicts carry; recomputed by us, so accepted and dropped.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

Target = tuple[nn.Parameter, slice | None]


def is_ignored(hf_name: str) -> bool:
    return hf_name.endswith(IGNORED_SUFFIXES)


class WeightMapper:
    """Resolves, validates and copies HF-named tensors into a model, in place."""

    def __init__(self, model: nn.Module) -> None:
        self.model_name = type(model).__name__
        self._targets: dict[str, Target] = {}
        for mod_name, module in model.named_modules(remove_duplicate=False):
            prefix = f"{mod_name}." if mod_name else ""
            shards = module.shard_slices() if hasattr(module, "shard_slices") else None
            for pname, param in module.named_parameters(recurse=False):
                if shards is None:
                    self._targets[prefix + pname] = (param, None)
                    continue
                parent = mod_name.rpartition(".")[0]
                parent = f"{parent}." if parent else ""
                for shard_name, rows in shards.items():
                    self._targets[f"{parent}{shard_name}.{pname}"] = (param, rows)

    def hf_names(self) -> list[str]:
        """Every name accepted, ``lm_head.weight`` included when tied (it aliases the embedding)."""
        return list(self._targets)

    def resolve(self, hf_name: str) -> Target:
        """(our parameter, dim-0 rows or None for the whole tensor); KeyError for an unknown name."""
        try:
            return self._targets[hf_name]
        except KeyError:
            raise KeyError(self._unknown_message(hf_name)) from None

    def expected_shape(self, hf_name: str) -> tuple[int, ...]:
        param, rows = self.resolve(hf_name)
        shape = tuple(param.shape)
        if rows is None:
            return shape
        return (rows.stop - rows.start, *shape[1:])

    def validate(self, hf_name: str, tensor: object) -> None:
        """Raise TypeError/ValueError naming the tensor unless ``copy_`` would accept it."""
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"weight {hf_name!r} must be a torch.Tensor, got {type(tensor).__name__}")
        if is_ignored(hf_name):
            return
        if hf_name not in self._targets:
            raise ValueError(self._unknown_message(hf_name))
        if not tensor.is_floating_point():
            raise TypeError(f"weight {hf_name!r} must be a floating-point tensor, got dtype {tensor.dtype}")
        expected = self.expected_shape(hf_name)
        if tuple(tensor.shape) != expected:
            raise ValueError(f"weight {hf_name!r} has shape {tuple(tensor.shape)}, expected {expected}")

    def copy_(self, hf_name: str, tensor: torch.Tensor) -> None:
        """Validate, then copy into the existing storage (dtype/device converted): captured graphs,
        which hold pointers to these parameters, see the new values."""
        self.validate(hf_name, tensor)
        if is_ignored(hf_name):
            return
        param, rows = self._targets[hf_name]
        with torch.no_grad():
            dst = param.data if rows is None else param.data[rows]
            dst.copy_(tensor)

    def _unknown_message(self, hf_name: str) -> str:
        example = next(iter(self._targets), "")
        return (
            f"unknown weight name {hf_name!r} for {self.model_name}; expected Hugging Face parameter names "
            f"such as {example!r} ({len(self._targets)} accepted, see WeightMapper.hf_names())"
        )
