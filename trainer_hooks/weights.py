"""Trainer weights -> a rollout backend: ``push_weights(backend, model)``, in-flight swaps.

``push_weights`` is what the trainer hooks call, on an ``Engine``, a ``RolloutPool`` or a
``RolloutClient``: each one's ``update_weights`` normalises the names (DDP, torch.compile, FSDP, PEFT;
``rollout.weights.names``) and ends in ``Engine.update_weights`` (validate everything, then copy in
place; running sequences recomputed under the new weights, so every token is produced by exactly one
policy given its whole context — the property the per-token ``policy_versions`` and the trainer's
teacher-forced logprobs rely on).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from rollout.api import require_backend
from rollout.weights.names import HFWeights, normalize_name

__all__ = ["HFWeights", "bench_weight_push", "normalize_name", "push_weights"]

NamedTensors = Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor] | nn.Module


def push_weights(target: Any, named_tensors: NamedTensors, version: int | None = None,
                 recompute_running: bool = True) -> int:
    """Swap a trainer's weights into a live backend at a step boundary; returns the new ``policy_version``.

    ``target``'s own ``update_weights`` (an ``Engine``, a ``RolloutPool``, a ``RolloutClient``): names
    normalised, everything validated before anything is copied (a module or any re-iterable is walked twice,
    never copied), a step in flight collected under the old version, the prefix cache dropped and, with
    ``recompute_running``, running sequences recomputed. Safe from any thread.
    """
    backend = require_backend(target, "push_weights")
    return backend.update_weights(named_tensors, version=version, recompute_running=recompute_running)


# ---- timing (called by the lead's bench script on the GPU) --------------------------------------------
def bench_weight_push(engine: Any, model: nn.Module, repeats: int = 3) -> dict[str, float]:
    """Seconds per full push of ``model``'s weights from device tensors (mapping and iterator) and from
    pinned host tensors; GB/s counts the bytes of the source tensors."""
    engine = require_backend(engine, "bench_weight_push")
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
