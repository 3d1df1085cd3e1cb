"""Weight inputs -> plain Hugging Face ``(name, tensor)`` pairs: the one coercion every path uses.

A trainer's ``named_parameters()`` rarely carries plain HF names: DDP adds ``module.``, FSDP1 and
activation checkpointing add wrapper segments, ``torch.compile`` adds ``_orig_mod.``, PEFT adds
``base_model.model.`` / ``.base_layer`` and adapter tensors that the engine never sees (they are merged
first). ``normalize_name`` maps all of these back, so the engine's ``WeightMapper`` stays the one
mapping from HF names to fused parameters.

``named_weights`` turns anything a weight push accepts (a module, a ``{name: tensor}`` mapping, an
iterable or iterator of pairs, a checkpoint directory's ``CheckpointWeights``) into a re-iterable of
``(hf_name, tensor)`` pairs: ``Engine.update_weights``, the pool, the client and the server all walk
it twice (metadata or validation, then data) and never copy a tensor. Only a one-shot iterator is
listed first (references, not copies).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import torch
from torch import nn

# Path segments added by wrappers (torch.compile, FSDP1, activation checkpointing): dropped wherever found.
_WRAPPER_SEGMENTS = frozenset({"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"})
_PEFT_PREFIX = ("base_model", "model")


def normalize_name(name: str) -> str | None:
    """The plain HF parameter name of a wrapped model's parameter, or None for adapter-only tensors.

    ``module.`` (DDP), ``_orig_mod.`` (torch.compile), ``_fsdp_wrapped_module.`` and
    ``_checkpoint_wrapped_module.`` are dropped; PEFT's ``base_model.model.`` prefix, ``.base_layer`` and
    ``modules_to_save.<adapter>.`` are undone; LoRA factors and ``original_module`` copies give None.
    """
    parts = [p for p in name.split(".") if p not in _WRAPPER_SEGMENTS]
    while parts and parts[0] == "module":
        parts.pop(0)
    if tuple(parts[:2]) == _PEFT_PREFIX:
        parts = parts[2:]
    if any(p.startswith("lora_") or p == "original_module" for p in parts):
        return None
    out: list[str] = []
    i = 0
    while i < len(parts):
        if parts[i] == "base_layer":
            i += 1
        elif parts[i] == "modules_to_save":
            i += 2  # the segment after it is the adapter's name
        else:
            out.append(parts[i])
            i += 1
    return ".".join(out) if out else None


class HFWeights:
    """Re-iterable ``(hf_name, tensor)`` view of a trainer model: no copies, so walking it twice is free.

    Tensors are detached views of the live parameters (an FSDP2 ``DTensor`` is gathered one parameter at
    a time). Merge PEFT adapters before iterating (``merge_adapter``), as TRL does for vLLM.
    """

    def __init__(self, model: nn.Module) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"HFWeights needs a torch.nn.Module, got {type(model).__name__}")
        self.model = model

    def parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(hf_name, parameter) without gathering anything: metadata (a DTensor's shape is the full one)."""
        seen: set[str] = set()
        for name, param in self.model.named_parameters():
            hf_name = normalize_name(name)
            if hf_name is not None and hf_name not in seen:
                seen.add(hf_name)
                yield hf_name, param

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for hf_name, param in self.parameters():
            tensor = param.full_tensor() if hasattr(param, "full_tensor") else param
            yield hf_name, tensor.detach()

    def names(self) -> list[str]:
        return [n for n, _ in self.parameters()]


class NormalizedPairs:
    """Re-iterable view of ``(name, tensor)`` pairs under plain HF names (adapter-only tensors dropped)."""

    def __init__(self, pairs: Iterable[object]) -> None:
        self.pairs = pairs

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for item in self.pairs:
            if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
                name = normalize_name(item[0])
                if name is None:
                    continue
                yield name, item[1]
            else:
                yield item  # type: ignore[misc]  # malformed: the consumer names the problem


def named_weights(weights: object) -> Iterable[tuple[str, torch.Tensor]]:
    """Any accepted weight input as a re-iterable of ``(hf_name, tensor)`` pairs (see the module doc)."""
    if isinstance(weights, (HFWeights, NormalizedPairs)):
        return weights
    if isinstance(weights, nn.Module):
        return HFWeights(weights)
    if isinstance(weights, Mapping):
        return NormalizedPairs(weights.items())
    if isinstance(weights, Iterator):
        return NormalizedPairs(list(weights))  # references to the iterator's tensors, not copies
    if isinstance(weights, Iterable) and not isinstance(weights, (str, bytes)):
        return NormalizedPairs(weights)
    raise TypeError("weights must be a module, a {name: tensor} mapping or an iterable of (name, tensor) pairs, "
                    f"got {type(weights).__name__}")

