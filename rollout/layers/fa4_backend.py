"""FlashAttention-4 for prefill, our Triton kernels for everything else: the backend chosen per phase.

FA4 (``flash-attn-4``, CuTe DSL; ``from flash_attn.cute import flash_attn_varlen_func``) measured 1.9-2.6x our
Triton prefill kernel on the H200 at qwen2.5-1.5b's heads with 128-token pages, and slower than our split-KV
decode at W2's long-tailed decode shapes (issue 23.7). So this backend is ``TritonAttentionBackend`` with one
phase swapped: K/V store, decode-only steps (the CUDA-graph ones) and a mixed step's one-token rows
(``meta.decode_rows``) stay on the Triton kernels; the rest of every other step -- chunked prefill, recompute,
scoring, multi-turn environment tokens -- goes through FA4's paged varlen kernel.

What FA4 4.0.0b36 takes (``flash_attn/cute/interface.py``, ``_flash_attn_fwd``), and how our metadata maps on it:

* q ``[T, Hq, D]``; a paged cache as k, v ``[num_pages, page_size, Hkv, D]`` each -- our layer cache's halves
  ``kv_cache[0]``, ``kv_cache[1]`` as they are. q, k and v share one dtype, fp16 or bf16 (fp8 only on SM100,
  with per-(batch, kv head) descales: neither our Hopper nor our per-token scales).
* ``cu_seqlens_q`` = ``meta.query_start_loc`` and ``seqused_k`` = ``meta.seq_lens`` (int32, contiguous),
  ``page_table`` = ``meta.block_tables`` (int32 [B, max_pages]); ``cu_seqlens_k`` must be None with a page
  table. ``max_seqlen_q``/``max_seqlen_k`` are host ints (scheduling bounds only).
* ``causal=True`` is bottom-right aligned (``mask.py``: key limit ``row + 1 + seqlen_k - seqlen_q``), i.e. the
  new tokens sit at the end of their context, as ``AttentionMetadata`` lays them out (a cached prefix, a chunk).
  A sliding window of W tokens is ``window_size=(W - 1, 0)``: key ``k`` is seen from query position ``p`` iff
  ``p - (W - 1) <= k <= p``, as in ``reference_attention``.
* A page size equal to the kernel's key tile (128 for head_dim <= 128 on SM90 and SM100) loads pages by TMA, the
  measured fast path; any other page size takes FA4's cp.async paged path (correct upstream, tested there at
  pages 1, 4, 128; slower, unmeasured here). The TMA path reads whole pages, rows past a sequence's length
  included: they must be finite, which our zero-initialised, only-ever-written cache keeps them.
* Returns ``(out, lse)`` (lse None unless asked); out ``[T, Hq, D]`` in q's dtype.

A mixed step with ``meta.decode_rows``: FA4 must not spend a 128-row tile per KV head on each one-token row
(without split-KV on SM90 a long decode row would serialise one CTA over its whole context), and those rows go
to our decode kernel anyway, so FA4 gets ``seqused_q`` = each sequence's query length with the one-token ones
zeroed: it computes (and writes) only the prefill rows, offsets still from ``cu_seqlens_q``; the decode kernel
then fills the rest, exactly as in the Triton path. Without ``decode_rows`` (few decodes) FA4 takes the batch
whole, one-token rows included (correct: a q_len 1 row is bottom-right causal over its whole context).

Falls back to the Triton prefill kernel, per call, for a cache FA4 cannot read: fp8 (its scales), or a dtype
other than q's fp16/bf16 (a float32 model). The FA4 import happens when the backend is built, never when this
module is imported.
"""

from __future__ import annotations

import torch

from rollout.layers.attention_metadata import AttentionMetadata
from rollout.layers.kv_quant import KVPair
from rollout.layers.triton_backend import TritonAttentionBackend

FA4_PAGE_SIZE = 128  # FA4's key tile for head_dim <= 128 (SM90, SM100): the page size its TMA path loads
FA4_DTYPES = (torch.float16, torch.bfloat16)


def load_fa4_varlen():
    """``flash_attn.cute.flash_attn_varlen_func``, or an ImportError saying how to get it."""
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except ImportError as e:
        raise ImportError(
            "attention_backend='fa4' needs FlashAttention-4 (pip install 'rollout[fa4]', i.e. flash-attn-4; "
            f"on the H200 see shared/device/fa4.sh): {e}"
        ) from e
    return flash_attn_varlen_func


class FA4PrefillBackend(TritonAttentionBackend):
    """Triton K/V store and decode; FA4's paged varlen kernel for the prefill rows of every other step."""

    name = "fa4"
    uses_decode_rows = True  # a mixed step's one-token rows go to the Triton decode kernel, as in "triton"

    def __init__(self, block_size: int, decode_num_splits: int | None = None) -> None:
        super().__init__(decode_num_splits)
        self._varlen = load_fa4_varlen()
        self.block_size = block_size
        self._used_q: tuple[object, torch.Tensor | None] = (None, None)  # (step's decode_rows, its seqused_q)

    def reads(self, q: torch.Tensor, kv_cache: torch.Tensor | KVPair, kv_scales: torch.Tensor | None) -> bool:
        """Whether FA4 can take this layer's prefill: a cache of q's dtype, fp16 or bf16 (not fp8)."""
        return kv_scales is None and q.dtype in FA4_DTYPES and kv_cache.dtype == q.dtype

    def _prefill_rows(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor | KVPair,
        kv_scales: torch.Tensor | None,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        if not self.reads(q, kv_cache, kv_scales):
            return super()._prefill_rows(q, kv_cache, kv_scales, meta, scale, sliding_window)
        res = self._varlen(
            q, kv_cache[0], kv_cache[1],
            cu_seqlens_q=meta.query_start_loc,
            max_seqlen_q=meta.max_query_len,
            max_seqlen_k=meta.max_seq_len,
            seqused_q=self._prefill_q_lens(meta),
            seqused_k=meta.seq_lens,
            page_table=meta.block_tables,
            softmax_scale=scale,
            causal=True,
            window_size=(sliding_window - 1, 0) if sliding_window else (None, None),
        )  # fmt: skip
        return res[0] if isinstance(res, tuple) else res

    def _prefill_q_lens(self, meta: AttentionMetadata) -> torch.Tensor | None:
        """FA4's ``seqused_q`` for a step with ``decode_rows``: query lengths, one-token sequences' zeroed (the
        decode kernel takes them); None (every row of ``cu_seqlens_q``) otherwise. Built once per step: the memo
        holds the step's ``decode_rows`` object, new every step, so identity marks the step."""
        rows = meta.decode_rows
        if rows is None:
            return None
        if self._used_q[0] is not rows:
            lens = meta.query_start_loc.diff()
            self._used_q = (rows, lens.masked_fill(lens <= 1, 0))
        return self._used_q[1]
