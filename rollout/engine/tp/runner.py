"""Tensor parallelism inside one engine: rank 0 is the engine's process, ranks 1 .. N-1 are workers.

The scheduler runs once, here. ``TPRunner`` sends each plan to every worker and then runs it on
rank 0's own runner (the same class the workers run), so the collectives inside the forward and the
sampler meet; only rank 0's pending step is read back. ``TPWeightSync`` keeps ``update_weights``
all-or-nothing across ranks: rank 0 validates the full tensors, every worker validates names and
shapes against its own shard, and only when all agree is each tensor broadcast and sharded on arrival.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from rollout.config import EngineConfig
from rollout.distributed.group import TPGroup
from rollout.distributed.symm_mem import SymmMemSpec, check_symm_mem_start, symm_mem_spec
from rollout.engine import loading
from rollout.engine.plan import BatchPlan, SampleResult
from rollout.engine.tp.rank import WorkerSpec
from rollout.engine.tp.workers import TPWorkers
from rollout.layers.backends import AttentionSpec
from rollout.layers.parallel import check_tp_shapes
from rollout.models.loader import missing_weights
from rollout.models.weights import is_ignored
from rollout.weights.apply import WeightSync, _as_source


def start_tensor_parallel(source: object, dtype: str | torch.dtype, device: torch.device,
                          config: EngineConfig) -> tuple[torch.nn.Module, Any, TPWorkers]:
    """Rank 0's shard, the HF config and the running workers (each with its shard loaded)."""
    n = config.tensor_parallel_size
    check_symm_mem_start(config, device)
    hf_config = loading.source_config(source)
    check_tp_shapes(hf_config, n)
    if device.type == "cuda":
        first, count = device.index or 0, torch.cuda.device_count()
        if first + n > count:
            raise ValueError(f"tensor_parallel_size={n} needs {n} GPUs from cuda:{first}, but {count} are visible")
    torch_dtype = loading.resolve_dtype(dtype, hf_config, device)
    symm = symm_mem_spec(config, hf_config.hidden_size, torch_dtype)
    checkpoint = str(source) if isinstance(source, (str, os.PathLike)) else None
    store = dist.TCPStore("127.0.0.1", 0, n, is_master=True, wait_for_workers=False, timeout=timedelta(minutes=10))
    workers = TPWorkers(WorkerSpec(hf_config, checkpoint, torch_dtype, str(device), n, store.port,
                                   torch.get_num_threads(), symm))
    workers.store = store  # the rendezvous lives as long as the workers
    try:
        tp = _join_group(store, n, device, workers, symm)
        workers.on_death = lambda: _abort(tp)
        model = loading.build_shard(hf_config, checkpoint, torch_dtype, device, tp)
        workers.replies()  # every worker has built (and, from a checkpoint, loaded) its shard
        if checkpoint is None:
            TPWeightSync(model, workers).apply(_NamedParameters(source), require_all=True)
    except BaseException:
        workers.shutdown()
        raise
    return model, hf_config, workers


def _abort(tp: TPGroup) -> None:
    """Abort rank 0's communicators so a collective waiting for a dead peer raises instead of hanging."""
    for abort in (getattr(tp.group, "abort", None),
                  getattr(_backend(tp), "abort", None)):
        if abort is not None:
            try:
                abort()
                return
            except Exception:  # noqa: BLE001 - best effort: the error is reported by the caller
                continue


def _backend(tp: TPGroup) -> Any:
    try:
        return tp.group._get_backend(torch.device("cuda"))
    except Exception:  # noqa: BLE001 - no CUDA backend (gloo)
        return None


class _NamedParameters:
    """``source.named_parameters()`` afresh on every pass, so weights stream one tensor at a time
    (a one-shot iterator would be listed whole first)."""

    def __init__(self, source: Any) -> None:
        self.source = source

    def __iter__(self) -> Any:
        return iter(self.source.named_parameters())


def _join_group(store: Any, n: int, device: torch.device, workers: TPWorkers, symm: SymmMemSpec | None) -> TPGroup:
    """Rank 0's side of the rendezvous, watching the workers: one that dies while starting is reported
    at once instead of leaving rank 0 waiting for it until the timeout."""
    box: dict[str, Any] = {}

    def join() -> None:
        try:
            box["tp"] = TPGroup.create(store, 0, n, device, symm_mem=symm)
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            box["error"] = e

    thread = threading.Thread(target=join, name="rollout-tp-rendezvous", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(timeout=0.2)
        workers.check()
    if "error" in box:
        raise box["error"]
    return box["tp"]


def _out_of_step(workers: TPWorkers, exc: BaseException) -> None:
    """Rank 0's step raised after the workers were sent it. Name a dead worker if that was the cause;
    otherwise the workers are left inside collectives rank 0 will never join, so nothing can be
    rolled back: stop the engine (the caller re-raises ``exc``) rather than pair the next step's
    collectives with this one's."""
    workers.explain(exc)
    workers.halt(f"rank 0's step raised {type(exc).__name__}: {exc}; the ranks were out of step")


class TPPending:
    def __init__(self, inner: Any, workers: TPWorkers) -> None:
        self.inner, self.workers, self.plan = inner, workers, inner.plan

    def result(self) -> SampleResult:
        try:
            return self.inner.result()
        except BaseException as e:
            _out_of_step(self.workers, e)
            raise


class TPRunner:
    """The ``Runner`` protocol over every rank: rank 0's own runner plus the workers'."""

    def __init__(self, inner: Any, workers: TPWorkers, config: EngineConfig, attn: AttentionSpec,
                 max_model_len: int, num_blocks: int) -> None:
        self.inner, self.workers = inner, workers
        workers.call("init_kv", config, attn, max_model_len, num_blocks)

    def execute(self, plan: BatchPlan) -> TPPending:
        self.workers.send("execute", plan)
        try:
            pending = self.inner.execute(plan)
        except BaseException as e:
            _out_of_step(self.workers, e)
            raise
        return TPPending(pending, self.workers)

    def reset(self) -> None:
        self.inner.reset()
        if self.workers.error is None:  # a dead rank has already stopped the engine; say so once
            self.workers.send("reset")

    def release(self) -> None:
        self.workers.call("release")
        self.inner.release()

    def restore(self) -> None:
        self.workers.call("restore")
        self.inner.restore()

    @property
    def compute_seconds(self) -> float | None:
        return self.inner.compute_seconds


class TPWeightSync(WeightSync):
    def __init__(self, model: torch.nn.Module, workers: TPWorkers) -> None:
        super().__init__(model)
        self.workers, self.tp = workers, model.tp

    def apply(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
              require_all: bool = False) -> int:
        """Validate on every rank, agree, then broadcast and copy; nothing changes anywhere if any
        rank objects. ``require_all``: every parameter must be given (the first load)."""
        source = _as_source(named_tensors)
        seen = self._validate(source)  # streamed passes: never more than one tensor of the source held
        manifest = [(name, tuple(t.shape), t.dtype) for name, t in source() if not is_ignored(name)]  # type: ignore[misc]
        if require_all:
            missing = missing_weights(self.mapper, [name for name, _, _ in manifest])
            if missing:
                raise ValueError(f"{len(missing)} weight(s) of {self.mapper.model_name} were not provided: "
                                 f"{missing[:8]}")
        problems = [p for p in self.workers.call("validate_weights", manifest) if p]
        if problems:
            raise ValueError(f"{problems[0]}; update rejected, nothing changed")
        self.workers.send("copy_weights")
        try:
            self._broadcast(source, manifest)
        except Exception as e:
            self.workers.explain(e)
            raise
        self.workers.replies()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return len(seen)

    def _broadcast(self, source: Any, manifest: list[tuple[str, tuple[int, ...], torch.dtype]]) -> None:
        i = 0
        with torch.no_grad():
            for name, tensor in source():
                if is_ignored(name):
                    continue
                if i >= len(manifest) or manifest[i] != (name, tuple(tensor.shape), tensor.dtype):
                    break
                full = tensor.detach().to(self.device, non_blocking=tensor.is_pinned()).contiguous()
                self.mapper.resolve(name).write(self.tp.broadcast(full, src=0))
                i += 1
        if i != len(manifest):  # the workers wait for tensors that will not come: stop them
            self.workers.stop(f"the weight source changed between validation and copy at tensor {i}")
