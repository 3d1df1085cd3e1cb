"""Opt-in all-reduce for decode-sized tensors through PyTorch's symmetric memory (``tp_all_reduce="symm_mem"``).

Why: a decode step all-reduces a few small tensors per layer (llama3-8b at TP=2: 64 of [batch, 4096] bf16).
On the two-H200 machine NCCL takes about 22 us each inside a CUDA graph, PyTorch's symmetric-memory one-shot
all-reduce about 16 us even outside one (issue 16): at 64 a step, that difference decides the 0.65x bar.

How: every rank allocates one symmetric buffer (``symm_mem.empty``) holding the largest decode all-reduce
(hidden_size x the largest CUDA-graph batch, in the model's dtype) and maps its peers' buffers once
(``symm_mem.rendezvous``, a collective over the group's store). An all-reduce of ``x`` is then one kernel,
``one_shot_all_reduce_copy_out``: each thread copies its part of ``x`` into this rank's buffer, all wait on the
peers' signal pads, load every rank's buffer over NVLink P2P and write the sum into the same part of ``x``,
then wait again so that no rank overwrites its buffer while a peer still reads it. Its addresses are fixed and
its signal pads reset themselves, so it can be captured in CUDA graphs (vLLM's ``SymmMemCommunicator`` captures
PyTorch's two-shot kernel the same way). Everything else -- prefill chunks bigger than the buffer, float16,
non-contiguous or odd-sized tensors -- goes through the process group's NCCL all-reduce (``fits_symm_mem``).

Only P2P loads and stores, never multimem (NVLink multicast / NVLS), which must stay off on the target machine;
``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` is set (where unset) before the rendezvous, which would otherwise create
a multicast object.

NOT VERIFIED ON A GPU: written on a machine without one, against PyTorch's source (torch 2.11's release notes;
``torch/csrc/distributed/c10d/symm_mem``). The CPU tests cover the config, the decision and the wiring with a
stand-in op; ``tests/gpu/test_tp_symm_mem_gpu.py`` compares it with NCCL in and out of CUDA graphs and an
engine's greedy tokens. Known limits: a worker that dies mid-step leaves rank 0's kernel spinning on a signal
that never comes (NCCL's abort cannot end it); and see ``check_symm_mem_start`` (one such engine per process).
"""

from __future__ import annotations

import os
import uuid
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

SYMM_MEM_DTYPES = (torch.bfloat16, torch.float32)  # the dtypes PyTorch's one-shot kernel is compiled for
ALIGN_BYTES = 16  # the kernel's widest vector: the copy's offset must keep it (its size must be 4-byte aligned)
MIN_TORCH = "2.11"  # the rendezvous finds the group's store by the group's name (earlier: enable_symm_mem_for_group)

# PyTorch's CUDA rendezvous numbers its store exchanges with one counter per process (StoreExchange::seq_id_),
# so ranks whose processes have rendezvoused different numbers of times wait for each other's keys until the
# store times out. Fresh workers start at 0: rank 0's process must too. Process-wide on purpose: it mirrors
# that process-wide counter (the names of the groups this process has rendezvoused).
_rendezvoused_in_process: list[str] = []


@dataclass(frozen=True, slots=True)
class SymmMemSpec:
    """The symmetric buffer each rank allocates: the largest all-reduce that takes the symmetric path."""

    numel: int
    dtype: torch.dtype


def symm_mem_spec(config: Any, hidden_size: int, dtype: torch.dtype) -> SymmMemSpec | None:
    """None for ``tp_all_reduce="nccl"``; else room for one decode all-reduce at the largest CUDA-graph batch:
    hidden_size x min(max_graph_batch_size, max_num_seqs) elements of the model's dtype."""
    if config.tp_all_reduce != "symm_mem":
        return None
    if dtype not in SYMM_MEM_DTYPES:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in SYMM_MEM_DTYPES)
        raise ValueError(f"tp_all_reduce='symm_mem' supports models in {allowed}, got "
                         f"{str(dtype).removeprefix('torch.')}; use tp_all_reduce='nccl'")
    return SymmMemSpec(hidden_size * min(config.max_graph_batch_size, config.max_num_seqs), dtype)


def check_symm_mem_start(config: Any, device: torch.device) -> None:
    """What rank 0 can refuse before any worker starts: symm_mem needs CUDA, torch >= 2.11, and a process that
    has not rendezvoused a symmetric buffer before (a second such engine in one process would wait for ever)."""
    if config.tp_all_reduce != "symm_mem":
        return
    if device.type != "cuda":
        raise ValueError(f"tp_all_reduce='symm_mem' needs CUDA devices, got device {str(device)!r}; "
                         "use tp_all_reduce='nccl'")
    if torch.torch_version.TorchVersion(torch.__version__) < MIN_TORCH:
        raise ValueError(f"tp_all_reduce='symm_mem' needs torch >= {MIN_TORCH}, found {torch.__version__}; "
                         "use tp_all_reduce='nccl'")
    if _rendezvoused_in_process:
        raise RuntimeError("tp_all_reduce='symm_mem': this process already started a symmetric-memory group "
                           f"({_rendezvoused_in_process[0]}); PyTorch counts its rendezvous per process, so the new "
                           "workers could never meet it. Start this engine in a fresh process, or use 'nccl'")


def fits_symm_mem(numel: int, dtype: torch.dtype, contiguous: bool, byte_offset: int, capacity: int,
                  buffer_dtype: torch.dtype) -> bool:
    """Whether one all-reduce takes the symmetric path (else NCCL). It looks only at what every rank's tensor
    shares (shape, dtype, layout), never at an address, so all ranks choose alike: one that chose otherwise
    would wait in a collective its peers never join. (Base addresses come from the caching allocator, which
    aligns every block to 512 bytes; ``byte_offset`` is the view's offset into it.)"""
    return (dtype == buffer_dtype and contiguous and 0 < numel <= capacity
            and numel * dtype.itemsize % 4 == 0 and byte_offset % ALIGN_BYTES == 0)


class SymmMemAllReduce:
    """One rank's symmetric buffer and the one-shot op that all-reduces through it (the module says how)."""

    def __init__(self, buffer: torch.Tensor, group_name: str, op: Callable[..., Any]) -> None:
        self.buffer, self.group_name, self._op = buffer, group_name, op

    @classmethod
    def create(cls, pg: Any, store: Any, rank: int, device: torch.device, spec: SymmMemSpec) -> SymmMemAllReduce:
        """A collective: every rank of ``pg`` calls it at the same point (right after building the group)."""
        import torch.distributed._symmetric_memory as symm_mem
        from torch._C._distributed_c10d import _register_process_group, _unregister_process_group

        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")  # P2P only: never make a multicast object
        name = _agree_on_name(store, rank)
        pg._set_group_name(name)
        _register_process_group(name, pg)  # the rendezvous and the op find the group (and its store) by name
        try:
            buffer = symm_mem.empty(spec.numel, dtype=spec.dtype, device=device)
            _rendezvoused_in_process.append(name)
            symm_mem.rendezvous(buffer, name)
        except BaseException:
            _unregister_process_group(name)
            raise
        self = cls(buffer, name, _one_shot_op())
        weakref.finalize(self, _unregister_process_group, name)  # the registry would keep the group alive
        return self

    def fits(self, x: torch.Tensor) -> bool:
        return fits_symm_mem(x.numel(), x.dtype, x.is_contiguous(), x.storage_offset() * x.element_size(),
                             self.buffer.numel(), self.buffer.dtype)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks into ``x`` (which ``fits``); returns ``x``. Each kernel thread reads an element of
        ``x`` before it writes the same element, so ``x`` can be both the input and the output."""
        flat = x.view(-1)
        self._op(self.buffer[: flat.numel()], flat, "sum", self.group_name, flat)
        return x


def _agree_on_name(store: Any, rank: int) -> str:
    """One group name for every rank, unique in each process (rank 0 draws it, the others read it)."""
    key = "symm_mem/group_name"
    if rank == 0:
        name = f"rollout_tp_symm_mem_{uuid.uuid4().hex[:16]}"
        store.set(key, name)
        return name
    return store.get(key).decode()


def _one_shot_op() -> Callable[..., Any]:
    """``(symm_buffer, local_input, "sum", group_name, out)``: PyTorch's one kernel that copies and reduces,
    or (a build without it) the copy then the one-shot all-reduce of the buffer."""
    ops = torch.ops.symm_mem
    if hasattr(ops, "one_shot_all_reduce_copy_out"):
        return ops.one_shot_all_reduce_copy_out

    def copy_then_reduce(buf: torch.Tensor, local: torch.Tensor, op: str, name: str, out: torch.Tensor) -> Any:
        buf.copy_(local)
        return ops.one_shot_all_reduce_out(buf, op, name, out)

    return copy_then_reduce
