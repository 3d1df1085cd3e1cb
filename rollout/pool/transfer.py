"""The trainer's end of a pool push: ``WeightSender`` to the replicas' group, co-located ones map handles.

One implementation with the HTTP server's path: ``rollout.weights.sender.WeightSender`` hosts the group
(rank 0), waits for every replica's metadata verdict and broadcasts the flat buckets; each replica's
``WeightReceiver`` hands them to ``Engine.update_weights``. Only the control messages differ: this
class is the sender's ``Receivers``, reaching the replicas with Ray calls instead of HTTP.

The group spans the replicas that were active when it was made; a replica's death or replacement makes
it stale, and the next push builds a new one.

A replica co-located with the trainer (``RolloutPool(colocate_with_trainer=True)``) is no rank of the group
(NCCL refuses two ranks on one GPU): the same push packs the tensors into ``handles``' buckets on the
trainer's device and sends it only their handles, concurrently with the broadcast to the others. The
buckets stay alive until every co-located replica has answered, then they are freed (and their /dev/shm
files unlinked on the CPU). Every replica's engine decides its new version (``Engine.update_weights``)
and reports it; the pool records it once all agree and dispatches nothing until then.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from rollout.pool import ray_setup
from rollout.pool.colocate import check_source
from rollout.weights.handles import export_weights
from rollout.weights.layout import BUCKET_BYTES, TensorSpec, specs_of
from rollout.weights.sender import WeightSender

SETTLE_S = 30.0  # how long a failed push waits for every replica to be done with it


class PoolTransfer:
    def __init__(self, pool: Any, timeout_s: float) -> None:  # pool: the RolloutPool that owns this
        self.pool, self.timeout_s = pool, timeout_s
        self.sender = WeightSender(self, timeout_s)
        self.members: list[tuple[int, int]] = []  # (replica index, actor generation) of ranks 1..N
        self.version = 0  # what every replica reported after the last push (their engines decide it)
        self.last_push: dict[str, Any] = {}

    @property
    def group(self) -> Any:
        """The open ``TransferGroup`` (None: none; the next push opens one)."""
        return self.sender.group

    def invalidate(self) -> None:
        self.close()

    def close(self) -> None:
        self.sender.close()
        for i, gen in self.members:
            m = self.pool.members[i] if i < len(self.pool.members) else None
            if m is not None and m.generation == gen:
                m.actor.leave_weight_group.remote()
        self.members = []

    def _current(self, colocated: bool = False) -> list[tuple[int, int]]:
        """(index, generation) of the active replicas that take weights by broadcast (or, by handle)."""
        return [(i, m.generation) for i, m in enumerate(self.pool.members)
                if m.state == "active" and m.colocated == colocated]

    def open(self, device: torch.device) -> None:
        """Host a group of every active replica (ranks in replica order) and wait for all to join."""
        self.close()
        self.members = self._current()
        self.sender.open(device, len(self.members) + 1, ray_setup.driver_address(self.pool.address))

    def push(self, pairs: list[tuple[str, torch.Tensor]], version: int | None, recompute_running: bool,
             bucket_bytes: int | None) -> int:
        """Send ``pairs`` (references) to every active replica; the version they all reached."""
        pool = self.pool
        bucket_bytes = bucket_bytes or BUCKET_BYTES
        specs = specs_of(pairs)
        if self._current() and (self.sender.group is None or self.members != self._current()) and pool._reap_dead():
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
                device = next((t.device for _, t in pairs if t.device.type == "cuda"), torch.device("cpu"))
                group = self.sender.group
                if group is None or self.members != self._current() or group.device.type != device.type:
                    self.open(device)
                refs = self.sender.send(specs, pairs, version, recompute_running, bucket_bytes)
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
        self.version = versions[0]
        self.last_push = {"tensors": len(specs), "bytes": sum(s.nbytes for s in specs), "replicas": len(versions),
                          "by_broadcast": len(versions) - len(handle_refs), "by_handle": len(handle_refs)}
        return versions[0]

    # ---- the sender's ``Receivers``: the group's replicas, reached by Ray calls -----------------------------
    def join(self, address: str, port: int, world_size: int, backend: str, timeout_s: float) -> Callable[[bool], None]:
        ray, members = self.pool.ray, self.pool.members
        refs = [members[i].actor.join_weight_group.remote(address, port, world_size, rank, backend, timeout_s)
                for rank, (i, _) in enumerate(self.members, start=1)]

        def check(wait: bool) -> None:
            answered = refs if wait else ray.wait(refs, num_returns=len(refs), timeout=0)[0]
            ray.get(answered)  # a replica that could not join raises here (its error, or its death)

        return check

    def announce(self, specs: list[TensorSpec], push_id: int, bucket_bytes: int, version: int | None,
                 recompute_running: bool) -> list[Any]:
        return [self.pool.members[i].actor.receive_weights.remote(specs, push_id, version, bucket_bytes,
                                                                  recompute_running)
                for i, _ in self.members]

    def alive(self, refs: list[Any]) -> bool:
        return not self.pool.ray.wait(refs, num_returns=len(refs), timeout=0)[0]

    def refused(self, refs: list[Any]) -> None:
        self._settle(refs)  # a refusing replica returns right after its verdict: the next push must not meet it
        self._raise_first(refs)

    def broken(self, refs: list[Any]) -> None:
        self._settle(refs)
        self._raise_first(refs)  # a replica's death (RayActorError) says why the transport broke

    def _settle(self, refs: list[Any]) -> None:
        """Wait (bounded) until every replica is done with this push. A replica posts its refusal before its call
        returns and frees its receiver; a push announced in between was refused as 'already in progress' (seen
        in CI: the pool's bad-version pushes back to back)."""
        self.pool.ray.wait(refs, num_returns=len(refs), timeout=SETTLE_S)

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
