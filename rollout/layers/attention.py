"""Attention over the paged KV cache: the plain-torch reference backend.

It is the CPU path and the oracle the Triton kernels are tested against, so it is written for
clarity: gather each sequence's context through its block table, then causal SDPA in float32.
"""

from __future__ import annotations

import torch

from rollout.layers.attention_metadata import AttentionMetadata


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter new K/V rows into their slots; slots < 0 are padding and skipped."""
    _, num_blocks, block_size, hkv, d = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, hkv, d)
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        slot_mapping, k, v = slot_mapping[valid], k[valid], v[valid]
    flat[0].index_copy_(0, slot_mapping, k.to(flat.dtype))
    flat[1].index_copy_(0, slot_mapping, v.to(flat.dtype))


def gather_kv(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the first ``seq_len`` positions of one sequence: [seq_len, Hkv, D] each."""
    block_size = kv_cache.shape[2]
    nblk = (seq_len + block_size - 1) // block_size
    blocks = block_table[:nblk].long()
    k = kv_cache[0, blocks].flatten(0, 1)[:seq_len]
    v = kv_cache[1, blocks].flatten(0, 1)[:seq_len]
    return k, v


def reference_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """q: [T, Hq, D] (new tokens, K/V already written). Returns [T, Hq, D] in q's dtype."""
    out = torch.empty_like(q)
    qlens = meta.query_lens_host or torch.diff(meta.query_start_loc).tolist()
    slens = meta.seq_lens_host or meta.seq_lens.tolist()
    hq, hkv = q.shape[1], kv_cache.shape[3]
    start = 0
    for i, (ql, sl) in enumerate(zip(qlens, slens)):
        if ql == 0:
            continue
        k, v = gather_kv(kv_cache, meta.block_tables[i], sl)
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
        write_kv(kv_cache, k, v, meta.slot_mapping)
        return reference_attention(q, kv_cache, meta, scale, sliding_window)
