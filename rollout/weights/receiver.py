"""An engine's end of every push from another process: the HTTP server's and each pool replica's.

``WeightReceiver(engine)`` joins the trainer's ``TransferGroup``, checks each push's metadata before any
byte moves (every name and shape with ``meta`` tensors through the engine's own ``WeightMapper``, and the
version through ``Engine.check_version``), posts the verdict, lands the bytes in a staging buffer kept
between pushes, and hands the views to ``Engine.update_weights`` at a step boundary (``run``: the
server runs it in its engine loop thread). A co-located push (``handles``) is checked the same way and
applied on views of the trainer's buckets. The staging buffer (a model's worth of bytes) is dropped
while the engine sleeps: by ``release_staging``, and again after a push that arrives while asleep.

One push at a time; after a TransferError the group is closed and must be joined anew (``join``),
while the engine keeps its old weights. SGLang's protocol (slime, AReaL) joins a ``NamedGroup`` instead
(``join_named``) and sends one broadcast per tensor without a verdict (``receive_each``): the bytes land
in the same staging buffer, and metadata the engine refuses is received, then dropped, so the trainer's
broadcasts never hang and nothing changes.
"""

from __future__ import annotations

import threading
import traceback
from collections.abc import Callable
from typing import Any

import torch

from rollout.weights.broadcast import receive_weights
from rollout.weights.group import (
    ForeignHandshake,
    PushRejected,
    TransferError,
    TransferGroup,
    cuda_device,
    post_verdict,
)
from rollout.weights.handles import BucketHandle, open_weights
from rollout.weights.layout import BUCKET_BYTES, TensorSpec, chunk_bounds, layout, tensor_views
from rollout.weights.torch_group import NamedGroup
from rollout.weights.vllm_nccl import PACKED_BUFFER_BYTES, VllmNcclGroup

Run = Callable[[Callable[[], int]], int]


class WeightReceiver:
    def __init__(self, engine: Any, run: Run | None = None) -> None:
        self.engine = engine
        self.run: Run = run or (lambda fn: fn())
        self.device = cuda_device(engine.device)  # built in the engine's thread: index resolved
        self.group: TransferGroup | VllmNcclGroup | None = None
        self.named: NamedGroup | None = None
        self._staging: torch.Tensor | None = None
        self._pushes = 0
        self._busy = threading.Lock()

    def join(self, master_address: str, master_port: int, world_size: int, rank: int = 1,
             backend: str | None = None, timeout_s: float = 600.0, packed: bool = True,
             buffer_bytes: int = PACKED_BUFFER_BYTES) -> TransferGroup | VllmNcclGroup:
        """Join the trainer's group as ``rank`` (blocks until every rank joined); replaces any old group.

        A trainer speaking vLLM's handshake (TRL's ``VLLMClient``) gets a ``VllmNcclGroup`` (CUDA only;
        ValueError at once elsewhere); ``packed`` and ``buffer_bytes`` are its init_info's."""
        backend = backend or ("nccl" if self.device.type == "cuda" else "gloo")
        if backend not in ("nccl", "gloo"):
            raise ValueError(f"backend must be 'nccl' or 'gloo', got {backend!r}")
        if backend == "nccl" and self.device.type != "cuda":
            raise ValueError(f"backend 'nccl' needs a CUDA engine; this one is on {self.device}: use 'gloo'")
        with self._exclusive():
            self.close()
            self._pushes = 0
            device = self.device if backend == "nccl" else torch.device("cpu")
            try:
                self.group = TransferGroup.join(master_address, master_port, rank, world_size, device, timeout_s)
            except ForeignHandshake as e:
                self.group = VllmNcclGroup(e.store, rank, world_size, self.device, timeout_s, packed, buffer_bytes)
            return self.group

    def join_named(self, master_address: str, master_port: int, world_size: int, rank: int, group_name: str,
                   backend: str | None = None, timeout_s: float = 600.0) -> NamedGroup:
        """Join an SGLang-style weight-update group as ``rank`` (blocks until every rank joined)."""
        backend = backend or ("nccl" if self.device.type == "cuda" else "gloo")
        with self._exclusive():
            self.close()
            self.named = NamedGroup(master_address, master_port, rank, world_size, group_name, backend, self.device,
                                    timeout_s)
            return self.named

    def receive_each(self, specs: list[TensorSpec], version: int | None = None, recompute_running: bool = True
                     ) -> int:
        """SGLang's push: one broadcast per tensor into the staging buffer, then ``Engine.update_weights``."""
        with self._exclusive():
            group = self.named
            if group is None:
                raise TransferError("no weight-update group: initialise one first (POST /init_weights_update_group)")
            error = self._check(specs, BUCKET_BYTES, version)
            offsets, total = layout(specs)
            if self._staging is None or self._staging.numel() < total or self._staging.device != group.device:
                self._staging = torch.empty(max(total, 1), dtype=torch.uint8, device=group.device)
            views = tensor_views(specs, offsets, self._staging)
            try:
                for _, view in views:
                    group.receive(view)
                if group.device.type == "cuda":
                    torch.cuda.current_stream(group.device).synchronize()
            except Exception as e:  # noqa: BLE001 - whatever the backend raises, the group is now unusable
                self.close()
                raise TransferError(f"weight transfer failed: {e}") from e
            if error is not None:
                raise PushRejected(error)
        return self._apply(views, version, recompute_running)

    def receive(self, specs: list[TensorSpec], bucket_bytes: int = BUCKET_BYTES, push_id: int | None = None,
                version: int | None = None, recompute_running: bool = True) -> int:
        """One broadcast push: verdict, bytes into staging, then ``Engine.update_weights``; the new version."""
        views = self.receive_views(specs, bucket_bytes, push_id, version)
        return self._apply(views, version, recompute_running)

    def receive_views(self, specs: list[TensorSpec], bucket_bytes: int = BUCKET_BYTES, push_id: int | None = None,
                      version: int | None = None) -> list[tuple[str, torch.Tensor]]:
        """The verdict and the bytes: (name, view of the staging buffer) pairs, nothing applied yet."""
        with self._exclusive():
            group = self.group
            if group is None:
                raise TransferError("no weight-transfer group: initialise one first (POST /init_weight_transfer)")
            if isinstance(group, VllmNcclGroup):
                return self._receive_vllm(group, specs, version)
            push_id = self._pushes if push_id is None else push_id
            self._pushes = push_id + 1
            error = self._check(specs, bucket_bytes, version)
            post_verdict(group, push_id, error)
            if error is not None:
                raise PushRejected(error)
            try:
                views, self._staging = receive_weights(group, specs, bucket_bytes, self._staging)
            except TransferError:
                self.close()
                raise
            return views

    def _receive_vllm(self, group: VllmNcclGroup, specs: list[TensorSpec], version: int | None
                      ) -> list[tuple[str, torch.Tensor]]:
        """vLLM's protocol has no verdict: the bytes are always received (the trainer's broadcasts must
        complete), then a refused push is dropped whole."""
        error = self._check(specs, BUCKET_BYTES, version)
        try:
            views = group.receive(specs)
        except Exception as e:  # noqa: BLE001 - whatever NCCL raises, the group is now unusable
            self.close()
            raise TransferError(f"weight transfer failed: {e}") from e
        if error is not None:
            views.clear()
            raise PushRejected(error)
        return views

    def receive_handles(self, specs: list[TensorSpec], handles: list[BucketHandle], version: int | None = None,
                        recompute_running: bool = True) -> int:
        """A co-located push: the same checks as a broadcast's, then ``Engine.update_weights`` on views of the
        trainer's buckets, which are unmapped before returning; the new version."""
        with self._exclusive():
            error = self._check(specs, BUCKET_BYTES, version)
            if error is not None:
                raise PushRejected(error)
            views: list = []
            buffers: list = []
            try:
                views, buffers = open_weights(specs, handles, self.device)
                return self._apply(views, version, recompute_running)
            except BaseException as e:
                traceback.clear_frames(e.__traceback__)  # its frames would keep views, so the mappings, alive
                raise
            finally:
                views.clear()
                buffers.clear()

    def _apply(self, views: list[tuple[str, torch.Tensor]], version: int | None, recompute_running: bool) -> int:
        try:
            return self.run(lambda: self.engine.update_weights(views, version, recompute_running))
        finally:
            views.clear()
            if self.engine.is_sleeping:  # pushed while asleep: the staging buffer goes again
                self.release_staging()

    def release_staging(self) -> int:
        """Drop the staging buffer kept between pushes (the engine sleeps; the next push allocates it again)
        and give it back to the driver; 0 while a transfer holds it. Returns the bytes dropped."""
        if not self._busy.acquire(blocking=False):
            return 0
        try:
            staging, self._staging = self._staging, None
        finally:
            self._busy.release()
        released = 0 if staging is None else staging.numel() * staging.element_size()
        del staging
        if released and self.device.type == "cuda":
            torch.cuda.empty_cache()  # back to the driver, where a co-located trainer allocates
        return released

    @property
    def staging_bytes(self) -> int:
        staging = self._staging
        return 0 if staging is None else staging.numel() * staging.element_size()

    def _check(self, specs: list[TensorSpec], bucket_bytes: int, version: int | None) -> str | None:
        try:
            chunk_bounds(1, bucket_bytes)
            if version is not None:
                self.engine.check_version(version)
            for s in specs:
                self.engine.weights.mapper.validate(s.name, torch.empty(s.shape, dtype=s.torch_dtype, device="meta"))
        except (TypeError, ValueError, KeyError) as e:
            return str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)  # KeyError's str() quotes
        return None

    def _exclusive(self) -> _Exclusive:
        return _Exclusive(self._busy)

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None
        if self.named is not None:
            self.named.close()
            self.named = None
        self._staging = None


class _Exclusive:
    def __init__(self, lock: threading.Lock) -> None:
        self.lock = lock

    def __enter__(self) -> None:
        if not self.lock.acquire(blocking=False):
            raise RuntimeError("a weight transfer is already in progress; one at a time")

    def __exit__(self, *exc: object) -> None:
        self.lock.release()
