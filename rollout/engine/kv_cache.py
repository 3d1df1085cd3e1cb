"""The paged KV cache's memory: how many blocks fit, one allocation for all layers, release/restore."""

from __future__ import annotations

import torch

from rollout.config import EngineConfig


class KVCache:
    """Owns one tensor [layers, 2, num_blocks, block_size, Hkv, D]. ``layers`` is the per-layer view list;
    runners hold this object and read ``layers`` when they run, so release/allocate need no hand-back."""

    def __init__(self, model: torch.nn.Module, config: EngineConfig, device: torch.device,
                 dtype: torch.dtype, max_model_len: int) -> None:
        self.model, self.config, self.device, self.dtype = model, config, device, dtype
        self.num_blocks = config.num_blocks or self._default_num_blocks(max_model_len)
        self.storage: torch.Tensor | None = None
        self.layers: list[torch.Tensor] = []
        self.allocate()

    @property
    def block_bytes(self) -> int:
        m = self.model
        return 2 * m.num_layers * self.config.block_size * m.num_kv_heads * m.head_dim * self.dtype.itemsize

    @property
    def token_bytes(self) -> int:
        """K and V of one token in every layer: what attention reads per context token."""
        return self.block_bytes // self.config.block_size

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.config.block_size

    def _default_num_blocks(self, max_model_len: int) -> int:
        """Enough for every sequence at full length, capped by the memory budget."""
        c = self.config
        enough = c.max_num_seqs * -(-max_model_len // c.block_size) + 1
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            total = torch.cuda.get_device_properties(self.device).total_memory
            budget = free - (1 - c.gpu_memory_utilization) * total
            return max(1, min(enough, int(budget * 0.9) // self.block_bytes))
        return max(1, min(enough, int(c.cpu_kv_cache_gib * 2**30) // self.block_bytes))

    def allocate(self) -> None:
        if self.storage is not None:
            return
        m = self.model
        shape = (m.num_layers, 2, self.num_blocks, self.config.block_size, m.num_kv_heads, m.head_dim)
        self.storage = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.layers = list(self.storage.unbind(0))

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
