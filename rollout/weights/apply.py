"""The engine's end of every push: all-or-nothing, in-place weight updates by Hugging Face parameter name.

The source is ``names.named_weights``' pairs (names normalised). Two passes over it: the first validates
everything (names and shapes on the host, finiteness where the data lives, after the cast to the
engine's dtype), the second copies. A mapping, a list, a checkpoint directory's ``CheckpointWeights`` or
any other re-iterable (e.g. a view over a trainer's live parameters) is walked twice and never copied, so
no second copy of the model is held; a one-shot iterator (``model.named_parameters()``) is first turned
into a list of references. GPU tensors are checked on the GPU with a single sync; CPU tensors bound
for a GPU engine are streamed through one reusable staging buffer and checked there (a CPU scan of
16 GB takes seconds). Copies are in place (captured CUDA graphs stay valid) and non-blocking from pinned memory,
with one synchronisation at the end.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping

import torch

from rollout.models.weights import WeightMapper, is_ignored
from rollout.weights.names import named_weights

Source = Callable[[], Iterator[object]]


class WeightSync:
    def __init__(self, model: torch.nn.Module) -> None:
        self.mapper = WeightMapper(model)
        self.device = next(model.parameters()).device

    def apply(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]) -> int:
        """Validate every (name, tensor), then copy them all in; nothing changes if any is bad."""
        source = _as_source(named_tensors)
        seen = self._validate(source)
        with torch.no_grad():
            for i, (name, tensor) in enumerate(source()):  # type: ignore[misc]
                if i >= len(seen) or seen[i] != (name, tuple(tensor.shape)):
                    raise RuntimeError(f"weight source changed between validation and copy at item {i}")
                if is_ignored(name):
                    continue
                self.mapper.resolve(name).write(
                    tensor.detach(), non_blocking=tensor.device.type == "cpu" and tensor.is_pinned())
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # copies ran on this stream; the engine computes on its own
        return len(seen)

    def _validate(self, source: Source) -> list[tuple[str, tuple[int, ...]]]:
        seen: list[tuple[str, tuple[int, ...]]] = []
        flags: list[torch.Tensor] = []
        staging: torch.Tensor | None = None
        for i, item in enumerate(source()):
            if not (isinstance(item, tuple) and len(item) == 2):
                raise TypeError(f"update_weights expects (name, tensor) pairs; item {i} is {type(item).__name__}")
            name, tensor = item
            if not isinstance(name, str):
                raise TypeError(f"weight name of item {i} must be a str, got {type(name).__name__}")
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"weight {name!r} must be a torch.Tensor, got {type(tensor).__name__}")
            self.mapper.validate(name, tensor)
            seen.append((name, tuple(tensor.shape)))
            tensor = tensor.detach()
            if tensor.device.type == "cpu" and self.device.type == "cuda":
                need = tensor.numel() * tensor.element_size()
                if staging is None or staging.numel() < need:
                    staging = torch.empty(max(need, 64 << 20), dtype=torch.uint8, device=self.device)
                tensor = staging[:need].view(tensor.dtype).view(tensor.shape).copy_(
                    tensor, non_blocking=tensor.is_pinned())  # checked in order on this stream
                if len(flags) % 64 == 63:
                    torch.cuda.synchronize(self.device)  # bound the staged work queued ahead of the checks
            if not is_ignored(name):
                dtype = self.mapper.resolve(name)[0].dtype
                if tensor.dtype != dtype:  # finite as sent is not enough: 1e6 overflows float16
                    tensor = tensor.to(dtype)
            flags.append(torch.isfinite(tensor).all().to(self.device))
        if not seen:
            raise ValueError("update_weights got no tensors; pass the model's named parameters (name, tensor)")
        if flags:
            for (name, _), good in zip(seen, torch.stack(flags).tolist()):  # the one sync
                if not good:
                    raise ValueError(f"weight {name!r} has values that are not finite (nan/inf) in the engine's "
                                     "dtype (or overflow it); update rejected, nothing changed")
        return seen


def _as_source(named_tensors: object) -> Source:
    pairs = named_weights(named_tensors)  # the one coercion (a one-shot iterator is listed: references)
    return lambda: iter(pairs)
