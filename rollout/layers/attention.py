"""Attention over the paged KV cache: the plain-torch reference backend.

It is the CPU path and the oracle the Triton kernels are tested against, so it is written for
clarity: gather each sequence's context through its block table, then causal SDPA in float32.
An fp8 cache (``rollout.layers.kv_quant``) is quantized on write and dequantized on gather.
"""

from __future__ import annotations

import torch

from rollout.layers.attention_metadata import AttentionMetadata
from rollout.layers.kv_quant import KVPair, dequantize_fp8, fp8_views, is_fp8_cache, kv_halves, quantize_fp8


def write_kv(
    kv_cache: torch.Tensor | KVPair,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: torch.Tensor | None = None,
) -> None:
    """Scatter new K/V rows into their slots; slots < 0 are padding and skipped. With ``kv_scales``
    (an fp8 cache's ``KVPair`` of value views and its scale view) rows are quantized first."""
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        slot_mapping, k, v = slot_mapping[valid], k[valid], v[valid]
    if kv_scales is None:
        _, num_blocks, block_size, hkv, d = kv_cache.shape
        flat = kv_cache.view(2, num_blocks * block_size, hkv, d)
        flat[0].index_copy_(0, slot_mapping, k.to(flat.dtype))
        flat[1].index_copy_(0, slot_mapping, v.to(flat.dtype))
        return
    block_size = kv_scales.shape[2]
    blk, off = slot_mapping // block_size, slot_mapping % block_size
    for i, (cache, x) in enumerate(zip(kv_halves(kv_cache), (k, v))):
        values, scales = quantize_fp8(x)
        # indexing kernels for raw bytes exist on every device; fp8 ones may not
        cache.view(torch.uint8)[blk, off] = values.view(torch.uint8)
        kv_scales[i, blk, off] = scales


def gather_kv(
    kv_cache: torch.Tensor | KVPair,
    block_table: torch.Tensor,
    seq_len: int,
    kv_scales: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the first ``seq_len`` positions of one sequence: [seq_len, Hkv, D] each (float32
    when dequantized from fp8)."""
    halves = kv_halves(kv_cache)
    block_size = halves[0].shape[1]
    nblk = (seq_len + block_size - 1) // block_size
    blocks = block_table[:nblk].long()
    if kv_scales is None:
        k, v = (h[blocks].flatten(0, 1)[:seq_len] for h in halves)
        return k, v
    k, v = (
        dequantize_fp8(h.view(torch.uint8)[blocks].flatten(0, 1)[:seq_len].view(h.dtype),
                       kv_scales[i, blocks].flatten(0, 1)[:seq_len])
        for i, h in enumerate(halves)
    )
    return k, v


def cache_views(
    kv_cache: torch.Tensor, k: torch.Tensor
) -> tuple[torch.Tensor | KVPair, torch.Tensor | None]:
    """A layer's cache as the kernels take it: (values [2, nb, page, Hkv, D] or an fp8 ``KVPair``,
    scales or None).
    ``k`` ([T, Hkv, D], the new keys) supplies the head shape an fp8 cache's raw bytes do not."""
    if is_fp8_cache(kv_cache):
        return fp8_views(kv_cache, k.shape[1], k.shape[2])
    return kv_cache, None


def reference_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor | KVPair,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [T, Hq, D] (new tokens, K/V already written; ``kv_cache`` is the value view and ``kv_scales``
    the scales of an fp8 cache). Returns [T, Hq, D] in q's dtype."""
    out = torch.empty_like(q)
    hkv = kv_halves(kv_cache)[0].shape[2]
    qlens = meta.query_lens_host or torch.diff(meta.query_start_loc).tolist()
    slens = meta.seq_lens_host or meta.seq_lens.tolist()
    hq = q.shape[1]
    start = 0
    for i, (ql, sl) in enumerate(zip(qlens, slens)):
        if ql == 0:
            continue
        k, v = gather_kv(kv_cache, meta.block_tables[i], sl, kv_scales)
        qi = q[start : start + ql].float().transpose(0, 1)  # [Hq, ql, D]
        ki = k.float().repeat_interleave(hq // hkv, dim=1).transpose(0, 1)  # [Hq, sl, D]
        vi = v.float().repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
        qpos = torch.arange(sl - ql, sl, device=q.device)[:, None]
        kpos = torch.arange(sl, device=q.device)[None, :]
        mask = kpos <= qpos
        if sliding_window is not None:
            mask &= kpos > qpos - sliding_window
        o = torch.nn.functional.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale)
        out[start : start + ql] = o.transpose(0, 1).to(q.dtype)
        start += ql
    return out


class TorchAttentionBackend:
    """Plain-torch paged attention: correct everywhere, fast nowhere."""

    name = "torch"
    uses_decode_rows = False  # every row by the reference loop
    fuses_rope = False  # the layer rotates q and k before forward

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        values, scales = cache_views(kv_cache, k)
        write_kv(values, k, v, meta.slot_mapping, scales)
        return reference_attention(q, values, meta, scale, sliding_window, scales)
