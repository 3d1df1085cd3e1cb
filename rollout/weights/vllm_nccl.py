"""vLLM's NCCL weight-transfer group, the receiving end: what TRL's ``VLLMClient`` (1.16) and vLLM's
``trainer_init`` open as rank 0, joined by this server as rank ``rank_offset``.

The handshake is vLLM's ``StatelessProcessGroup`` over the trainer's TCPStore: rank 0 publishes the NCCL
unique id under ``broadcast_from/0/0`` (pickled ``ncclUniqueId``, read here by an unpickler that admits that
one ctypes struct and nothing else), every rank calls ``ncclCommInitRank`` and a one-element all-reduce
warms the communicator up (as ``PyNcclCommunicator`` does). Tensors then arrive as vLLM's packed producer
sends them: tensors' bytes concatenated without padding, a chunk closing at the first tensor that takes it
past ``buffer_bytes``, one broadcast per chunk (or one per tensor when not packed). NCCL is called through
ctypes (libnccl ships with torch), so no vLLM install is needed.
"""

from __future__ import annotations

import _ctypes  # type: ignore[import-not-found]
import ctypes
import datetime
import io
import math
import pickle
from typing import Any

import torch
import torch.distributed as dist

from rollout.weights.group import VLLM_KEY
from rollout.weights.layout import TensorSpec

PACKED_BUFFER_BYTES = 1 << 30  # vLLM's DEFAULT_PACKED_BUFFER_SIZE_BYTES: both ends must agree
_NCCL_DTYPES = {torch.int8: 0, torch.uint8: 1, torch.int32: 2, torch.int64: 4, torch.float16: 6, torch.float32: 7,
                torch.float64: 8, torch.bfloat16: 9}


class NcclUniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * 128)]


class _IdUnpickler(pickle.Unpickler):
    """Admits exactly the pickle of vLLM's ``ncclUniqueId``: a network peer's pickle runs no code here."""

    def find_class(self, module: str, name: str) -> Any:
        if name == "ncclUniqueId" and module.startswith("vllm."):
            return NcclUniqueId
        if (module, name) == ("_ctypes", "_unpickle"):
            return _ctypes._unpickle  # rebuilds the struct from its bytes (the class is ours)
        raise pickle.UnpicklingError(f"refusing {module}.{name} in the NCCL handshake")


def unique_id(raw: bytes) -> NcclUniqueId:
    obj = _IdUnpickler(io.BytesIO(raw)).load()
    if not isinstance(obj, NcclUniqueId):
        raise ValueError(f"the trainer's NCCL unique id is a {type(obj).__name__}, not an ncclUniqueId")
    return obj


class _Nccl:
    def __init__(self) -> None:
        self.lib = _load()
        self.lib.ncclGetErrorString.restype = ctypes.c_char_p
        self.lib.ncclCommInitRank.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, NcclUniqueId,
                                              ctypes.c_int]
        self.lib.ncclBroadcast.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                           ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
        self.lib.ncclAllReduce.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                           ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
        self.lib.ncclCommDestroy.argtypes = [ctypes.c_void_p]
        self.lib.ncclCommAbort.argtypes = [ctypes.c_void_p]
        self.lib.ncclGetUniqueId.argtypes = [ctypes.POINTER(NcclUniqueId)]

    def check(self, result: int) -> None:
        if result != 0:
            raise RuntimeError(f"NCCL error {result}: {self.lib.ncclGetErrorString(result).decode()}")


def _load() -> ctypes.CDLL:
    try:
        return ctypes.CDLL("libnccl.so.2")  # already loaded by torch's CUDA build: the same library
    except OSError:
        import os

        import nvidia.nccl  # type: ignore[import-not-found]

        return ctypes.CDLL(os.path.join(list(nvidia.nccl.__path__)[0], "lib", "libnccl.so.2"))


class VllmNcclGroup:
    """Rank ``rank`` of a vLLM weight-transfer group whose store ``store`` is already connected."""

    backend = "nccl"

    def __init__(self, store: dist.TCPStore, rank: int, world_size: int, device: torch.device, timeout_s: float,
                 packed: bool = True, buffer_bytes: int = PACKED_BUFFER_BYTES) -> None:
        if device.type != "cuda":
            raise ValueError(f"vLLM's weight-transfer handshake (TRL's VLLMClient, vLLM's trainer_init) runs on "
                             f"NCCL and needs a CUDA engine; this one is on {device}")
        store.set_timeout(datetime.timedelta(seconds=timeout_s))
        uid = unique_id(store.get(VLLM_KEY))
        self.rank, self.world_size, self.device = rank, world_size, device
        self.packed, self.buffer_bytes = packed, buffer_bytes
        self.store = store  # kept: the trainer's group holds its socket until it closes
        self.nccl = _Nccl()
        self.comm = ctypes.c_void_p()
        with torch.cuda.device(device):
            self.nccl.check(self.nccl.lib.ncclCommInitRank(ctypes.byref(self.comm), world_size, uid, rank))
            warm = torch.zeros(1, device=device)
            self._all_reduce(warm)
            torch.cuda.current_stream(device).synchronize()

    def _stream(self) -> ctypes.c_void_p:
        return ctypes.c_void_p(torch.cuda.current_stream(self.device).cuda_stream)

    def _all_reduce(self, t: torch.Tensor) -> None:
        ptr = ctypes.c_void_p(t.data_ptr())
        self.nccl.check(self.nccl.lib.ncclAllReduce(ptr, ptr, t.numel(), _NCCL_DTYPES[t.dtype], 0, self.comm,
                                                    self._stream()))

    def broadcast(self, t: torch.Tensor, src: int = 0) -> None:
        ptr = ctypes.c_void_p(t.data_ptr())
        self.nccl.check(self.nccl.lib.ncclBroadcast(ptr, ptr, t.numel(), _NCCL_DTYPES[t.dtype], src, self.comm,
                                                    self._stream()))

    def receive(self, specs: list[TensorSpec]) -> list[tuple[str, torch.Tensor]]:
        """Every tensor of one push, as vLLM's producer sends them; (name, tensor) pairs, nothing applied."""
        with torch.cuda.device(self.device):
            out = self._packed(specs) if self.packed else self._each(specs)
            torch.cuda.current_stream(self.device).synchronize()
        return out

    def _each(self, specs: list[TensorSpec]) -> list[tuple[str, torch.Tensor]]:
        out = []
        for s in specs:
            t = torch.empty(s.shape, dtype=s.torch_dtype, device=self.device)
            self.broadcast(t)
            out.append((s.name, t))
        return out

    def _packed(self, specs: list[TensorSpec]) -> list[tuple[str, torch.Tensor]]:
        out = []
        for chunk in packed_chunks(specs, self.buffer_bytes):
            sizes = [s.nbytes for s in chunk]
            buf = torch.empty(sum(sizes), dtype=torch.uint8, device=self.device)
            self.broadcast(buf)
            for s, piece in zip(chunk, buf.split(sizes)):
                t = torch.empty(s.shape, dtype=s.torch_dtype, device=self.device)
                t.view(-1).view(torch.uint8).copy_(piece)  # unpadded bytes: copied out, never viewed misaligned
                out.append((s.name, t))
        return out

    def close(self) -> None:
        comm, self.comm = self.comm, None
        if comm:
            try:
                self.nccl.lib.ncclCommAbort(comm)  # never blocks on a peer that is gone (destroy may)
            except Exception:  # noqa: BLE001 - best effort on a broken communicator
                pass
        self.store = None  # type: ignore[assignment]


def packed_chunks(specs: list[TensorSpec], buffer_bytes: int) -> list[list[TensorSpec]]:
    """vLLM's packing rule: add tensors until the chunk's bytes exceed ``buffer_bytes``, then close it."""
    chunks: list[list[TensorSpec]] = [[]]
    size = 0
    for s in specs:
        chunks[-1].append(s)
        size += math.prod(s.shape) * s.torch_dtype.itemsize
        if size > buffer_bytes:
            chunks.append([])
            size = 0
    return [c for c in chunks if c]
