"""A mixed step's one-token sequences, picked on the host for the decode kernel (``mixed_decode_rows``)."""

from types import SimpleNamespace

import torch

from rollout.engine.runners.base import MIN_MIXED_DECODE_ROWS, mixed_decode_rows
from rollout.layers.attention import TorchAttentionBackend
from rollout.layers.attention_metadata import AttentionMetadata
from rollout.layers.flash_attn_backend import FlashAttnBackend
from rollout.layers.triton_backend import TritonAttentionBackend


def _step(q_lens: list[int]) -> tuple[SimpleNamespace, AttentionMetadata]:
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    b = len(q_lens)
    seq_lens = [n + 10 * i for i, n in enumerate(q_lens)]
    h = SimpleNamespace(decode_only=all(n == 1 for n in q_lens), query_lens=q_lens, query_start_loc=starts)
    meta = AttentionMetadata(
        positions=torch.zeros(starts[-1], dtype=torch.int64), slot_mapping=torch.zeros(starts[-1], dtype=torch.int64),
        query_start_loc=torch.tensor(starts, dtype=torch.int32), seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.arange(b * 3, dtype=torch.int32).view(b, 3), max_query_len=max(q_lens),
        max_seq_len=max(seq_lens), decode_only=h.decode_only)
    return h, meta


def test_picks_the_one_token_sequences_of_a_mixed_step() -> None:
    q_lens = [1] * 10 + [37] + [1] * 10 + [5]
    h, meta = _step(q_lens)
    rows = mixed_decode_rows(h, meta)
    seqs = [i for i, n in enumerate(q_lens) if n == 1]
    assert rows is not None
    assert rows.token_idx.tolist() == [h.query_start_loc[i] for i in seqs]
    assert torch.equal(rows.block_tables, meta.block_tables[seqs])
    assert torch.equal(rows.seq_lens, meta.seq_lens[seqs])


def test_none_for_decode_only_steps_and_few_decodes() -> None:
    assert mixed_decode_rows(*_step([1] * 40)) is None  # decode-only: the decode kernel takes it whole anyway
    assert mixed_decode_rows(*_step([1] * (MIN_MIXED_DECODE_ROWS - 1) + [9])) is None


def test_only_the_triton_backend_asks_for_them() -> None:
    assert TritonAttentionBackend.uses_decode_rows
    assert not TorchAttentionBackend.uses_decode_rows and not FlashAttnBackend.uses_decode_rows
