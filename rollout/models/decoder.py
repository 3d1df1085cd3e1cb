"""The decoder body shared by every supported family (Llama 3, Qwen2/2.5, Qwen3, Mistral).

They differ only in a few switches (biases, per-head q/k norm, sliding windows), collected in a
``DecoderSpec`` that each family file derives from its HF config. Module names mirror Hugging Face's
(``model.layers.0.self_attn.o_proj``...) so weight names map one to one, except the fused
``qkv_proj`` / ``gate_up_proj``, which the weight mapper splits back into HF's projections.

The forward takes a flattened batch of new tokens [T] and explicit attention metadata; it has no host
syncs and no data-dependent Python branches, so a CUDA graph can capture it.

The residual stream is carried next to the hidden state (vLLM's pattern) so each residual add is done
by the following norm's ``add_forward``: on CUDA one fused Triton kernel, on the CPU the same torch
ops as HF. Norm, rotary and silu-and-mul pick their Triton kernels themselves when given CUDA tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from rollout.distributed.group import TPGroup
from rollout.layers.activation import check_activation, silu_and_mul
from rollout.layers.attention_metadata import AttentionMetadata
from rollout.layers.norm import RMSNorm
from rollout.layers.parallel import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    column_shards,
    kv_head_slice,
    qkv_shards,
)
from rollout.layers.rotary import RotaryEmbedding, rotate_qk


@dataclass(frozen=True, slots=True)
class DecoderSpec:
    """What distinguishes one family's decoder from another's."""

    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k, before rotary
    sliding_windows: tuple[int | None, ...] | None = None  # per layer; None = full attention everywhere


def head_dim_of(hf_config: Any) -> int:
    """Explicit ``head_dim`` when the config sets one (Qwen3: not hidden / heads), else hidden / heads."""
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


def layer_type_windows(hf_config: Any) -> tuple[int | None, ...] | None:
    """Qwen2/Qwen3: ``sliding_window`` applies only to layers typed "sliding_attention".

    transformers >= 4.53 lists ``layer_types``; older configs say ``use_sliding_window`` and slide
    layers from ``max_window_layers`` on.
    """
    window = getattr(hf_config, "sliding_window", None)
    if window is None or not getattr(hf_config, "use_sliding_window", True):
        return None
    n = hf_config.num_hidden_layers
    types = getattr(hf_config, "layer_types", None)
    if types is None:
        first = getattr(hf_config, "max_window_layers", 0)
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
    return tuple(window if t == "sliding_attention" else None for t in types)


class Attention(nn.Module):
    """Under tensor parallelism this rank's q heads and the KV heads they read (see ``qkv_shards``)."""

    def __init__(self, hf_config: Any, spec: DecoderSpec, sliding_window: int | None, tp: TPGroup) -> None:
        super().__init__()
        hidden = hf_config.hidden_size
        heads, kv_heads = hf_config.num_attention_heads, hf_config.num_key_value_heads
        self.head_dim = head_dim_of(hf_config)
        if heads % kv_heads:
            raise ValueError(
                f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})"
            )
        shards = qkv_shards(heads, kv_heads, self.head_dim, tp)
        q_size, kv_size = (s.stop - s.start for _, _, s in shards[:2])
        self.num_heads, self.num_kv_heads = q_size // self.head_dim, kv_size // self.head_dim
        self.sizes = (q_size, kv_size, kv_size)
        self.scale = self.head_dim**-0.5
        self.sliding_window = sliding_window
        self.qkv_proj = MergedColumnParallelLinear(hidden, shards, bias=spec.qkv_bias)
        self.o_proj = RowParallelLinear(heads * self.head_dim, hidden, spec.o_bias, tp, "num_attention_heads")
        if spec.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, hf_config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, hf_config.rms_norm_eps)
        self.qk_norm = spec.qk_norm

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        attn_backend: Any,
    ) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.sizes, dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if attn_backend.fuses_rope:  # rotary fused with the K/V store (the Triton backends, when on)
            o = attn_backend.forward(q, k, v, kv_cache, meta, self.scale, sliding_window=self.sliding_window,
                                     rope=(positions, cos_sin_cache))
        else:
            q, k = rotate_qk(q, k, positions, cos_sin_cache)
            o = attn_backend.forward(q, k, v, kv_cache, meta, self.scale, sliding_window=self.sliding_window)
        return self.o_proj(o.reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, hf_config: Any, spec: DecoderSpec, tp: TPGroup) -> None:
        super().__init__()
        check_activation(hf_config.hidden_act)
        hidden, inter = hf_config.hidden_size, hf_config.intermediate_size
        shards = column_shards(("gate_proj", "up_proj"), inter, tp, "intermediate_size")
        self.gate_up_proj = MergedColumnParallelLinear(hidden, shards, bias=spec.mlp_bias)
        self.down_proj = RowParallelLinear(inter, hidden, spec.mlp_bias, tp, "intermediate_size")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, hf_config: Any, spec: DecoderSpec, sliding_window: int | None, tp: TPGroup) -> None:
        super().__init__()
        self.self_attn = Attention(hf_config, spec, sliding_window, tp)
        self.mlp = MLP(hf_config, spec, tp)
        self.input_layernorm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)

    def forward(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        attn_backend: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, residual stream before it); the next norm adds the two.

        ``residual`` is None for the first layer, whose input is the embedding itself. The adds
        happen in the model dtype exactly where HF does them (``h = h + sublayer(...)``).
        """
        if residual is None:
            x, residual = self.input_layernorm(h), h
        else:
            x, residual = self.input_layernorm.add_forward(h, residual)
        x = self.self_attn(x, positions, cos_sin_cache, kv_cache, meta, attn_backend)
        x, residual = self.post_attention_layernorm.add_forward(x, residual)
        return self.mlp(x), residual


class DecoderModel(nn.Module):
    """HF's ``model.`` submodule: embeddings, layers, final norm (plus the shared rotary table)."""

    def __init__(self, hf_config: Any, spec: DecoderSpec, tp: TPGroup) -> None:
        super().__init__()
        n = hf_config.num_hidden_layers
        windows = spec.sliding_windows or (None,) * n
        assert len(windows) == n, (windows, n)
        self.embed_tokens = VocabParallelEmbedding(hf_config.vocab_size, hf_config.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(hf_config, spec, windows[i], tp) for i in range(n))
        self.norm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding.from_config(hf_config, head_dim_of(hf_config))

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        attn_backend: Any,
    ) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        residual: torch.Tensor | None = None
        cache = self.rotary_emb.cos_sin_cache
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            h, residual = layer(h, residual, positions, cache, kv_cache, meta, attn_backend)
        if residual is None:  # no layers
            return self.norm(h)
        return self.norm.add_forward(h, residual)[0]


class DecoderForCausalLM(nn.Module):
    """The interface the model runner calls; family classes only choose the ``DecoderSpec``.

    ``tp`` (default: one rank) makes this one rank's shard: ``num_kv_heads`` is then this rank's KV
    heads (what its KV cache holds) and ``compute_logits`` returns its slice of the vocabulary,
    ``[vocab_start, vocab_start + vocab_size / world_size)``, for the vocabulary-parallel sampler.
    """

    def __init__(self, hf_config: Any, spec: DecoderSpec, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.tp = tp = tp or TPGroup.single()
        self.hf_config = hf_config
        self.num_layers = hf_config.num_hidden_layers
        self.head_dim = head_dim_of(hf_config)
        self.vocab_size = hf_config.vocab_size
        self.max_position_embeddings = hf_config.max_position_embeddings
        self.sliding_windows = spec.sliding_windows or (None,) * self.num_layers
        self.model = DecoderModel(hf_config, spec, tp)
        kv = kv_head_slice(hf_config.num_key_value_heads, tp.rank, tp.world_size)
        self.num_kv_heads = kv.stop - kv.start
        self.lm_head = ParallelLMHead(hf_config.hidden_size, hf_config.vocab_size, tp)
        self.vocab_start = self.lm_head.rows.start
        if getattr(hf_config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight  # one storage: updates reach both

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        attn_backend: Any,
    ) -> torch.Tensor:
        """[T] token ids at [T] positions -> [T, hidden] final-normed hidden states; writes K/V."""
        return self.model(input_ids, positions, kv_caches, meta, attn_backend)

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32 (the lm_head GEMM runs in the model dtype, like HF). ``float32=False``
        keeps the GEMM's dtype: the fused sampler converts in registers, so a decode step writes no [N, vocab]
        float32 copy (0.11 ms per step at 256 rows of a 152K vocabulary on the H200)."""
        logits = self.lm_head(hidden)
        return logits.float() if float32 else logits

    def weight_bytes_per_step(self) -> int:
        """Weight bytes one forward step must read: every parameter, except an untied input embedding
        (only the batch's rows of it are gathered; a tied one is read whole by the lm_head)."""
        total = sum(p.numel() * p.element_size() for p in self.parameters())
        emb = self.model.embed_tokens.weight
        if self.lm_head.weight is not emb:
            total -= emb.numel() * emb.element_size()
        return total
