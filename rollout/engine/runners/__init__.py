"""Runners: a plan in, sampled tokens out (``base.Runner``). ``CpuRunner`` is the synchronous path on any
device; ``CudaRunner`` the asynchronous GPU path (streams, IO slots, carry-over, graphs)."""

from __future__ import annotations

import torch

from rollout.config import EngineConfig
from rollout.engine.runners.base import Runner
from rollout.engine.runners.cpu import CpuRunner
from rollout.engine.runners.cuda import CudaRunner
from rollout.engine.runners.graphs import use_cuda_graphs
from rollout.engine.runners.kv_cache import KVCache
from rollout.layers.backends import AttentionSpec


def build_runner(model: torch.nn.Module, kv: KVCache, c: EngineConfig, attn: AttentionSpec, device: torch.device,
                 max_model_len: int) -> Runner:
    """The runner for one rank's model (every tensor-parallel rank builds its own with this too)."""
    if device.type != "cuda":
        return CpuRunner(model, kv, c.block_size, attn.build(), device, c.max_num_seqs)
    return CudaRunner(
        model, kv, c.block_size, attn.build(), device,
        max_num_seqs=c.max_num_seqs, max_num_rows=c.num_rows, max_num_batched_tokens=c.max_num_batched_tokens,
        max_model_len=max_model_len, cuda_graphs=use_cuda_graphs(c.cuda_graphs, attn.backend),
        max_graph_batch_size=c.max_graph_batch_size, gemm_autotune=c.gemm_autotune,
    )
