"""Trainer weights -> engine: plain Hugging Face names, streaming all-or-nothing copies, in-flight swaps.

A trainer's ``named_parameters()`` rarely carries plain HF names: DDP adds ``module.``, FSDP1 and
activation checkpointing add wrapper segments, ``torch.compile`` adds ``_orig_mod.``, PEFT adds
``base_model.model.`` / ``.base_layer`` and adapter tensors that the engine never sees (they are merged
first). ``normalize_name`` maps all of these back, so the engine's ``WeightMapper`` stays the one
mapping from HF names to fused parameters.

``push_weights`` is what the trainer hooks call. It keeps the engine's contract (validate everything,
then copy in place, drop the prefix cache, move ``policy_version``) while streaming: a re-iterable
source is walked twice (validate, then copy) and a one-shot iterator keeps a host-side undo copy of
each slice it overwrote, so neither holds a second device copy of the model. Running sequences are
recomputed under the new weights, so every token is produced by exactly one policy given its whole
context — the property the per-token ``policy_versions`` and the trainer's teacher-forced logprobs
rely on.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from rollout.engine.sequence import SequenceStatus
from rollout.models.weights import WeightMapper, is_ignored

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


# ---- validate and copy --------------------------------------------------------------------------------
def _checked(mapper: WeightMapper, i: int, item: object) -> tuple[str, torch.Tensor]:
    """Name, shape and dtype kind of one item (finiteness is separate); the error names the tensor."""
    if not (isinstance(item, tuple) and len(item) == 2):
        raise TypeError(f"weights must be (name, tensor) pairs; item {i} is {type(item).__name__}")
    name, tensor = item
    if not isinstance(name, str):
        raise TypeError(f"weight name of item {i} must be a str, got {type(name).__name__}")
    mapper.validate(name, tensor)
    return name, tensor.detach()


def _non_finite(name: str) -> ValueError:
    return ValueError(f"weight {name!r} has non-finite values (nan/inf); update rejected, nothing changed")


def _destination(mapper: WeightMapper, name: str) -> torch.Tensor:
    param, rows = mapper.resolve(name)
    return param.data if rows is None else param.data[rows]


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Non-blocking from pinned memory (the caller synchronises once at the end); a re-iterable source
    holds its tensors, so they outlive the copies."""
    dst.copy_(src, non_blocking=src.device.type == "cpu" and src.is_pinned())


def _two_pass(mapper: WeightMapper, source: Callable[[], Iterator[Any]]) -> int:
    """Validate the whole source, then walk it again and copy: O(1 tensor) extra memory. Finiteness flags
    stay where the data is and are read with one synchronisation."""
    seen: list[tuple[str, tuple[int, ...]]] = []
    flags: list[torch.Tensor] = []
    for i, item in enumerate(source()):
        name, tensor = _checked(mapper, i, item)
        seen.append((name, tuple(tensor.shape)))
        flags.append(torch.isfinite(tensor).all())
    on_gpu = [i for i, f in enumerate(flags) if f.device.type != "cpu"]
    ok = [bool(f) if f.device.type == "cpu" else True for f in flags]
    if on_gpu:
        for i, good in zip(on_gpu, torch.stack([flags[i] for i in on_gpu]).cpu().tolist()):
            ok[i] = good
    if not all(ok):
        raise _non_finite(seen[ok.index(False)][0])
    with torch.no_grad():
        for i, (name, tensor) in enumerate(source()):
            if i >= len(seen) or seen[i] != (name, tuple(tensor.shape)):
                raise RuntimeError(f"weight source changed between its validation and copy passes at item {i}")
            if not is_ignored(name):
                _copy(_destination(mapper, name), tensor.detach())
    return len(seen)


def _undo_stream(mapper: WeightMapper, items: Iterator[Any]) -> int:
    """One pass over a one-shot iterator: copy each tensor as it arrives, keeping a host copy of what it
    replaced; any bad tensor (or an error in the iterator) restores everything before re-raising."""
    undo: list[tuple[torch.Tensor, torch.Tensor]] = []
    count = 0
    with torch.no_grad():
        try:
            for i, item in enumerate(items):
                name, tensor = _checked(mapper, i, item)
                if not bool(torch.isfinite(tensor).all()):
                    raise _non_finite(name)
                count += 1
                if is_ignored(name):
                    continue
                dst = _destination(mapper, name)
                undo.append((dst, dst.to("cpu", copy=True)))
                dst.copy_(tensor)  # blocking: a generator may refill the same buffer for its next item
        except BaseException:
            for dst, old in reversed(undo):  # reversed: tied names sharing storage end at the oldest value
                dst.copy_(old)
            raise
    return count


def stream_into(mapper: WeightMapper, named_tensors: NamedTensors) -> int:
    """Copy HF-named tensors into the mapper's model, all or nothing; returns how many were given.

    Accepts a module (its ``HFWeights``), a mapping, a re-iterable (list, ``HFWeights``: two passes) or
    a one-shot iterator / generator (one pass with a host-side undo copy).
    """
    if isinstance(named_tensors, nn.Module):
        named_tensors = HFWeights(named_tensors)
    if isinstance(named_tensors, Mapping):
        mapping = named_tensors
        return _two_pass(mapper, lambda: iter(mapping.items()))
    if isinstance(named_tensors, Iterator):
        return _undo_stream(mapper, named_tensors)
    if isinstance(named_tensors, Iterable) and not isinstance(named_tensors, (str, bytes)):
        iterable = named_tensors
        return _two_pass(mapper, lambda: iter(iterable))
    raise TypeError(
        "weights must be a module, a {name: tensor} mapping or an iterable of (name, tensor) pairs, "
        f"got {type(named_tensors).__name__}"
    )


# ---- the engine side ----------------------------------------------------------------------------------
def resolve_engine(target: Any) -> Any:
    """The engine behind an ``Engine`` or a ``RolloutActor`` (anything with ``.engine``)."""
    engine = getattr(target, "engine", target)
    for attr in ("update_weights", "scheduler", "block_manager", "weights"):
        if not hasattr(engine, attr):
            raise TypeError(f"expected a rollout Engine or RolloutActor, got {type(target).__name__}")
    return engine


def push_weights(target: Any, named_tensors: NamedTensors, version: int | None = None,
                 recompute_running: bool = True) -> int:
    """Swap weights into a live engine at a step boundary; returns the new ``policy_version``.

    A mapping or list goes through the engine's own ``WeightSync`` (it is already in memory); a module,
    ``HFWeights`` or other re-iterable is walked twice, a one-shot iterator once with an undo copy.

    Safe from any thread: it holds the engine's lock, so a concurrent ``step()`` sees old or new weights,
    never a mix. A step still in flight (async mode) is collected first, under the old version. With
    ``recompute_running`` (default) running sequences drop their KV and are recomputed with the new
    weights, so each later token is exactly the new policy's; a rejected update changes nothing.
    """
    engine = resolve_engine(target)
    if version is not None and (isinstance(version, bool) or not isinstance(version, int)):
        raise TypeError(f"version must be an int or None, got {version!r}")
    with engine._lock:
        _drain_inflight(engine)
        if isinstance(named_tensors, (Mapping, list, tuple)):
            engine.weights.apply(named_tensors)  # already in memory: the engine's own validate-then-copy
        else:
            stream_into(engine.weights.mapper, named_tensors)
        if engine.device.type == "cuda":
            # Copies ran on the current stream; the engine computes on its own stream, which would not
            # wait for them.
            torch.cuda.synchronize(engine.device)
        engine.block_manager.reset_prefix_cache()
        if recompute_running:
            recompute_running_seqs(engine)
        engine.policy_version = engine.policy_version + 1 if version is None else version
        return engine.policy_version


def _drain_inflight(engine: Any) -> None:
    """Land the sampled tokens of the step in flight (their KV and tokens belong to the old weights)."""
    pending = getattr(engine, "_inflight", None)
    if pending is not None:
        engine._inflight = None
        engine._postprocess(pending)


def recompute_running_seqs(engine: Any) -> int:
    """Send every running sequence back to the queue with its tokens kept and its KV freed, so the
    scheduler recomputes prompt + output under the current weights (sibling samples fork the prompt
    blocks again). Not counted as preemptions. Returns how many were sent back."""
    sched = engine.scheduler
    moved = list(sched.running)
    for seq in reversed(moved):
        assert seq.num_inflight == 0, "recompute with a sample in flight (drain first)"
        sched.running.remove(seq)
        engine.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        keys = [(s.arrival, s.seq_id) for s in sched.waiting]
        sched.waiting.insert(bisect.bisect(keys, (seq.arrival, seq.seq_id)), seq)
    return len(moved)


# ---- timing (called by the lead's bench script on the GPU) --------------------------------------------
def bench_weight_push(engine: Any, model: nn.Module, repeats: int = 3) -> dict[str, float]:
    """Seconds per full push of ``model``'s weights from device tensors, from pinned host tensors and
    through the one-shot (undo) path; GB/s counts the bytes of the source tensors."""
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
        "device_iterator": lambda: iter(on_device.items()),
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
