"""Triton paged-attention backend: the GPU path, a drop-in for ``TorchAttentionBackend``.

Decode-only steps (the bulk of a rollout, and the ones captured in CUDA graphs) take the split-KV
decode kernel, its chunks balanced over the live context lengths on the device; every other batch
takes the varlen prefill kernel, except that a mixed step's one-token sequences (``meta.decode_rows``,
set by the CUDA runner when there are enough of them) go to the decode kernel too: the prefill kernel
would give each a 64-row tile per query head, re-reading its K/V once per head of a GQA group.
Neither kernel reads tensor values on the host, so a decode step is graph-capturable as long as the
kernels were compiled (warmed up) before capture.

The kernel modules are imported when the backend is built, not when this file is imported: Triton
decides at kernel-definition time whether to compile or interpret, and CPU tests set
``TRITON_INTERPRET=1`` before that moment.
"""

from __future__ import annotations

import torch

from rollout.layers.attention import cache_views
from rollout.layers.attention_metadata import AttentionMetadata
from rollout.layers.kv_quant import KVPair


class TritonAttentionBackend:
    """Paged attention with Triton kernels: K/V store, split-KV decode, varlen causal prefill."""

    name = "triton"
    uses_decode_rows = True  # computes AttentionMetadata.decode_rows with the decode kernel (runners set it)
    # forward(rope=(positions, cos_sin_cache)): rotary fused with the K/V store, one launch per layer
    # (rollout.kernels.rope_kv_write; bit for bit the two kernels' result, tests/gpu/test_kernels_gpu.py). On the
    # H200 (322d99f, qwen2.5-1.5b B=128 decode step) it saves 1.4-1.7% of the step's wall time;
    # scripts/bench.py --decode-knobs FUSED_ROPE=0 turns it off for the A/B.
    fuses_rope = True

    def __init__(self, decode_num_splits: int | None = None) -> None:
        from rollout.kernels import paged_decode
        from rollout.kernels.kv_write import write_kv_triton
        from rollout.kernels.paged_decode import paged_decode_attention
        from rollout.kernels.paged_prefill import paged_prefill_attention

        self._write_kv = write_kv_triton
        self._decode = paged_decode_attention
        self._prefill = paged_prefill_attention
        self.decode_num_splits = decode_num_splits  # None = balanced over the live context lengths
        self._decode_module = paged_decode  # its knobs, read per step (uniform_split)

    @property
    def uniform_split(self) -> bool:
        """Whether runners should tell uniform decode lengths apart (graphs.split_kind): the decode kernel's
        UNIFORM_ONE_WAVE, read at each step so a knob set after the engine was built still counts."""
        return bool(self._decode_module.UNIFORM_ONE_WAVE)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hkv, D] (new tokens). Writes K/V, returns [T, Hq, D] in q's dtype.
        ``kv_cache`` is a layer's cache, fp8 layout included (``rollout.layers.kv_quant``). ``rope``: (positions
        [T], the float32 cos/sin table) when q and k are not rotated yet: one kernel rotates q in place and
        stores the rotated k with v (``rollout.kernels.rope_kv_write``); k itself is left unrotated."""
        kv_cache, kv_scales = cache_views(kv_cache, k)
        if rope is not None:
            from rollout.kernels.rope_kv_write import rope_write_kv  # lazy: the CPU tests' fake kernel modules

            rope_write_kv(q, k, v, rope[0], rope[1], kv_cache, meta.slot_mapping, kv_scales)
        else:
            self._write_kv(kv_cache, k, v, meta.slot_mapping, kv_scales)
        if meta.decode_only:
            assert q.shape[0] == meta.num_seqs, (
                f"decode batch has {q.shape[0]} tokens for {meta.num_seqs} seqs"
            )
            return self._decode(
                q, kv_cache, meta.block_tables, meta.seq_lens, scale,
                sliding_window=sliding_window, num_splits=self.decode_num_splits, kv_scales=kv_scales,
                plans=meta.decode_plans, even_lengths=meta.decode_even_lengths,
            )  # fmt: skip
        rows = meta.decode_rows
        out = self._prefill_rows(q, kv_cache, kv_scales, meta, scale, sliding_window)
        if rows is not None:  # a mixed step's decodes: split-KV with GQA packing, not 64-row prefill tiles
            dec = self._decode(
                q.index_select(0, rows.token_idx), kv_cache, rows.block_tables, rows.seq_lens, scale,
                sliding_window=sliding_window, num_splits=self.decode_num_splits, kv_scales=kv_scales,
                plans=rows.decode_plans,
            )  # fmt: skip
            out.index_copy_(0, rows.token_idx, dec)
        return out

    def _prefill_rows(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor | KVPair,
        kv_scales: torch.Tensor | None,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        """A step's prefill part: [T, Hq, D], every row computed except, when ``meta.decode_rows`` is set, those
        one-token sequences' rows (the decode kernel fills them). The per-phase hook ``FA4PrefillBackend``
        overrides."""
        return self._prefill(
            q, kv_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, scale, meta.max_query_len,
            sliding_window=sliding_window, kv_scales=kv_scales, skip_single=meta.decode_rows is not None,
        )  # fmt: skip
