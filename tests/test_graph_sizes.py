"""Which decode batch sizes replay a CUDA graph, and the graph memory the KV sizing sets aside (CPU)."""

from __future__ import annotations

import pytest

from rollout.config import EngineConfig
from rollout.engine.runners.graphs import graph_sizes, padded_size
from rollout.engine.runners.memory_profile import decode_rows


def test_default_config_graphs_every_decode_batch_up_to_512():
    config = EngineConfig(max_num_seqs=512)
    assert config.max_graph_batch_size == 512
    sizes = graph_sizes(config.max_graph_batch_size, config.max_num_seqs)
    assert sizes[-1] == 512 and sizes == sorted(set(sizes))
    for batch in range(1, 513):  # no decode step of max_num_seqs=512 falls back to eager
        padded = padded_size(sizes, batch)
        assert padded in sizes and batch <= padded
        assert padded == batch == 1 or padded < 2 * batch  # padding rows stay under half the step
    assert padded_size(sizes, 513) == 0


@pytest.mark.parametrize("cap,seqs,largest", [(512, 256, 256), (256, 512, 256), (512, 300, 300), (1024, 1000, 1000),
                                              (2048, 4096, 1024), (64, 64, 64)])
def test_graph_sizes_reach_the_cap(cap, seqs, largest):
    """The largest graph is min(max_graph_batch_size, max_num_seqs) even between listed sizes (so a
    full batch replays a graph), never larger than a batch can be; beyond 1024, eager."""
    sizes = graph_sizes(cap, seqs)
    assert sizes[-1] == largest and all(s <= min(cap, seqs) for s in sizes)


def test_kv_sizing_measures_the_largest_graph_beside_eager_decode():
    assert decode_rows(EngineConfig(max_num_seqs=512), graphs=True) == (512, 512)
    assert decode_rows(EngineConfig(max_num_seqs=512, max_graph_batch_size=256), graphs=True) == (512, 256)
    assert decode_rows(EngineConfig(max_num_seqs=512), graphs=False) == (512, 0)


def test_even_lengths() -> None:
    """Even: the longest context at most twice the mean (the decode kernel's fixed split); a long tail is not."""
    from rollout.engine.runners.graphs import even_lengths

    assert even_lengths([300, 280, 310]) and even_lengths([5]) and even_lengths([2, 2, 2, 6])
    assert not even_lengths([100] * 7 + [16000]) and not even_lengths([1, 1, 1, 7])
    assert not even_lengths([])


def test_split_kind() -> None:
    """Uneven / even / uniform (the longest within 1/8 of the shortest), uniform only when the backend asks."""
    from rollout.engine.runners.graphs import EVEN, UNEVEN, UNIFORM, split_kind

    assert split_kind([100] * 7 + [16000], uniform=True) == UNEVEN
    assert split_kind([300, 280, 310], uniform=True) == UNIFORM  # 310 <= 280 * 9 / 8
    assert split_kind([300, 280, 310]) == EVEN  # not asked: uniform steps stay on the even path (and its graphs)
    assert split_kind([2, 2, 2, 6], uniform=True) == EVEN
    assert split_kind([1152] * 32, uniform=True) == UNIFORM  # W1-short: every sequence the same length
    assert split_kind([800, 900], uniform=True) == UNIFORM and split_kind([800, 901], uniform=True) == EVEN
