"""Weights for an engine on the trainer's own device, by handle: the broadcast's flat buckets, shared not sent.

NCCL refuses two ranks on one GPU, so an engine co-located with its trainer (veRL's hybrid engine, TRL's
colocate mode) cannot join the weight broadcast. Instead the trainer packs the tensors into flat buckets
laid out by ``layout.layout`` (same specs, same alignment; whole tensors per bucket, at most
``bucket_bytes`` each unless one tensor alone is larger) and exports each bucket as a handle that another
process on the same host can map:

- CUDA: torch's CUDA IPC handle (``torch.multiprocessing.reductions.reduce_tensor``), addressed by the GPU's
  UUID rather than its index, since a Ray actor numbers its visible GPUs from 0 (vLLM's IPC engine and
  SGLang do the same). The handle carries an event: the receiver waits for the trainer's packing copies.
- CPU: the bucket is allocated in a file under ``/dev/shm`` (``torch.from_file``), and the handle is the
  path, which survives any pickling (torch's own CPU reduction passes a file descriptor, which Ray cannot
  carry; its ``file_system`` strategy would change a process-wide setting).

Only handles and metadata travel. The receiver maps each bucket, views it exactly as the broadcast receiver
views its staging buffer, hands the views to ``Engine.update_weights`` (validate everything, then copy) and
drops the mapping. The trainer keeps its buckets until every receiver answered, then frees them and
unlinks the files, so nothing stays in /dev/shm after a push. The cost: during a push the trainer's device
holds one packed copy of the weights (the broadcast's receiver holds the same as its staging buffer).
"""

from __future__ import annotations

import os
import tempfile
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from rollout.weights.group import cuda_device
from rollout.weights.layout import BUCKET_BYTES, TensorSpec, bucket_ranges, layout, next_bytes, tensor_views

SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
SHM_PREFIX = "rollout-weights-"  # then the trainer's pid: tests look for leftovers by it
_DEVICE_ARG = 6  # position of the device index in rebuild_cuda_tensor's arguments (stable for years)


@dataclass(frozen=True, slots=True)
class BucketHandle:
    """One bucket: tensors ``specs[first : first + count]`` at ``layout``'s offsets, ``nbytes`` long."""

    first: int
    count: int
    nbytes: int
    kind: str  # "cuda" (ref = (GPU uuid, rebuild_cuda_tensor's arguments)) or "shm" (ref = the file's path)
    ref: Any


class ExportedWeights:
    """The trainer's packed buckets and their handles; alive until ``release`` (use it as a context manager)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.handles: list[BucketHandle] = []
        self._buffers: list[torch.Tensor] = []
        self._paths: list[str] = []
        self._token = f"{SHM_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"

    @property
    def nbytes(self) -> int:
        return sum(h.nbytes for h in self.handles)

    def _allocate(self, nbytes: int) -> torch.Tensor:
        if self.device.type == "cuda":
            buf = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=self.device)
        else:
            path = os.path.join(SHM_DIR, f"{self._token}-{len(self._paths)}")
            self._paths.append(path)  # before creating it: release() unlinks whatever exists
            buf = torch.from_file(path, shared=True, size=max(nbytes, 1), dtype=torch.uint8)
        self._buffers.append(buf)
        return buf

    def _export(self, buf: torch.Tensor) -> tuple[str, Any]:
        if self.device.type == "cuda":
            from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

            fn, args = reduce_tensor(buf)  # records an event after the packing copies queued so far
            assert fn is rebuild_cuda_tensor, fn
            return "cuda", (gpu_uuid(self.device), args)
        return "shm", self._paths[-1]

    def release(self) -> None:
        """Free the buckets and unlink their files; call only once every receiver has answered."""
        self._buffers.clear()
        for path in self._paths:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self._paths.clear()
        if self.device.type == "cuda":
            torch.cuda.ipc_collect()  # blocks a receiver released are freed now, not at some later export

    def __enter__(self) -> ExportedWeights:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def export_weights(specs: list[TensorSpec], named_tensors: Iterable[tuple[str, torch.Tensor]],
                   device: torch.device | str, bucket_bytes: int = BUCKET_BYTES) -> ExportedWeights:
    """Trainer: pack ``named_tensors`` (in ``specs`` order, cast to each spec's dtype) into buckets on
    ``device`` and export each; the caller releases them once every receiver has answered."""
    device = cuda_device(device)
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"weights by handle need a CUDA or CPU device, got {device}")
    out = ExportedWeights(device)
    try:
        source = iter(named_tensors)
        for first, end in bucket_ranges(specs, bucket_bytes):
            offsets, total = layout(specs[first:end])
            buf = out._allocate(total)
            for i, o in zip(range(first, end), offsets):
                data = next_bytes(source, specs, i)  # checks the name and shape announced
                buf[o : o + data.numel()].copy_(data, non_blocking=True)
            out.handles.append(BucketHandle(first, end - first, total, *out._export(buf)))
        if next(source, None) is not None:
            raise ValueError(f"more tensors than the {len(specs)} announced")
    except BaseException:
        out.release()
        raise
    return out


def open_weights(specs: list[TensorSpec], handles: list[BucketHandle], device: torch.device | str
                 ) -> tuple[list[tuple[str, torch.Tensor]], list[torch.Tensor]]:
    """Receiver: map every bucket; (name, view) pairs over them and the buckets (drop both to unmap)."""
    device = torch.device(device)
    expected, pos = [], 0
    for h in handles:
        if not isinstance(h, BucketHandle) or h.first != pos or h.count < 1:
            raise ValueError(f"bucket handles must cover the {len(specs)} tensors in order; got {h!r:.120}")
        pos += h.count
        expected.append(layout(specs[h.first : pos]))
    if pos != len(specs):
        raise ValueError(f"bucket handles cover {pos} tensors; {len(specs)} were announced")
    views: list[tuple[str, torch.Tensor]] = []
    buffers: list[torch.Tensor] = []
    for h, (offsets, total) in zip(handles, expected):
        if h.nbytes != total:
            raise ValueError(f"bucket at tensor {h.first} is {h.nbytes} bytes; its tensors take {total}")
        buffers.append(_open(h, device))
        views += tensor_views(specs[h.first : h.first + h.count], offsets, buffers[-1])
    return views, buffers


def _open(h: BucketHandle, device: torch.device) -> torch.Tensor:
    if h.kind == "shm":
        path = h.ref
        if not isinstance(path, str) or os.path.dirname(path) != SHM_DIR \
                or not os.path.basename(path).startswith(SHM_PREFIX):
            raise ValueError(f"not a weight bucket: {path!r}")
        if not os.path.exists(path):
            raise ValueError(f"the trainer's weight bucket {path} does not exist here: weights by handle need the "
                             "replica on the trainer's host (use the broadcast otherwise)")
        return torch.from_file(path, shared=False, size=max(h.nbytes, 1), dtype=torch.uint8)  # mapped, not read
    if h.kind == "cuda":
        if device.type != "cuda":
            raise ValueError(f"a CUDA weight handle needs an engine on the trainer's GPU; this one is on {device}")
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        uuid_, args = h.ref
        args = list(args)
        args[_DEVICE_ARG] = cuda_index(uuid_)
        return rebuild_cuda_tensor(*args)
    raise ValueError(f"unknown weight handle kind {h.kind!r}; allowed: 'cuda', 'shm'")


def gpu_uuid(device: torch.device | str) -> str:
    """The GPU's UUID: the same in every process, whatever each one's CUDA_VISIBLE_DEVICES numbering."""
    return str(torch.cuda.get_device_properties(cuda_device(device)).uuid)


def cuda_index(device_uuid: str) -> int:
    """This process's index of the GPU with ``device_uuid``; ValueError when it cannot see that GPU."""
    seen = [gpu_uuid(torch.device("cuda", i)) for i in range(torch.cuda.device_count())] \
        if torch.cuda.is_available() else []
    if device_uuid not in seen:
        raise ValueError(f"GPU {device_uuid} is not visible to this process (it sees {seen or 'no GPU'}, "
                         f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}): a co-located "
                         "replica must run on the trainer's host and see the trainer's GPU")
    return seen.index(device_uuid)
