"""Weights from another process: one flat byte stream, broadcast in buckets, received whole before any copy.

The sender (a trainer, rank 0) and every receiver (an engine, ranks 1..N) derive the same layout from the
same metadata (names, dtypes, shapes): each tensor's bytes sit at an aligned offset of one flat stream,
which travels in chunks of at most ``bucket_bytes``. The sender packs chunk k+1 into one of two buffers
while chunk k is on the wire (double buffering). A receiver lands every chunk straight into one staging
buffer, so nothing is unpacked: each tensor is a view of it. Only when every byte has arrived are the
views handed to ``Engine.update_weights``, which validates them all before copying any, so a broken
connection or a trainer killed mid-push leaves the old weights serving.

Before any byte moves, each receiver checks every name and shape against its engine (with ``meta``
tensors, through the engine's own ``WeightMapper.validate``) and posts its verdict in the group's store;
the sender waits for every verdict, so a rejected push fails fast on both sides and the group stays usable.

The group is ``transfer_group.TransferGroup``. Nothing here knows about HTTP or engines: the server and
the Ray pool both build on it. An engine on the trainer's own GPU cannot be a rank (NCCL refuses two ranks
on one GPU): ``weight_handles`` shares the same layout's buckets with it by handle instead, and
``WeightReceiver.receive_handles`` applies them with the same checks.
"""

from __future__ import annotations

import threading
import traceback
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist

from rollout.weights.group import PushRejected, TransferError, TransferGroup, cuda_device, post_verdict

T = TypeVar("T")
BUCKET_BYTES = 1 << 30
ALIGN = 256  # byte alignment of every tensor in the stream (views of the staging buffer need it)
DTYPES = {
    name: getattr(torch, name)
    for name in ("float32", "bfloat16", "float16", "float64", "float8_e4m3fn", "float8_e5m2")
    if hasattr(torch, name)
}


@dataclass(frozen=True, slots=True)
class TensorSpec:
    name: str
    dtype: str  # vLLM-style name: "bfloat16", not "torch.bfloat16"
    shape: tuple[int, ...]

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def nbytes(self) -> int:
        n = self.torch_dtype.itemsize
        for d in self.shape:
            n *= d
        return n


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def make_specs(names: object, dtype_names: object, shapes: object) -> list[TensorSpec]:
    """Specs from JSON-like lists, refusing anything malformed with a message naming the item."""
    for key, value in (("names", names), ("dtype_names", dtype_names), ("shapes", shapes)):
        if not isinstance(value, (list, tuple)):
            raise TypeError(f"{key} must be a list, got {type(value).__name__}")
    if not len(names) == len(dtype_names) == len(shapes):  # type: ignore[arg-type]
        raise ValueError(f"names, dtype_names and shapes must have one entry per tensor; got lengths "
                         f"{len(names)}, {len(dtype_names)}, {len(shapes)}")  # type: ignore[arg-type]
    if not names:
        raise ValueError("a weight push needs at least one tensor")
    specs = []
    for i, (name, dt, shape) in enumerate(zip(names, dtype_names, shapes)):  # type: ignore[call-overload]
        if not isinstance(name, str) or not name:
            raise TypeError(f"names[{i}] must be a non-empty string, got {name!r}")
        if dt not in DTYPES:
            raise ValueError(f"dtype_names[{i}] ({name!r}) is {dt!r}; allowed: {sorted(DTYPES)}")
        ok = isinstance(shape, (list, tuple)) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                      for d in shape)
        if not ok:
            raise TypeError(f"shapes[{i}] ({name!r}) must be a list of ints >= 0, got {shape!r}")
        specs.append(TensorSpec(name, dt, tuple(shape)))
    if len({s.name for s in specs}) != len(specs):
        raise ValueError("names must be unique within one push")
    return specs


def layout(specs: list[TensorSpec]) -> tuple[list[int], int]:
    """(byte offset of each tensor, total stream bytes): offsets aligned to ``ALIGN``."""
    offsets, pos = [], 0
    for s in specs:
        pos = -(-pos // ALIGN) * ALIGN
        offsets.append(pos)
        pos += s.nbytes
    return offsets, pos


def chunk_bounds(total: int, bucket_bytes: int) -> list[tuple[int, int]]:
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < ALIGN:
        raise ValueError(f"bucket_bytes must be an int >= {ALIGN}, got {bucket_bytes!r}")
    return [(a, min(a + bucket_bytes, total)) for a in range(0, total, bucket_bytes)]


def _pieces(offsets: list[int], sizes: list[int], bounds: list[tuple[int, int]]
            ) -> Iterator[list[tuple[int, int, int, int]]]:
    """Per chunk: (tensor index, source byte start, source byte end, destination offset in the chunk)."""
    i = 0
    for a, b in bounds:
        out = []
        while i < len(offsets) and offsets[i] < b:
            lo, hi = max(offsets[i], a), min(offsets[i] + sizes[i], b)
            if hi > lo:
                out.append((i, lo - offsets[i], hi - offsets[i], lo - a))
            if offsets[i] + sizes[i] > b:
                break  # the tensor continues in the next chunk
            i += 1
        yield out


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.uint8).reshape(-1)


def send_weights(group: TransferGroup, specs: list[TensorSpec], named_tensors: Iterable[tuple[str, torch.Tensor]],
                 bucket_bytes: int = BUCKET_BYTES, on_chunk: Callable[[int], None] | None = None) -> int:
    """Rank 0: broadcast ``named_tensors`` (in ``specs`` order, cast to each spec's dtype) as flat buckets.

    Two bucket buffers alternate: chunk k+1 is packed while chunk k is on the wire. Returns the bytes sent.
    """
    offsets, total = layout(specs)
    bounds = chunk_bounds(total, bucket_bytes)
    size = min(bucket_bytes, total)
    buffers = [torch.empty(size, dtype=torch.uint8, device=group.device) for _ in range(min(2, len(bounds)))]
    works: list[dist.Work | None] = [None] * len(buffers)
    source = iter(named_tensors)
    current, current_i = None, -1
    for k, ((a, b), pieces) in enumerate(zip(bounds, _pieces(offsets, [s.nbytes for s in specs], bounds))):
        slot = k % len(buffers)
        if works[slot] is not None:
            works[slot].wait()  # the broadcast that last used this buffer is done with it
        buf = buffers[slot]
        for i, lo, hi, dst in pieces:
            while current_i < i:
                current, current_i = next_bytes(source, specs, current_i + 1), current_i + 1
            buf[dst : dst + hi - lo].copy_(current[lo:hi], non_blocking=True)  # type: ignore[index]
        works[slot] = group.broadcast(buf[: b - a])
        if on_chunk is not None:
            on_chunk(k)
    for w in works:
        if w is not None:
            w.wait()
    while current_i < len(specs) - 1:  # trailing empty tensors own no bytes but must still be there
        next_bytes(source, specs, current_i + 1)
        current_i += 1
    if next(source, None) is not None:
        raise ValueError(f"more tensors than the {len(specs)} announced")
    if group.device.type == "cuda":
        torch.cuda.current_stream(group.device).synchronize()
    return total


def next_bytes(source: Iterator[tuple[str, torch.Tensor]], specs: list[TensorSpec], i: int) -> torch.Tensor:
    """The next source tensor's bytes, cast to ``specs[i]``'s dtype, once its name and shape are as announced."""
    item = next(source, None)
    spec = specs[i]
    if item is None:
        raise ValueError(f"the weights ended after {i} tensors; {len(specs)} were announced")
    name, tensor = item
    if name != spec.name or tuple(tensor.shape) != spec.shape:
        raise ValueError(f"tensor {i} is {name!r} {tuple(tensor.shape)}; announced {spec.name!r} {spec.shape}")
    return _as_bytes(tensor.to(spec.torch_dtype))


def receive_weights(group: TransferGroup, specs: list[TensorSpec], bucket_bytes: int = BUCKET_BYTES,
                    staging: torch.Tensor | None = None) -> tuple[list[tuple[str, torch.Tensor]], torch.Tensor]:
    """Rank >= 1: land every chunk in one staging buffer; returns (name, view) pairs and the buffer (reuse it).

    Any transport failure (peer gone, timeout) raises TransferError; nothing has been copied anywhere then.
    """
    offsets, total = layout(specs)
    bounds = chunk_bounds(total, bucket_bytes)
    if staging is None or staging.numel() < total or staging.device != group.device:
        staging = torch.empty(max(total, 1), dtype=torch.uint8, device=group.device)
    try:
        works = [group.broadcast(staging[a:b]) for a, b in bounds]
        for w in works:
            w.wait(group.timeout)
        if group.device.type == "cuda":
            torch.cuda.current_stream(group.device).synchronize()
    except Exception as e:  # noqa: BLE001 - whatever the backend raises, the group is now unusable
        raise TransferError(f"weight transfer failed after the verdict: {e}") from e
    return tensor_views(specs, offsets, staging), staging


def tensor_views(specs: list[TensorSpec], offsets: list[int], buffer: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) views of a flat byte buffer laid out by ``layout``: nothing is copied."""
    return [(s.name, buffer[o : o + s.nbytes].view(s.torch_dtype).view(s.shape)) for s, o in zip(specs, offsets)]


class WeightReceiver:
    """An engine's end of a ``TransferGroup``: join, check each push's metadata, receive it whole.

    ``check(name, tensor)`` is the engine's own validator (``engine.weights.mapper.validate``), run on
    ``meta`` tensors before any byte moves; the caller hands the received views to
    ``Engine.update_weights``, which validates again (values included) and copies. The staging buffer is
    kept between pushes. One push at a time; after a TransferError the group is closed and must be
    joined anew (``join``), while the engine keeps its old weights.
    """

    def __init__(self, device: torch.device | str, check: Callable[[str, torch.Tensor], None]) -> None:
        self.device, self.check = cuda_device(device), check  # built in the engine's thread: index resolved
        self.group: TransferGroup | None = None
        self._staging: torch.Tensor | None = None
        self._pushes = 0
        self._busy = threading.Lock()

    def join(self, master_address: str, master_port: int, world_size: int, rank: int = 1,
             backend: str | None = None, timeout_s: float = 600.0) -> TransferGroup:
        """Join the trainer's group as ``rank`` (blocks until every rank joined); replaces any old group."""
        backend = backend or ("nccl" if self.device.type == "cuda" else "gloo")
        if backend not in ("nccl", "gloo"):
            raise ValueError(f"backend must be 'nccl' or 'gloo', got {backend!r}")
        if backend == "nccl" and self.device.type != "cuda":
            raise ValueError(f"backend 'nccl' needs a CUDA engine; this one is on {self.device}: use 'gloo'")
        with self._exclusive():
            self.close()
            self._pushes = 0
            device = self.device if backend == "nccl" else torch.device("cpu")
            self.group = TransferGroup.join(master_address, master_port, rank, world_size, device, timeout_s)
            return self.group

    def receive(self, specs: list[TensorSpec], bucket_bytes: int = BUCKET_BYTES,
                push_id: int | None = None) -> list[tuple[str, torch.Tensor]]:
        with self._exclusive():
            group = self.group
            if group is None:
                raise ValueError("no weight-transfer group: initialise one first (POST /init_weight_transfer)")
            push_id = self._pushes if push_id is None else push_id
            self._pushes = push_id + 1
            error = self._check(specs, bucket_bytes)
            post_verdict(group, push_id, error)
            if error is not None:
                raise PushRejected(error)
            try:
                views, self._staging = receive_weights(group, specs, bucket_bytes, self._staging)
            except TransferError:
                self.close()
                raise
            return views

    def receive_handles(self, specs: list[TensorSpec], handles: list, apply: Callable[[list], T]) -> T:
        """A co-located push (``weight_handles``): the same metadata check as a broadcast's, then ``apply`` (the
        engine's ``update_weights``) on views of the trainer's buckets, which are unmapped before returning."""
        from rollout.weights.handles import open_weights

        with self._exclusive():
            error = self._check(specs, BUCKET_BYTES)
            if error is not None:
                raise PushRejected(error)
            views: list = []
            buffers: list = []
            try:
                views, buffers = open_weights(specs, handles, self.device)
                return apply(views)
            except BaseException as e:
                traceback.clear_frames(e.__traceback__)  # its frames would keep views, so the mappings, alive
                raise
            finally:
                views.clear()
                buffers.clear()

    def release_staging(self) -> int:
        """Drop the staging buffer kept between pushes (a model's worth of bytes: the engine sleeps); the
        next push allocates it again. Returns the bytes dropped."""
        with self._exclusive():
            staging, self._staging = self._staging, None
            return 0 if staging is None else staging.numel() * staging.element_size()

    @property
    def staging_bytes(self) -> int:
        staging = self._staging
        return 0 if staging is None else staging.numel() * staging.element_size()

    def _check(self, specs: list[TensorSpec], bucket_bytes: int) -> str | None:
        try:
            chunk_bounds(1, bucket_bytes)
            for s in specs:
                self.check(s.name, torch.empty(s.shape, dtype=s.torch_dtype, device="meta"))
        except (TypeError, ValueError, KeyError) as e:
            return str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)  # KeyError's str() quotes
        return None

    def _exclusive(self) -> _Exclusive:
        return _Exclusive(self._busy)

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None
        self._staging = None


class _Exclusive:
    def __init__(self, lock: threading.Lock) -> None:
        self.lock = lock

    def __enter__(self) -> None:
        if not self.lock.acquire(blocking=False):
            raise RuntimeError("a weight transfer is already in progress; one at a time")

    def __exit__(self, *exc: object) -> None:
        self.lock.release()
