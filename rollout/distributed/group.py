"""The tensor-parallel group one model shard belongs to.

Layers receive it explicitly (no module-level "current group"): a model built with ``TPGroup.single()``
communicates nothing and computes exactly what the unsharded model does. The collectives are the
plain ``torch.distributed`` ones, so they run over gloo on the CPU (tests) and NCCL on CUDA, where
they can be captured inside CUDA graphs once warmed up. With ``tp_all_reduce="symm_mem"`` (opt-in, CUDA) the
all-reduces that fit its buffer go through PyTorch's symmetric memory instead (``symm_mem.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from rollout.distributed.symm_mem import SymmMemAllReduce, SymmMemSpec

# torch >= 2.13 renamed all_gather_into_tensor (the old name warns).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True, slots=True)
class TPGroup:
    rank: int
    world_size: int
    group: Any = None  # a torch.distributed ProcessGroup; None only when world_size == 1
    _mode: _Mode = field(default_factory=lambda: _Mode(), compare=False, repr=False)
    symm: SymmMemAllReduce | None = field(default=None, compare=False, repr=False)  # None: every all-reduce by pg

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside a group of {self.world_size}")
        if self.world_size > 1 and self.group is None:
            raise ValueError("a tensor-parallel group of more than one rank needs a process group")

    @classmethod
    def single(cls) -> TPGroup:
        return cls(0, 1, None)

    @classmethod
    def create(cls, store: Any, rank: int, world_size: int, device: torch.device,
               timeout: timedelta = timedelta(minutes=10), symm_mem: SymmMemSpec | None = None) -> TPGroup:
        """A process group of its own over ``store`` (gloo on the CPU, NCCL on CUDA), without
        ``init_process_group``: the engine's process may be a trainer with a default group of its own.
        ``symm_mem``: also rendezvous a symmetric buffer of that size (CUDA; every rank passes the same)."""
        if world_size == 1:
            return cls.single()
        store = dist.PrefixStore("rollout_tp/", store)
        pg = dist.ProcessGroup(store, rank, world_size)
        if device.type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            backend, kind = dist.ProcessGroupNCCL(store, rank, world_size, opts), dist.ProcessGroup.BackendType.NCCL
        else:
            backend = dist.ProcessGroupGloo(store, rank, world_size, timeout)
            kind = dist.ProcessGroup.BackendType.GLOO
        pg._set_default_backend(kind)
        backend._set_sequence_number_for_group()
        pg._register_backend(torch.device(device.type), kind, backend)
        symm = None if symm_mem is None else SymmMemAllReduce.create(pg, store, rank, device, symm_mem)
        return cls(rank, world_size, pg, symm=symm)

    @classmethod
    def from_default_group(cls) -> TPGroup:
        """The whole default process group (``dist.init_process_group`` already called)."""
        return cls(dist.get_rank(), dist.get_world_size(), dist.group.WORLD)

    @property
    def is_parallel(self) -> bool:
        return self.world_size > 1

    def split(self, n: int, what: str) -> slice:
        """This rank's equal part of ``n`` items; ``what`` names them in the error when ``n`` does not divide."""
        return split_evenly(n, self.rank, self.world_size, what)

    @property
    def communicates(self) -> bool:
        """Whether collectives reach the other ranks now (not inside ``local()``)."""
        return self.world_size > 1 and not self._mode.local

    @contextlib.contextmanager
    def local(self) -> Iterator[None]:
        """Collectives become local stand-ins with the same shapes and allocations (all_reduce leaves
        ``x`` as it is, all_gather repeats this rank's part), for work one rank does alone while its
        peers do something else: the KV sizing's dummy steps, which only measure memory. A real
        collective there would wait for peers that never join it."""
        before, self._mode.local = self._mode.local, True
        try:
            yield
        finally:
            self._mode.local = before

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place; returns ``x``."""
        if self.communicates:
            if self.symm is not None and self.symm.fits(x):
                self.symm.all_reduce(x)
            else:
                dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[*s] per rank -> [world_size, *s], in rank order."""
        if self.world_size == 1:
            return x[None]
        out = torch.empty(self.world_size * x.numel(), dtype=x.dtype, device=x.device)
        if self.communicates:
            _all_gather_single(out, x.contiguous().view(-1), group=self.group)  # flat: gloo takes no stacked form
        else:
            out.view(self.world_size, -1).copy_(x.reshape(1, -1).expand(self.world_size, -1))
        return out.view(self.world_size, *x.shape)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank ``src``'s ``x`` everywhere, in place; returns ``x``."""
        if self.communicates:
            dist.broadcast(x, group=self.group, group_src=src)
        return x


class _Mode:
    """The group's one switch (``TPGroup.local``), kept apart so the group itself stays frozen."""

    __slots__ = ("local",)

    def __init__(self) -> None:
        self.local = False


def split_evenly(n: int, rank: int, world_size: int, what: str) -> slice:
    """Rank ``rank``'s equal part of ``n`` items; ValueError naming ``what`` when ``n`` does not divide."""
    if n % world_size:
        raise ValueError(f"{what} ({n}) must be divisible by tensor_parallel_size ({world_size})")
    size = n // world_size
    return slice(rank * size, (rank + 1) * size)
