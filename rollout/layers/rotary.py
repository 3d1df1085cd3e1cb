"""Rotary position embedding (neox / "rotate half" layout), with HF's static frequency scalings.

The cos/sin table is computed once in float32 for every position up to max_position_embeddings and
indexed by position inside the forward: no host work per step, so the forward can be graph-captured.
Frequencies are computed with the same float32 ops, in the same order, as transformers'
``modeling_rope_utils`` so positions rotate by bit-identical angles.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_parameters(hf_config: Any) -> dict[str, Any]:
    """The rope settings as one flat dict, whichever spelling the config uses.

    transformers >= 5 keeps everything in ``config.rope_parameters`` (rope_theta included);
    4.x used ``config.rope_theta`` plus an optional ``config.rope_scaling`` dict whose type key was
    ``rope_type`` or, earlier, ``type``.
    """
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    params = dict(params)
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", None) or 10000.0)
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    if params["rope_type"] in ("llama3", "yarn"):
        params.setdefault("original_max_position_embeddings", hf_config.max_position_embeddings)
    factor = params.get("partial_rotary_factor") or getattr(hf_config, "partial_rotary_factor", None) or 1.0
    if factor != 1.0:
        raise ValueError(f"partial_rotary_factor must be 1.0 for the supported families, got {factor}")
    return params


def _base_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))


def _default(p: dict[str, Any], dim: int, max_pos: int) -> tuple[torch.Tensor, float]:
    return _base_inv_freq(p["rope_theta"], dim), 1.0


def _linear(p: dict[str, Any], dim: int, max_pos: int) -> tuple[torch.Tensor, float]:
    inv_freq = _base_inv_freq(p["rope_theta"], dim)
    inv_freq /= p["factor"]
    return inv_freq, 1.0


def _llama3(p: dict[str, Any], dim: int, max_pos: int) -> tuple[torch.Tensor, float]:
    """Llama 3.1: long wavelengths slowed by ``factor``, short ones kept, a smooth ramp between."""
    inv_freq = _base_inv_freq(p["rope_theta"], dim)
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled), 1.0


def _yarn(p: dict[str, Any], dim: int, max_pos: int) -> tuple[torch.Tensor, float]:
    """YaRN (Qwen's long-context setting): per-dimension blend of interpolation and extrapolation."""
    base, old_len = p["rope_theta"], p["original_max_position_embeddings"]
    factor = p.get("factor") or max_pos / old_len

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        m, m_all = p.get("mscale"), p.get("mscale_all_dim")
        attention_factor = float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, attention_factor


_INIT: Mapping[str, Callable[[dict[str, Any], int, int], tuple[torch.Tensor, float]]] = MappingProxyType(
    {"default": _default, "linear": _linear, "llama3": _llama3, "yarn": _yarn}
)


def compute_inv_freq(hf_config: Any, head_dim: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim // 2] float32 on CPU, cos/sin scaling) for the config's rope type."""
    params = rope_parameters(hf_config)
    rope_type = params["rope_type"]
    if rope_type not in _INIT:
        raise ValueError(f"rope_type {rope_type!r} is not supported; supported: {list(SUPPORTED_ROPE_TYPES)}")
    with torch.device("cpu"):
        return _INIT[rope_type](params, head_dim, hf_config.max_position_embeddings)


class RotaryEmbedding(nn.Module):
    """Holds the float32 ``[max_positions, head_dim]`` table: cos in the first half, sin in the second."""

    def __init__(
        self, head_dim: int, max_positions: int, inv_freq: torch.Tensor, scaling: float = 1.0
    ) -> None:
        super().__init__()
        assert head_dim % 2 == 0 and inv_freq.shape == (head_dim // 2,), (head_dim, inv_freq.shape)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq.to(device=positions.device, dtype=torch.float32)[None, :]
        cache = torch.cat((freqs.cos() * scaling, freqs.sin() * scaling), dim=-1)
        self.head_dim = head_dim
        self.cos_sin_cache = nn.Buffer(cache, persistent=False)

    @classmethod
    def from_config(cls, hf_config: Any, head_dim: int) -> RotaryEmbedding:
        inv_freq, scaling = compute_inv_freq(hf_config, head_dim)
        return cls(head_dim, hf_config.max_position_embeddings, inv_freq, scaling)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int64 -> (cos, sin), each [T, head_dim // 2] float32."""
        cos_sin = self.cos_sin_cache.index_select(0, positions)
        return cos_sin.chunk(2, dim=-1)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> RotaryEmbedding:
        # ``model.to(torch.bfloat16)`` must move the table but not round it: angles stay float32.
        cache = self.cos_sin_cache
        super()._apply(fn, recurse)
        self.cos_sin_cache = cache.to(device=self.cos_sin_cache.device)
        return self


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated in float32 and cast back; equals HF's ``x*cos + rotate_half(x)*sin``."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


def rotate_qk(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k [T, Hk, D] rotated by the table rows at ``positions``.

    On CUDA one Triton kernel rotates both in place (they are slices of this layer's fresh qkv
    output, so nothing else sees them); elsewhere the torch ops above, unchanged.
    """
    if q.is_cuda:
        from rollout.kernels.fused_rotary import rotary_qk_  # lazy: see rollout.layers.norm

        rotary_qk_(q, k, positions, cos_sin_cache)
        return q, k
    cos, sin = cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
