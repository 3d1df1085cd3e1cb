"""The trainer's end of a pool push: rank 0 broadcasts to the replicas' group, co-located ones map handles.

One implementation with the HTTP server's path: ``transfer_group.TransferGroup`` (a ``TCPStore`` and a
directly constructed ``ProcessGroupGloo`` / ``ProcessGroupNCCL``), ``weight_transfer.send_weights``'s
flat double-buffered buckets, the receivers' metadata verdicts before any byte moves, and
``Engine.update_weights`` on arrival. Only the control messages differ: Ray calls instead of HTTP.

The group spans the replicas that were active when it was made; a replica's death or replacement makes
it stale, and the next push builds a new one.

A replica co-located with the trainer (``RolloutPool(colocate_with_trainer=True)``) is no rank of the group
(NCCL refuses two ranks on one GPU): the same push packs the tensors into ``weight_handles``' buckets on the
trainer's device and sends it only their handles, concurrently with the broadcast to the others. The
buckets stay alive until every co-located replica has answered, then they are freed (and their /dev/shm
files unlinked on the CPU). Both kinds apply the push with ``Engine.update_weights`` and report the
version; the pool dispatches nothing until all have.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import torch

from rollout.weights.group import PushRejected, TransferError, TransferGroup, await_verdicts
from rollout.weights.handles import export_weights
from rollout.weights.broadcast import BUCKET_BYTES, TensorSpec, dtype_name, send_weights
from rollout.pool import ray_setup
from rollout.pool.colocate import check_source

if TYPE_CHECKING:
    from rollout.pool.pool import RolloutPool


class PoolTransfer:
    def __init__(self, pool: RolloutPool, timeout_s: float) -> None:
        self.pool, self.timeout_s = pool, timeout_s
        self.group: TransferGroup | None = None
        self.members: list[tuple[int, int]] = []  # (replica index, actor generation) of ranks 1..N
        self.push_id = 0
        self.last_push: dict[str, Any] = {}

    def invalidate(self) -> None:
        self.close()

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None
            for i, gen in self.members:
                m = self.pool.members[i] if i < len(self.pool.members) else None
                if m is not None and m.generation == gen:
                    m.actor.leave_weight_group.remote()

    def _current(self, colocated: bool = False) -> list[tuple[int, int]]:
        """(index, generation) of the active replicas that take weights by broadcast (or, by handle)."""
        return [(i, m.generation) for i, m in enumerate(self.pool.members)
                if m.state == "active" and m.colocated == colocated]

    def open(self, device: torch.device) -> TransferGroup:
        """Host a group of every active replica (ranks in replica order) and wait for all to join."""
        self.close()
        ray, pool = self.pool.ray, self.pool
        members = self._current()
        world = len(members) + 1
        address = ray_setup.driver_address(pool.address)
        backend = "nccl" if device.type == "cuda" else "gloo"
        joins: list[Any] = []

        def tell_replicas(port: int) -> None:
            refs = [pool.members[i].actor.join_weight_group.remote(address, port, world, rank, backend,
                                                                  self.timeout_s)
                    for rank, (i, _) in enumerate(members, start=1)]
            joins.extend(refs)  # one atomic extend: the waiting thread sees none or all

        opening: Future = Future()
        threading.Thread(target=_run_into, args=(opening, TransferGroup.open_trainer, device, world, address, 0,
                                                 self.timeout_s, tell_replicas), daemon=True).start()
        while not opening.done():
            snapshot = list(joins)
            answered = ray.wait(snapshot, num_returns=len(snapshot), timeout=0.01)[0] if snapshot else []
            if not snapshot:
                time.sleep(0.01)
            for ref in answered:
                ray.get(ref)  # a replica that could not join raises here (its error, or its death)
        self.group = opening.result()
        ray.get(joins)
        self.members, self.push_id = members, 0
        return self.group

    def push(self, pairs: list[tuple[str, torch.Tensor]], version: int | None, recompute_running: bool,
             bucket_bytes: int | None) -> int:
        """Send ``pairs`` (from ``pairs(...)``) to every active replica; the version they all reached."""
        pool = self.pool
        bucket_bytes = bucket_bytes or BUCKET_BYTES
        specs = [TensorSpec(name, dtype_name(t.dtype), tuple(t.shape)) for name, t in pairs]
        if not specs:
            raise ValueError("a weight push needs at least one tensor")
        version = pool.policy_version + 1 if version is None else version
        if self._current() and (self.group is None or self.members != self._current()) and pool._reap_dead():
            pool.wait_ready()  # a group opens below and a survivor's join cannot be called off: replace the dead first
        by_handle = self._current(colocated=True)
        exported = None
        if by_handle:
            assert pool.place is not None
            check_source(pairs, pool.place)  # before anything moves: a clear error, every replica untouched
            exported = export_weights(specs, pairs, pool.place.device, bucket_bytes)
        handle_refs: list[Any] = []
        try:
            handle_refs = [pool.members[i].actor.receive_weights_by_handle.remote(specs, exported.handles, version,
                                                                                 recompute_running)
                           for i, _ in by_handle]  # type: ignore[union-attr]
            if self._current():
                refs = self._broadcast(pairs, specs, version, recompute_running, bucket_bytes)
            else:
                refs = []
                self.close()  # every active replica takes handles: no group
            versions = self._gather(refs + handle_refs)
        finally:
            if exported is not None:  # the co-located replicas map these buckets until they answer
                if handle_refs:
                    pool.ray.wait(handle_refs, num_returns=len(handle_refs), timeout=self.timeout_s)
                exported.release()
        if len(set(versions)) != 1:
            raise RuntimeError(f"replicas disagree on policy_version after a push: {versions}")
        self.last_push = {"tensors": len(specs), "bytes": sum(s.nbytes for s in specs), "replicas": len(versions),
                          "by_broadcast": len(versions) - len(handle_refs), "by_handle": len(handle_refs)}
        return versions[0]

    def _broadcast(self, pairs: list[tuple[str, torch.Tensor]], specs: list[TensorSpec], version: int,
                   recompute_running: bool, bucket_bytes: int) -> list[Any]:
        """Rank 0's half of a push to the group; the receivers' refs (their answers are gathered later)."""
        ray, pool = self.pool.ray, self.pool
        device = next((t.device for _, t in pairs if t.device.type == "cuda"), torch.device("cpu"))
        if self.group is None or self.members != self._current() or self.group.device.type != device.type:
            self.open(device)
        group = self.group
        assert group is not None
        push_id, self.push_id = self.push_id, self.push_id + 1
        refs = [pool.members[i].actor.receive_weights.remote(specs, push_id, version, bucket_bytes, recompute_running)
                for i, _ in self.members]
        try:
            await_verdicts(group, push_id, alive=lambda: not ray.wait(refs, num_returns=len(refs), timeout=0)[0])
        except PushRejected:
            self._raise_first(refs)
            raise
        except TransferError:
            self.close()
            self._raise_first(refs)
            raise
        try:
            send_weights(group, specs, pairs, bucket_bytes)
        except BaseException:
            self.close()  # the receivers fail fast on the closed connection and keep their old weights
            ray.wait(refs, num_returns=len(refs), timeout=30)
            self._raise_first(refs)  # a replica's death (RayActorError) says why the transport broke
            raise
        return refs

    def _gather(self, refs: list[Any]) -> list[int]:
        """Every replica's new version; a replica's own refusal (or death) is raised as itself."""
        self.pool.ray.wait(refs, num_returns=len(refs), timeout=self.timeout_s)
        self._raise_first(refs)
        return self.pool.ray.get(refs, timeout=self.timeout_s)

    def _raise_first(self, refs: list[Any]) -> None:
        """Re-raise a replica's own refusal (ValueError naming the tensor) when it has one."""
        ray = self.pool.ray
        errors: list[BaseException] = []
        for ref in ray.wait(refs, num_returns=len(refs), timeout=0)[0]:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError:
                raise  # a death explains the others' broken transport: it comes first
            except ray.exceptions.RayTaskError as e:
                errors.append(e.as_instanceof_cause())
        if errors:
            raise errors[0]


def pairs(named_tensors: Any) -> list[tuple[str, torch.Tensor]]:
    """References to the tensors (walked twice: metadata, then data), never copies."""
    if isinstance(named_tensors, torch.nn.Module):
        named_tensors = named_tensors.named_parameters()  # plain HF names; trainer_hooks.push_weights normalises
    if isinstance(named_tensors, Mapping):
        named_tensors = named_tensors.items()
    if isinstance(named_tensors, (str, bytes)) or not isinstance(named_tensors, Iterable):
        raise TypeError("update_weights expects a {name: tensor} mapping or an iterable of (name, tensor) pairs, "
                        f"got {type(named_tensors).__name__}")
    pairs = list(named_tensors)
    for i, item in enumerate(pairs):
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
                and isinstance(item[1], torch.Tensor)):
            raise TypeError(f"update_weights expects (name, tensor) pairs; item {i} is {item!r:.80}")
    return [(n, t.detach()) for n, t in pairs]


def _run_into(fut: Future, fn: Any, *args: Any) -> None:
    try:
        fut.set_result(fn(*args))
    except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
        fut.set_exception(e)
