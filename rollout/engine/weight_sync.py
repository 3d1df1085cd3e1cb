"""All-or-nothing, in-place weight updates by Hugging Face parameter name."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from rollout.models.weights import WeightMapper


class WeightSync:
    def __init__(self, model: torch.nn.Module) -> None:
        self.mapper = WeightMapper(model)

    def apply(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | dict) -> int:
        """Validate every (name, tensor), then copy them all in; nothing changes if any is bad."""
        items = list(named_tensors.items() if isinstance(named_tensors, dict) else named_tensors)
        for i, item in enumerate(items):
            if not (isinstance(item, tuple) and len(item) == 2):
                raise TypeError(f"update_weights expects (name, tensor) pairs; item {i} is {type(item).__name__}")
            name, tensor = item
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"weight {name!r} must be a torch.Tensor, got {type(tensor).__name__}")
            self.mapper.validate(name, tensor)
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                raise ValueError(f"weight {name!r} has non-finite values (nan/inf); update rejected")
        with torch.no_grad():
            for name, tensor in items:
                self.mapper.copy_(name, tensor)
        return len(items)
