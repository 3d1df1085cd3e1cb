"""Tensor-parallel layers (Megatron's split): each rank holds a slice of every large weight.

- ``MergedColumnParallelLinear``: q/k/v and gate/up, split by output rows (heads / intermediate
  units); no communication, each rank computes its own heads.
- ``RowParallelLinear``: o_proj and down_proj, split by input columns; partial sums are all-reduced
  (the bias is added once, after the sum).
- ``VocabParallelEmbedding`` / ``ParallelLMHead``: split by vocabulary rows. The embedding looks up
  the ids it owns and zeroes the rest, then all-reduces; the LM head returns this rank's logits only
  and the vocabulary-parallel sampler reduces across ranks.

With ``TPGroup.single()`` every layer computes exactly what its plain torch counterpart does. Each
layer reports, through ``load_slices``, which part of the full Hugging Face tensor it keeps, so
loading and ``update_weights`` take full tensors and shard them on arrival.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from rollout.distributed.group import TPGroup, split_evenly
from rollout.layers.linear import LoadSlice, MergedLinear, linear

# (HF projection name, rows of the full HF tensor, this rank's rows of it)
ColumnShard = tuple[str, int, slice]


class MergedColumnParallelLinear(MergedLinear):
    """A fused projection holding this rank's rows of each stacked HF projection."""

    def __init__(self, in_features: int, shards: tuple[ColumnShard, ...], bias: bool) -> None:
        super().__init__(in_features, tuple((name, s.stop - s.start) for name, _, s in shards), bias)
        self.sources = {name: (full, s) for name, full, s in shards}

    def load_slices(self, pname: str) -> dict[str | None, LoadSlice]:
        out = {}
        for name, rows in self.shard_slices().items():
            full, src = self.sources[name]
            out[name] = LoadSlice(rows, 0, src, full)
        return out


class RowParallelLinear(nn.Linear):
    """y = sum over ranks of x_r @ W_r^T, plus the bias once. ``in_features`` is the full width."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup, what: str) -> None:
        cols = tp.split(in_features, what)
        super().__init__(cols.stop - cols.start, out_features, bias=bias)
        self.cols, self.full_in, self.tp = cols, in_features, tp
        self.gemm_by_rows: dict[int, str] = {}  # rows -> GEMM method, set by rollout.layers.gemm_tune

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.tp.is_parallel:
            return linear(x, self.weight, self.bias, self.gemm_by_rows)
        y = self.tp.all_reduce(linear(x, self.weight, None, self.gemm_by_rows))
        return y if self.bias is None else y + self.bias

    def load_slices(self, pname: str) -> dict[str | None, LoadSlice]:
        if pname == "weight":
            return {None: LoadSlice(None, 1, self.cols, self.full_in)}
        return {None: LoadSlice()}  # the bias is replicated


class VocabParallelEmbedding(nn.Embedding):
    """This rank's rows of the embedding; ids owned elsewhere look up zeros, then ranks sum."""

    def __init__(self, vocab_size: int, hidden: int, tp: TPGroup) -> None:
        rows = tp.split(vocab_size, "vocab_size")
        super().__init__(rows.stop - rows.start, hidden)
        self.rows, self.full_vocab, self.tp = rows, vocab_size, tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.tp.is_parallel:
            return F.embedding(ids, self.weight)
        local = ids - self.rows.start
        owned = (local >= 0) & (local < self.weight.shape[0])
        h = F.embedding(torch.where(owned, local, torch.zeros_like(local)), self.weight)
        return self.tp.all_reduce(h.masked_fill(~owned[:, None], 0.0))

    def load_slices(self, pname: str) -> dict[str | None, LoadSlice]:
        return {None: LoadSlice(None, 0, self.rows, self.full_vocab)}


class ParallelLMHead(nn.Linear):
    """This rank's vocabulary rows of the LM head: forward gives [N, vocab / world_size] logits."""

    def __init__(self, hidden: int, vocab_size: int, tp: TPGroup) -> None:
        rows = tp.split(vocab_size, "vocab_size")
        super().__init__(hidden, rows.stop - rows.start, bias=False)
        self.rows, self.full_vocab = rows, vocab_size

    def load_slices(self, pname: str) -> dict[str | None, LoadSlice]:
        return {None: LoadSlice(None, 0, self.rows, self.full_vocab)}


def qkv_shards(num_heads: int, num_kv_heads: int, head_dim: int, tp: TPGroup) -> tuple[ColumnShard, ...]:
    """This rank's q heads (an equal split) and k/v heads: split when there are at least as many KV
    heads as ranks, else the one KV head its q heads attend to, replicated on several ranks."""
    q = split_evenly(num_heads, tp.rank, tp.world_size, "num_attention_heads")
    kv = kv_head_slice(num_kv_heads, tp.rank, tp.world_size)
    d = head_dim

    def rows(s: slice) -> slice:
        return slice(s.start * d, s.stop * d)

    return (("q_proj", num_heads * d, rows(q)), ("k_proj", num_kv_heads * d, rows(kv)),
            ("v_proj", num_kv_heads * d, rows(kv)))


def column_shards(names: tuple[str, ...], full: int, tp: TPGroup, what: str) -> tuple[ColumnShard, ...]:
    """Stacked projections of ``full`` rows each (gate/up), every one split evenly."""
    rows = tp.split(full, what)
    return tuple((name, full, rows) for name in names)


def kv_head_slice(num_kv_heads: int, rank: int, world_size: int) -> slice:
    if num_kv_heads >= world_size:
        return split_evenly(num_kv_heads, rank, world_size, "num_key_value_heads")
    if world_size % num_kv_heads:
        raise ValueError(f"tensor_parallel_size ({world_size}) must be a multiple of num_key_value_heads "
                         f"({num_kv_heads}) when larger than it")
    head = rank * num_kv_heads // world_size
    return slice(head, head + 1)


def check_tp_shapes(hf_config: Any, tp_size: int) -> None:
    """Raise ValueError naming the first size a split over ``tp_size`` ranks cannot divide (before any
    worker starts)."""
    split_evenly(hf_config.num_attention_heads, 0, tp_size, "num_attention_heads")
    kv_head_slice(hf_config.num_key_value_heads, 0, tp_size)
    split_evenly(hf_config.intermediate_size, 0, tp_size, "intermediate_size")
    split_evenly(hf_config.vocab_size, 0, tp_size, "vocab_size")
