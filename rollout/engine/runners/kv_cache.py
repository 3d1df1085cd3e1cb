"""The paged KV cache's memory: its element type, how many blocks fit, one allocation for all layers,
release/restore.

On CUDA the cache gets what is left after the step's measured workspace (``memory_profile``): the
derived size stays inside ``gpu_memory_utilization``, and an explicit ``num_blocks`` that would leave
less than the workspace (and 2% of the device for fragmentation) free is refused, naming the largest
that fits (a cache that fits but leaves no room for the sampler only fails later, mid-run).
``kv_cache_dtype="fp8"`` stores e4m3 values with a float16 scale per (token, kv head)
(``rollout.layers.kv_quant``): 1.97x bf16's tokens per byte.

``swap_space_gib`` > 0 adds a host pool (pinned on CUDA) of whole blocks, ``[host_blocks, layers, 2, ..]``
so each host block is one contiguous copy; ``swap`` runs a plan's swap copies on the current stream.
"""

from __future__ import annotations

import torch

from rollout.config import EngineConfig
from rollout.layers.backends import AttentionSpec
from rollout.layers.kv_quant import FP8_DTYPE, fp8_block_bytes

KV_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "fp8": FP8_DTYPE}


# An explicit count has no gpu_memory_utilization slack behind it, so it also leaves this share of the device to the
# allocator's fragmentation: W2's cache at exactly (free - workspace) ran its warm-up 30 MiB short on an H100, with
# 0.6 GiB reserved but unallocated (55b60f5).
EXPLICIT_HEADROOM_FRACTION = 0.02


class KVCacheTooLarge(ValueError):
    """An explicit ``num_blocks`` that does not fit beside the step's workspace; ``max_num_blocks``
    is the largest that does."""

    def __init__(self, message: str, max_num_blocks: int) -> None:
        super().__init__(message)
        self.max_num_blocks = max_num_blocks


def resolve_kv_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """``kv_cache_dtype`` -> the element type of the cache ("auto" = the model's)."""
    if name == "auto":
        return model_dtype
    if name not in KV_DTYPES:
        raise ValueError(f"kv_cache_dtype must be 'auto' or one of {sorted(KV_DTYPES)}, got {name!r}")
    return KV_DTYPES[name]


def fit_num_blocks(config: EngineConfig, free: int, total: int, workspace: int, block_bytes: int,
                   enough: int) -> int:
    """The CUDA sizing rule, given free/total device bytes and the measured step workspace.

    Derived: what ``gpu_memory_utilization`` leaves after the workspace, at most ``enough`` blocks.
    Explicit: ``num_blocks`` itself, refused (``KVCacheTooLarge``, naming the largest that fits) when
    it would leave less than the workspace and ``EXPLICIT_HEADROOM_FRACTION`` of the device free.
    """
    c, gib = config, 2**30
    where = f"max_num_seqs={c.max_num_seqs}, max_num_batched_tokens={c.max_num_batched_tokens}"
    if c.num_blocks is not None:
        fits = max(0, free - workspace - int(EXPLICIT_HEADROOM_FRACTION * total)) // block_bytes
        if c.num_blocks > fits:
            raise KVCacheTooLarge(
                f"num_blocks={c.num_blocks} ({c.num_blocks * block_bytes / gib:.2f} GiB of KV cache) does not fit "
                f"beside the {workspace / gib:.2f} GiB a step needs at {where} ({free / gib:.2f} GiB free); the "
                f"largest num_blocks that fits is {fits}",
                fits,
            )
        return c.num_blocks
    budget = int(free - (1 - c.gpu_memory_utilization) * total) - workspace
    if budget < block_bytes:
        raise ValueError(
            f"no room for a KV cache: {free / gib:.2f} GiB free, {workspace / gib:.2f} GiB needed by a step at "
            f"{where}, gpu_memory_utilization={c.gpu_memory_utilization}; lower the first two or raise the last"
        )
    return min(enough, budget // block_bytes)


class KVCache:
    """Owns one tensor per engine: ``[layers, 2, num_blocks, block_size, Hkv, D]``, or for fp8 the raw
    bytes ``[layers, 2, num_blocks, block_bytes]``. ``layers`` is the per-layer view list; runners hold
    this object and read ``layers`` when they run, so release/allocate need no hand-back."""

    def __init__(self, model: torch.nn.Module, config: EngineConfig, device: torch.device,
                 dtype: torch.dtype, max_model_len: int, attn: AttentionSpec) -> None:
        self.model, self.config, self.device, self.attn = model, config, device, attn
        self.dtype = resolve_kv_dtype(config.kv_cache_dtype, dtype)
        self.workspace_bytes = 0  # measured on CUDA: what a step needs beside the cache
        self.storage: torch.Tensor | None = None
        self.layers: list[torch.Tensor] = []
        self.num_blocks = self._choose_num_blocks(max_model_len)
        self.num_host_blocks = int(config.swap_space_gib * 2**30) // self.block_bytes
        self.host: torch.Tensor | None = None
        if self.num_host_blocks:
            m, page = self.model, config.block_size
            tail = (self.layer_block_bytes,) if self.is_fp8 else (page, m.num_kv_heads, m.head_dim)
            block = (m.num_layers, 2, *tail)
            self.host = torch.zeros((self.num_host_blocks, *block), dtype=torch.uint8 if self.is_fp8 else self.dtype,
                                    pin_memory=device.type == "cuda")
        self.allocate()

    @property
    def is_fp8(self) -> bool:
        return self.dtype == FP8_DTYPE

    @property
    def layer_block_bytes(self) -> int:
        """Bytes of one block of K (or V) in one layer, scales included."""
        m, page = self.model, self.config.block_size
        if self.is_fp8:
            return fp8_block_bytes(page, m.num_kv_heads, m.head_dim)
        return page * m.num_kv_heads * m.head_dim * self.dtype.itemsize

    @property
    def block_bytes(self) -> int:
        return 2 * self.model.num_layers * self.layer_block_bytes

    @property
    def token_bytes(self) -> int:
        """K and V of one token in every layer: what attention reads per context token."""
        return self.block_bytes // self.config.block_size

    @property
    def num_tokens(self) -> int:
        """Capacity in tokens (for the configured type)."""
        return self.num_blocks * self.config.block_size

    def _new_storage(self, num_blocks: int) -> torch.Tensor:
        m, page = self.model, self.config.block_size
        if self.is_fp8:
            shape = (m.num_layers, 2, num_blocks, self.layer_block_bytes)
            return torch.zeros(shape, dtype=torch.uint8, device=self.device)
        shape = (m.num_layers, 2, num_blocks, page, m.num_kv_heads, m.head_dim)
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    def _choose_num_blocks(self, max_model_len: int) -> int:
        """CPU: the explicit count, else enough for every sequence at full length within
        ``cpu_kv_cache_gib``. CUDA: see the module docstring."""
        c = self.config
        enough = c.max_num_seqs * -(-max_model_len // c.block_size) + 1
        if self.device.type != "cuda":
            return c.num_blocks or max(1, min(enough, int(c.cpu_kv_cache_gib * 2**30) // self.block_bytes))
        from rollout.engine.runners.memory_profile import measure_step_workspace

        dummy = list(self._new_storage(1).unbind(0))
        self.workspace_bytes = measure_step_workspace(self.model, c, self.attn, self.device, max_model_len, dummy)
        del dummy
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        return fit_num_blocks(c, free, total, self.workspace_bytes, self.block_bytes, enough)

    def allocate(self) -> None:
        if self.storage is not None:
            return
        self.storage = self._new_storage(self.num_blocks)
        self.layers = list(self.storage.unbind(0))

    def swap(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        """Copy (gpu, host) blocks out, then (host, gpu) blocks in; on CUDA asynchronously on the current
        stream, which the copies' next readers (this step's forward, a later swap) also run on."""
        assert self.storage is not None and self.host is not None, "swap without a host pool or while asleep"
        for gpu, host in swap_out:
            self.host[host].copy_(self.storage[:, :, gpu], non_blocking=True)
        for host, gpu in swap_in:
            self.storage[:, :, gpu].copy_(self.host[host], non_blocking=True)

    def release(self) -> int:
        """Free the memory; returns the bytes released."""
        if self.storage is None:
            return 0
        released = self.storage.numel() * self.storage.element_size()
        self.layers = []
        self.storage = None
        return released

    @property
    def allocated(self) -> bool:
        return self.storage is not None
