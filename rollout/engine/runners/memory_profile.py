"""Measure the GPU memory a step needs besides the weights and the KV cache, before sizing the cache.

A step's workspace (activations, the attention kernels' split buffers, the lm_head's logits and the
sampler's [rows, vocab] float32 temporaries) grows with the batch: at 256 rows and a 152K vocab the
sampler alone holds about 2 GiB. A cache sized without it runs out of memory mid-run, so the engine
runs dummy steps at its largest shapes first, with the heaviest sampler variant (temperature,
top-k/top-p/min-p and suppressed ids all on), and reads the allocator's peak:

* a decode step of ``max_num_seqs`` sequences (eager decode beyond the largest CUDA graph), and one at
  the largest graph size: captured graphs allocate from their own pool, which eager steps cannot use;
* a mixed step of ``max_num_batched_tokens`` new tokens over up to ``max_num_seqs`` sequences.

The dummy steps write no K/V (every slot is -1) and read one zeroed block, so they need no real
cache. Only CUDA is measured; the CPU keeps its fixed ``cpu_kv_cache_gib`` budget. A tensor-parallel
rank measures alone (rank 0 in the engine, each worker as it builds its cache), so its collectives run
as local stand-ins of the same shapes (``TPGroup.local``): real ones would wait for peers doing other
work, for ever.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from rollout.config import EngineConfig
from rollout.engine.runners.base import forward_and_sample
from rollout.engine.runners.graphs import graph_sizes, use_cuda_graphs
from rollout.layers.attention_metadata import AttentionMetadata
from rollout.layers.backends import AttentionSpec
from rollout.layers.sampler import MODE_POLICY, SamplingTensors

MARGIN_FRACTION = 0.05  # allocator fragmentation, per-stream cuBLAS workspaces, IO slots
MARGIN_BYTES = 256 * 2**20
MAX_SUPPRESS = 16  # the CUDA runner's suppressed ids per row in a graph


def local_collectives(model: torch.nn.Module) -> Any:
    """The model's tensor-parallel group in local mode (a no-op context for an unsharded model)."""
    tp = getattr(model, "tp", None)
    return tp.local() if tp is not None else contextlib.nullcontext()


def _metadata(q_lens: list[int], max_blocks: int, device: torch.device) -> AttentionMetadata:
    """A batch of fresh sequences (seq_len == q_len) that writes nothing and reads block 0 only."""
    t, b = sum(q_lens), len(q_lens)
    qsl = torch.tensor([0] + q_lens, device=device).cumsum(0).to(torch.int32)
    return AttentionMetadata(
        positions=torch.cat([torch.arange(n, device=device) for n in q_lens]),
        slot_mapping=torch.full((t,), -1, dtype=torch.int64, device=device),
        query_start_loc=qsl,
        seq_lens=torch.tensor(q_lens, dtype=torch.int32, device=device),
        block_tables=torch.zeros((b, max_blocks), dtype=torch.int32, device=device),
        max_query_len=max(q_lens),
        max_seq_len=max(q_lens),
        decode_only=all(n == 1 for n in q_lens),
        query_lens_host=list(q_lens),
        seq_lens_host=list(q_lens),
    )


def _sampling(rows: int, device: torch.device) -> SamplingTensors:
    """Every sampler feature on, the most memory it can take."""
    suppress = torch.full((rows, MAX_SUPPRESS), -1, dtype=torch.int64, device=device)
    suppress[:, 0] = 0
    return SamplingTensors(
        temperature=torch.ones(rows, device=device),
        top_k=torch.full((rows,), 50, dtype=torch.int64, device=device),
        top_p=torch.full((rows,), 0.9, device=device),
        min_p=torch.full((rows,), 0.05, device=device),
        seed=torch.arange(rows, dtype=torch.int64, device=device),
        position=torch.zeros(rows, dtype=torch.int64, device=device),
        mode=torch.full((rows,), MODE_POLICY, dtype=torch.int64, device=device),
        suppress_ids=suppress,
        needs_filter=True,
        all_greedy=False,
    )


def dummy_step(model: torch.nn.Module, kv_caches: list[torch.Tensor], backend: object, q_lens: list[int],
               max_blocks: int, device: torch.device, before_forward=None) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward + sample of fresh sequences of ``q_lens`` tokens, each sampled; returns (tokens, logprobs)."""
    meta = _metadata(q_lens, max_blocks, device)
    ids = torch.zeros(sum(q_lens), dtype=torch.int64, device=device)
    last = meta.query_start_loc[1:].long() - 1
    st = _sampling(len(q_lens), device)
    if before_forward is not None:
        before_forward()
    out = forward_and_sample(model, kv_caches, backend, ids, meta, last, st)  # the runners' own step
    return out.tokens, out.logprobs


def _step_peak(model: torch.nn.Module, kv_caches: list[torch.Tensor], backend: object, q_lens: list[int],
               max_blocks: int, device: torch.device) -> int:
    """Bytes allocated at the peak of one forward + sample, above what was allocated before it."""
    base = []

    def reset() -> None:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base.append(torch.cuda.memory_allocated(device))

    out = dummy_step(model, kv_caches, backend, q_lens, max_blocks, device, before_forward=reset)
    del out
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base[0]


def mixed_q_lens(config: EngineConfig, max_model_len: int) -> list[int]:
    """The largest mixed step: ``max_num_batched_tokens`` new tokens over up to ``max_num_seqs``
    sequences (each sampled), none longer than ``max_model_len``."""
    n = min(config.max_num_seqs, config.max_num_batched_tokens)
    lens = [1] * n
    left = config.max_num_batched_tokens - n
    for i in range(n):
        extra = min(left, max_model_len - 1)
        lens[i] += extra
        left -= extra
        if not left:
            break
    return lens


def decode_rows(config: EngineConfig, graphs: bool) -> tuple[int, int]:
    """(rows of the eager decode step to measure, rows of the largest captured graph or 0). Both are
    measured and added even when graphs cover every batch size up to ``max_num_seqs``: a step whose
    suppressed ids outgrow the graphs' table still decodes eagerly, and graphs allocate from their own pool."""
    graph_b = graph_sizes(config.max_graph_batch_size, config.num_rows)[-1] if graphs else 0
    return config.num_rows, graph_b


@torch.inference_mode()
def measure_step_workspace(model: torch.nn.Module, config: EngineConfig, attn: AttentionSpec,
                           device: torch.device, max_model_len: int, dummy_caches: list[torch.Tensor]) -> int:
    """Bytes to keep free beside the KV cache (margin included). ``dummy_caches``: one-block caches in
    the real layout, one per layer."""
    backend = attn.build()
    graphs = use_cuda_graphs(config.cuda_graphs, attn.backend)
    max_blocks = -(-max_model_len // config.block_size)
    seqs, graph_b = decode_rows(config, graphs)
    # Each tensor-parallel rank sizes its own cache alone: its collectives must not wait for peers.
    with local_collectives(model):
        eager = max(
            _step_peak(model, dummy_caches, backend, [1] * seqs, max_blocks, device),
            _step_peak(model, dummy_caches, backend, mixed_q_lens(config, max_model_len), max_blocks, device),
        )
        pool = _step_peak(model, dummy_caches, backend, [1] * graph_b, max_blocks, device) if graph_b else 0
    torch.cuda.empty_cache()
    need = eager + pool
    return int(need * (1 + MARGIN_FRACTION)) + MARGIN_BYTES
