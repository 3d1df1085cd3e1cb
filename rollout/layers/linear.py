"""Fused projections: one GEMM for q/k/v and one for gate/up instead of three and two.

``LoadSlice`` is how a layer tells the weight mapper where a Hugging Face tensor lands in it: which
rows of our parameter (a fused projection's part) and, under tensor parallelism, which part of the
full HF tensor this rank keeps. Layers without ``load_slices`` take their tensor whole.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


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
