"""Whether the CUDA runner captures graphs and for which decode batch sizes: decided here for the runner
and for the memory profile, which sizes the graphs' memory pool before the graphs exist."""

from __future__ import annotations

import bisect

# Padded decode batch sizes with a captured graph: dense where a padding row costs the most, every
# 64 up to 512 (EngineConfig's default cap, vLLM's too), every 128 beyond for larger caps.
GRAPH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512, 640, 768, 896, 1024)


def graph_sizes(max_graph_batch_size: int, max_num_seqs: int) -> list[int]:
    """Sizes to capture: those up to ``min(max_graph_batch_size, max_num_seqs)``, and that cap itself
    when it falls between two (so a decode step of ``max_num_seqs`` sequences always has a graph when
    ``max_graph_batch_size >= max_num_seqs``, and no graph is larger than the batch can be)."""
    cap = min(max_graph_batch_size, max_num_seqs, GRAPH_SIZES[-1])
    sizes = [s for s in GRAPH_SIZES if s <= cap]
    if sizes[-1] != cap:
        sizes.append(cap)
    return sizes


def padded_size(sizes: list[int], batch: int) -> int:
    """The captured size a decode batch of ``batch`` sequences replays (padded up), or 0: eager."""
    i = bisect.bisect_left(sizes, batch)
    return sizes[i] if i < len(sizes) else 0


def even_lengths(lens: list[int]) -> bool:
    """A decode batch's context lengths are even: the longest at most twice the mean (no long tail to balance)."""
    return bool(lens) and max(lens) * len(lens) <= 2 * sum(lens)


# A decode step's split kind (``AttentionMetadata.decode_even_lengths``; the decode kernel's ``even_lengths``): a
# long tail takes the balanced partition, even lengths the fixed split, and uniform ones (the longest within 1/8 of
# the shortest: every sequence of W1, W1-short and W3, which start together and never stop early) one wave's count.
UNEVEN, EVEN, UNIFORM = 0, 1, 2


def split_kind(lens: list[int], uniform: bool = False) -> int:
    """UNEVEN, EVEN or (with ``uniform``, the attention backend's ``uniform_split``) UNIFORM for these lengths."""
    if not even_lengths(lens):
        return UNEVEN
    return UNIFORM if uniform and max(lens) * 8 <= min(lens) * 9 else EVEN


def use_cuda_graphs(cuda_graphs: bool | None, backend: str) -> bool:
    """``cuda_graphs=None``: on for every graph-capturable attention backend (all but 'torch')."""
    if cuda_graphs is None:
        return backend != "torch"
    if cuda_graphs and backend == "torch":
        raise ValueError("cuda_graphs=True needs a graph-capturable attention backend ('triton'), not 'torch'")
    return cuda_graphs
