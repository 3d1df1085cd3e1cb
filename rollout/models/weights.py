"""Hugging Face parameter name -> our parameter (and its part of it): the one mapping used by checkpoint
loading and by ``Engine.update_weights``.

The mapping is derived from the model itself: every parameter maps to the name it has, except those
of a ``MergedLinear``, whose rows are split back into the stacked HF projections (``q_proj`` /
``k_proj`` / ``v_proj`` -> ``qkv_proj``; ``gate_proj`` / ``up_proj`` -> ``gate_up_proj``). With tied
embeddings ``lm_head.weight`` is the embedding's Parameter, so it maps onto that same storage.

Under tensor parallelism the model is one rank's shard: names and expected shapes stay those of the
full HF tensors, and each target also says which part of the full tensor this rank keeps (a layer's
``load_slices``), so every caller passes full tensors and sharding happens here, on arrival.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from rollout.layers.linear import LoadSlice

# Buffers some checkpoints and state dicts carry; recomputed by us, so accepted and dropped.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class Target(NamedTuple):
    """Where one HF tensor goes: rows of our parameter, from this rank's part of the full tensor."""

    param: nn.Parameter
    where: LoadSlice

    @property
    def rows(self) -> slice | None:
        return self.where.rows

    def dst(self) -> torch.Tensor:
        """The part of the parameter this name writes (a view)."""
        return self.param.data if self.where.rows is None else self.param.data[self.where.rows]

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of a full HF tensor (a view)."""
        w = self.where
        return tensor if w.src is None else tensor.narrow(w.dim, w.src.start, w.src.stop - w.src.start)

    def write(self, tensor: torch.Tensor, non_blocking: bool = False) -> None:
        self.dst().copy_(self.take(tensor), non_blocking=non_blocking)


def is_ignored(hf_name: str) -> bool:
    return hf_name.endswith(IGNORED_SUFFIXES)


class WeightMapper:
    """Resolves, validates and copies HF-named tensors into a model, in place."""

    def __init__(self, model: nn.Module) -> None:
        self.model_name = type(model).__name__
        self._targets: dict[str, Target] = {}
        for mod_name, module in model.named_modules(remove_duplicate=False):
            prefix = f"{mod_name}." if mod_name else ""
            parent = mod_name.rpartition(".")[0]
            parent = f"{parent}." if parent else ""
            for pname, param in module.named_parameters(recurse=False):
                slices = module.load_slices(pname) if hasattr(module, "load_slices") else {None: LoadSlice()}
                for hf_module, where in slices.items():  # None: the module's own name
                    name = prefix + pname if hf_module is None else f"{parent}{hf_module}.{pname}"
                    self._targets[name] = Target(param, where)

    def hf_names(self) -> list[str]:
        """Every name accepted, ``lm_head.weight`` included when tied (it aliases the embedding)."""
        return list(self._targets)

    def resolve(self, hf_name: str) -> Target:
        """Where ``hf_name`` lands; KeyError for an unknown name."""
        try:
            return self._targets[hf_name]
        except KeyError:
            raise KeyError(self._unknown_message(hf_name)) from None

    def expected_shape(self, hf_name: str) -> tuple[int, ...]:
        """The full HF tensor's shape (whatever part of it this rank keeps)."""
        param, w = self.resolve(hf_name)
        shape = list(param.shape)
        if w.rows is not None:
            shape[0] = w.rows.stop - w.rows.start
        if w.src is not None:
            shape[w.dim] = w.full
        return tuple(shape)

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
        with torch.no_grad():
            self._targets[hf_name].write(tensor)

    def _unknown_message(self, hf_name: str) -> str:
        example = next(iter(self._targets), "")
        return (
            f"unknown weight name {hf_name!r} for {self.model_name}; expected Hugging Face parameter names "
            f"such as {example!r} ({len(self._targets)} accepted, see WeightMapper.hf_names())"
        )
