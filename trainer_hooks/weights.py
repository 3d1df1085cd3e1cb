"""Trainer weights -> engine: plain Hugging Face names, streaming all-or-nothing copies, in-flight swaps.

A trainer's ``named_parameters()`` rarely carries plain HF names: DDP adds ``module.``, FSDP1 and
activation checkpointing add wrapper segments, ``torch.compile`` adds ``_orig_mod.``, PEFT adds
``base_model.model.`` / ``.base_layer`` and adapter tensors that the engine never sees (they are merged
first). ``normalize_name`` maps all of these back, so the engine's ``WeightMapper`` stays the one
mapping from HF names to fused parameters.

``push_weights`` is what the trainer hooks call: names normalised, then ``Engine.update_weights``
(validate everything, then copy in place; running sequences recomputed under the new weights, so every
token is produced by exactly one policy given its whole context — the property the per-token
``policy_versions`` and the trainer's teacher-forced logprobs rely on).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

NamedTensors = Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor] | nn.Module

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

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        seen: set[str] = set()
        for name, param in self.model.named_parameters():
            hf_name = normalize_name(name)
            if hf_name is None or hf_name in seen:
                continue
            seen.add(hf_name)
            tensor = param.full_tensor() if hasattr(param, "full_tensor") else param
            yield hf_name, tensor.detach()

    def names(self) -> list[str]:
        return [n for n, _ in self]


class _Normalized:
    """Re-iterable view of ``(name, tensor)`` pairs under plain HF names (adapter-only tensors dropped)."""

    def __init__(self, pairs: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.pairs = pairs

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for item in self.pairs:
            if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
                name = normalize_name(item[0])
                if name is None:
                    continue
                yield name, item[1]
            else:
                yield item  # malformed: let the engine name the problem


def resolve_engine(target: Any) -> Any:
    """The engine behind an ``Engine`` or a ``RolloutActor`` (anything with ``.engine``)."""
    engine = getattr(target, "engine", target)
    if not hasattr(engine, "update_weights") or not hasattr(engine, "policy_version"):
        raise TypeError(f"expected a rollout Engine or RolloutActor, got {type(target).__name__}")
    return engine


def push_weights(target: Any, named_tensors: NamedTensors, version: int | None = None,
                 recompute_running: bool = True) -> int:
    """Swap a trainer's weights into a live engine at a step boundary; returns the new ``policy_version``.

    Names are normalised (DDP, torch.compile, FSDP, PEFT) and the rest is ``Engine.update_weights``:
    validate everything, then copy in place (a module or any re-iterable is walked twice, never copied),
    collect a step in flight under the old version, drop the prefix cache and, with
    ``recompute_running``, recompute running sequences under the new weights. Safe from any thread.
    """
    engine = resolve_engine(target)
    if isinstance(named_tensors, nn.Module):
        source: Any = HFWeights(named_tensors)
    elif isinstance(named_tensors, Mapping):
        source = _Normalized(list(named_tensors.items()))
    elif isinstance(named_tensors, Iterator):
        source = _Normalized(list(named_tensors))  # references, so the engine can walk it twice
    elif isinstance(named_tensors, HFWeights):
        source = named_tensors
    elif isinstance(named_tensors, Iterable) and not isinstance(named_tensors, (str, bytes)):
        source = _Normalized(named_tensors)
    else:
        raise TypeError(
            "weights must be a module, a {name: tensor} mapping or an iterable of (name, tensor) pairs, "
            f"got {type(named_tensors).__name__}"
        )
    return engine.update_weights(source, version=version, recompute_running=recompute_running)


# ---- timing (called by the lead's bench script on the GPU) --------------------------------------------
def bench_weight_push(engine: Any, model: nn.Module, repeats: int = 3) -> dict[str, float]:
    """Seconds per full push of ``model``'s weights from device tensors (mapping and iterator) and from
    pinned host tensors; GB/s counts the bytes of the source tensors."""
    engine = resolve_engine(engine)
    device = engine.device
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    on_device = {n: t.to(device) for n, t in HFWeights(model)}
    host = {n: t.to("cpu", copy=True) for n, t in on_device.items()}
    if cuda:
        host = {n: t.pin_memory() for n, t in host.items()}
    nbytes = sum(t.numel() * t.element_size() for t in on_device.values())
    results: dict[str, float] = {"bytes": float(nbytes)}
    cases: dict[str, Callable[[], Any]] = {
        "device": lambda: on_device,
        "pinned_host": lambda: host,
        "device_iterator": lambda: iter(list(on_device.items())),
    }
    for label, make in cases.items():
        times = []
        for _ in range(repeats):
            source = make()
            sync()
            t0 = time.perf_counter()
            push_weights(engine, source)
            sync()
            times.append(time.perf_counter() - t0)
        best = min(times)
        results[f"{label}_s"] = best
        results[f"{label}_gbps"] = nbytes / best / 1e9
    return results
