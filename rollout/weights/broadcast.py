"""Weights over a ``TransferGroup``: one flat byte stream, broadcast in buckets, received whole.

The sender (a trainer, rank 0) and every receiver (an engine, ranks 1..N) derive the same ``layout``
from the same metadata. The sender packs chunk k+1 into one of two buffers while chunk k is on the wire
(double buffering). A receiver lands every chunk straight into one staging buffer, so nothing is
unpacked: each tensor is a view of it, handed on only when every byte has arrived (``receiver``), so a
broken connection or a trainer killed mid-push leaves the old weights serving.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch
import torch.distributed as dist

from rollout.weights.group import TransferError, TransferGroup
from rollout.weights.layout import BUCKET_BYTES, TensorSpec, chunk_bounds, layout, next_bytes, tensor_views


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
