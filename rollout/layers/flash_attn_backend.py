"""flash-attn backend: paged varlen prefill and ``flash_attn_with_kvcache`` decode over our cache.

Used automatically when the ``flash-attn`` package imports and ``block_size`` is a multiple of 256
(upstream flash-attn's paged-KV requirement). Our cache layout, [2, num_blocks, block_size, Hkv, D],
is already flash-attn's paged layout for K and V. New K/V are stored by our Triton kernel first, so
both calls only read the cache. Validated only where the package exists (tests/gpu skip otherwise).
"""

from __future__ import annotations

import torch

from rollout.layers.attention_metadata import AttentionMetadata

PAGE_MULTIPLE = 256


class FlashAttnBackend:
    name = "flash_attn"
    uses_decode_rows = False  # flash-attn's varlen kernel takes mixed steps whole
    fuses_rope = False  # reads k itself: the layer rotates q and k before forward

    def __init__(self, block_size: int) -> None:
        if block_size % PAGE_MULTIPLE:
            raise ValueError(
                f"attention_backend='flash_attn' needs block_size to be a multiple of {PAGE_MULTIPLE} "
                f"(flash-attn's paged KV), got {block_size}; use attention_backend='triton'"
            )
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

        from rollout.kernels.kv_write import write_kv_triton

        self._varlen, self._kvcache, self._write_kv = flash_attn_varlen_func, flash_attn_with_kvcache, write_kv_triton

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, sliding_window: int | None = None) -> torch.Tensor:
        self._write_kv(kv_cache, k, v, meta.slot_mapping)
        window = (sliding_window - 1, 0) if sliding_window else (-1, -1)
        if meta.decode_only:
            out = self._kvcache(q.unsqueeze(1), kv_cache[0], kv_cache[1], cache_seqlens=meta.seq_lens,
                                block_table=meta.block_tables, softmax_scale=scale, causal=True,
                                window_size=window)
            return out.squeeze(1)
        cu_k = torch.nn.functional.pad(meta.seq_lens.cumsum(0, dtype=torch.int32), (1, 0))
        return self._varlen(q, kv_cache[0], kv_cache[1], meta.query_start_loc, cu_k, meta.max_query_len,
                            meta.max_seq_len, softmax_scale=scale, causal=True, window_size=window,
                            block_table=meta.block_tables)
