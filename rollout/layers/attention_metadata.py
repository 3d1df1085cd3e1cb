"""Per-step attention metadata. Built by the model runner each step and passed explicitly to every
layer (no module-level context, unlike nano-vllm)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class DecodeRows:
    """The one-token sequences of a mixed (not decode-only) step: see ``AttentionMetadata.decode_rows``."""

    token_idx: torch.Tensor  # [Bd] int64: their rows of the flattened token axis
    block_tables: torch.Tensor  # [Bd, max_blocks] int32
    seq_lens: torch.Tensor  # [Bd] int32
    decode_plans: dict | None = None  # as AttentionMetadata.decode_plans, for these rows


@dataclass(slots=True)
class AttentionMetadata:
    """Describes one flattened batch of new tokens against the paged KV cache.

    The batch holds B sequences; sequence i contributes the new tokens
    ``query_start_loc[i]:query_start_loc[i+1]`` of the flattened [T] token axis. Those tokens sit
    at the *end* of its context of ``seq_lens[i]`` tokens (cached prefix + new tokens), so new token j
    of sequence i has position ``seq_lens[i] - q_len_i + j`` and attends causally to positions <= its own.

    KV cache of one layer: ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (0 = K, 1 = V).
    Token at position p of sequence i lives in block ``block_tables[i, p // block_size]`` at offset
    ``p % block_size``; ``slot_mapping[t] = block * block_size + offset`` is where new token t's K/V
    is written (-1 = padding, not written).
    """

    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks_per_seq] int32, padded with 0
    max_query_len: int
    max_seq_len: int
    decode_only: bool  # every sequence has exactly one new token
    # Host copies, for backends that loop on the CPU (the torch reference).
    query_lens_host: list[int] | None = None
    seq_lens_host: list[int] | None = None
    # A mixed step's one-token sequences (decodes), for backends that give them the decode kernel: their token
    # indices [Bd] int64, block tables [Bd, max_blocks] and seq_lens [Bd] (gathered once per step, not per layer).
    decode_rows: DecodeRows | None = None
    # Per-step scratch of the decode kernel: its work partition over the live lengths, made by the first layer and
    # reused by the others (rollout.kernels.paged_decode.decode_plan). Opt-in: only a caller that builds fresh
    # metadata for every forward (the model runners) may set a dict; metadata reused across steps with its tensors
    # updated in place (or across a warm-up and a CUDA-graph capture) must leave it None, or a later step would read
    # an earlier step's partition. None: every layer's kernel partitions for itself.
    decode_plans: dict | None = None
    # A decode-only step whose live context lengths the runner found even (longest <= 2 x mean, from its host
    # copies): the decode kernel may take a fixed split count for the batch size (paged_decode_attention's
    # ``even_lengths``). A runner replaying graphs keys them by it, so the kernel's choice stays a host constant.
    # 0 / False: uneven, 1 / True: even, 2: uniform (rollout.engine.runners.graphs.split_kind).
    decode_even_lengths: int = 0

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])
