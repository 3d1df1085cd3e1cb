"""Helpers shared by tests: tiny random Hugging Face models, checkpoints and attention metadata.

Nothing is downloaded: models are built from configs with a fixed seed. Weights are drawn with a
larger std than HF's 0.02 so that attention patterns and positions visibly change the logits (with
near-flat logits a wrong mask or rotary could hide under the 1e-4 tolerance).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen3Config,
)

from rollout.layers.attention_metadata import AttentionMetadata

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")

_COMMON: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.1,
)


def tiny_config(family: str, **overrides: Any) -> Any:
    """The tiny config of one family: llama with llama3 rope scaling, qwen2 tied with qkv bias,
    qwen3 with an explicit head_dim != hidden / heads, mistral with a short sliding window."""
    if family == "llama":
        rope = dict(
            rope_type="llama3",
            rope_theta=500000.0,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
        )
        kwargs = dict(_COMMON, rope_parameters=rope, tie_word_embeddings=False)
        cls = LlamaConfig
    elif family == "qwen2":
        kwargs, cls = dict(_COMMON, tie_word_embeddings=True), Qwen2Config
    elif family == "qwen3":
        kwargs, cls = dict(_COMMON, head_dim=32, tie_word_embeddings=False), Qwen3Config
    elif family == "mistral":
        kwargs, cls = dict(_COMMON, sliding_window=8, tie_word_embeddings=False), MistralConfig
    else:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
    kwargs.update(overrides)
    return cls(**kwargs)


def make_tiny_hf_model(family: str, seed: int = 0, **overrides: Any) -> PreTrainedModel:
    """A seeded float32 HF model in eval mode with eager attention (the plainest oracle)."""
    config = tiny_config(family, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def save_tiny_checkpoint(model: PreTrainedModel, directory: str | Path, shards: int = 1) -> Path:
    """config.json + safetensors via ``save_pretrained``; ``shards > 1`` writes an index and several files."""
    assert shards >= 1, shards
    directory = Path(directory)
    if shards == 1:
        model.save_pretrained(directory)
    else:
        total = sum(p.numel() * p.element_size() for p in model.parameters())
        model.save_pretrained(directory, max_shard_size=math.ceil(total / shards))
        assert (directory / "model.safetensors.index.json").is_file()
    return directory


def make_metadata(
    seq_specs: list[tuple[int, int]],
    block_size: int,
    num_blocks: int,
    device: str | torch.device = "cpu",
) -> AttentionMetadata:
    """Metadata for sequences given as (context_len already cached, new_tokens this step).

    Blocks are allocated interleaved (block j of sequence i is ``j * B + i``) so a sequence's blocks
    are never contiguous, and the same sequence gets the same blocks at every step.
    """
    num_seqs = len(seq_specs)
    seq_lens = [ctx + new for ctx, new in seq_specs]
    blocks_needed = [(n + block_size - 1) // block_size for n in seq_lens]
    assert max(blocks_needed) * num_seqs <= num_blocks, (seq_specs, block_size, num_blocks)
    width = max(blocks_needed)
    tables = [
        [j * num_seqs + i if j < need else 0 for j in range(width)] for i, need in enumerate(blocks_needed)
    ]
    positions, slots, starts = [], [], [0]
    for i, (ctx, new) in enumerate(seq_specs):
        for p in range(ctx, ctx + new):
            positions.append(p)
            slots.append(tables[i][p // block_size] * block_size + p % block_size)
        starts.append(starts[-1] + new)
    return AttentionMetadata(
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
        max_query_len=max(new for _, new in seq_specs),
        max_seq_len=max(seq_lens),
        decode_only=all(new == 1 for _, new in seq_specs),
        query_lens_host=[new for _, new in seq_specs],
        seq_lens_host=seq_lens,
    )


def make_kv_caches(
    model: Any, num_blocks: int, block_size: int, dtype: torch.dtype | None = None
) -> list[torch.Tensor]:
    """One zeroed ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` cache per layer of our model."""
    shape = (2, num_blocks, block_size, model.num_kv_heads, model.head_dim)
    dtype = dtype or next(model.parameters()).dtype
    return [torch.zeros(shape, dtype=dtype) for _ in range(model.num_layers)]


@torch.no_grad()
def hf_logits(hf_model: PreTrainedModel, token_ids: list[int]) -> torch.Tensor:
    """[L, vocab] float32 logits of HF's own full forward over one sequence."""
    ids = torch.tensor([token_ids], dtype=torch.int64)
    return hf_model(input_ids=ids).logits[0].float()
