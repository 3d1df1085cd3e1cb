"""Whether the CUDA runner captures graphs and for which decode batch sizes: decided here for the runner
and for the memory profile, which sizes the graphs' memory pool before the graphs exist."""

from __future__ import annotations

GRAPH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


def graph_sizes(max_graph_batch_size: int, max_num_seqs: int) -> list[int]:
    cap = min(max_graph_batch_size, max_num_seqs)
    return [s for s in GRAPH_SIZES if s <= cap]


def use_cuda_graphs(cuda_graphs: bool | None, backend: str) -> bool:
    """``cuda_graphs=None``: on for every graph-capturable attention backend (all but 'torch')."""
    if cuda_graphs is None:
        return backend != "torch"
    if cuda_graphs and backend == "torch":
        raise ValueError("cuda_graphs=True needs a graph-capturable attention backend ('triton'), not 'torch'")
    return cuda_graphs
