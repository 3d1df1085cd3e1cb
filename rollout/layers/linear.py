"""Fused projections: one GEMM for q/k/v and one for gate/up instead of three and two.

``LoadSlice`` is how a layer tells the weight mapper where a Hugging Face tensor lands in it: which
rows of our parameter (a fused projection's part) and, under tensor parallelism, which part of the
full HF tensor this rank keeps. Layers without ``load_slices`` take their tensor whole.

``linear`` is the projections' GEMM: cuBLAS (``F.linear``) unless the layer's ``gemm_by_rows`` names another method
for this many rows (``GEMM_METHODS``). Those picks come from the tuner (``rollout.layers.gemm_tune``, engine
``gemm_autotune``) or, for an A/B, from ``gemm_tune.route_rows`` (``scripts/bench.py --decode-knobs
GEMM_SWAP_ROWS=64`` or ``SKINNY_GEMM_ROWS=64``): "swap" asks cuBLAS for the transposed product, out^T = W @ x^T,
copied back to [rows, N], so cuBLAS sees the weight's rows as its M and may pick other tiles (at W1's 32 rows its
qkv and o_proj kernels read their weights at ~0.77 of the byte floor, against 0.92-0.95 for the wider gate_up and
down: H100, bench/results/h100_2026-12-07f_step_profile_w1_*); "skinny" is the split-K Triton GEMM
(``rollout/kernels/skinny_gemm.py``: K split as well as N, so a few rows still cover every SM).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

GEMM_METHODS = ("cublas", "swap", "skinny")  # what a projection's GEMM can run as (``gemm``)


def gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, method: str) -> torch.Tensor:
    """``x @ weight^T + bias`` by ``method``: "cublas" (F.linear), "swap" (cuBLAS's transposed product W @ x^T,
    copied back to [rows, N]) or "skinny" (the split-K Triton GEMM; 2-D ``x`` and ``weight`` with unit stride
    along K). The same sums by other kernels: equal within the GEMM's rounding, not bit for bit."""
    if method == "skinny":
        from rollout.kernels.skinny_gemm import skinny_linear

        return skinny_linear(x, weight, bias)
    if method == "swap":
        out_t = torch.mm(weight, x.t()) if bias is None else torch.addmm(bias[:, None], weight, x.t())
        return out_t.t().contiguous()
    if method != "cublas":
        raise ValueError(f"GEMM method must be one of {GEMM_METHODS}, got {method!r}")
    return F.linear(x, weight, bias)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           by_rows: dict[int, str] | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, or, for a 2-D ``x`` whose row count ``by_rows`` names (the layer's picks),
    that method; "skinny" only where ``x`` and ``weight`` have unit stride along K (what the Triton GEMM reads)."""
    if not by_rows or x.dim() != 2:  # the default: one check, then cuBLAS as nn.Linear
        return F.linear(x, weight, bias)
    method = by_rows.get(x.shape[0])
    if method is None or (method == "skinny" and not (x.stride(1) == 1 and weight.stride(1) == 1)):
        return F.linear(x, weight, bias)
    return gemm(x, weight, bias, method)


@dataclass(frozen=True, slots=True)
class LoadSlice:
    rows: slice | None = None  # rows of our parameter written; None = all of it
    dim: int = 0  # dimension of the HF tensor split across tensor-parallel ranks
    src: slice | None = None  # this rank's part of the HF tensor along ``dim``; None = all (replicated)
    full: int = 0  # the HF tensor's size along ``dim`` (read only when ``src`` is set)


class MergedLinear(nn.Linear):
    """A Linear whose output rows are several Hugging Face projections stacked along dim 0.

    ``output_shards`` names each stacked projection (its HF module name, e.g. ``"q_proj"``) with its
    row count, in stacking order. The weight mapper reads it to route ``...q_proj.weight`` to rows
    ``[0, q_size)`` of ``...qkv_proj.weight``; nothing else needs to know about the fusion.
    """

    def __init__(self, in_features: int, output_shards: tuple[tuple[str, int], ...], bias: bool) -> None:
        assert output_shards and all(size > 0 for _, size in output_shards), output_shards
        super().__init__(in_features, sum(size for _, size in output_shards), bias=bias)
        self.output_shards = output_shards
        self.gemm_by_rows: dict[int, str] = {}  # rows -> GEMM method, set by rollout.layers.gemm_tune

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.gemm_by_rows)

    def shard_slices(self) -> dict[str, slice]:
        """HF projection name -> its rows in this layer's weight (and bias)."""
        out, start = {}, 0
        for name, size in self.output_shards:
            out[name] = slice(start, start + size)
            start += size
        return out

    def load_slices(self, pname: str) -> dict[str | None, LoadSlice]:
        """Sibling HF module name -> where its ``pname`` tensor lands (weight and bias alike)."""
        return {name: LoadSlice(rows) for name, rows in self.shard_slices().items()}
