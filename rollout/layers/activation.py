"""Gated MLP activation over the fused gate/up output (one Triton kernel on CUDA, torch elsewhere)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

SUPPORTED_ACTIVATIONS = ("silu",)


def check_activation(name: str) -> None:
    """Refuse activations we do not implement rather than silently computing a different model."""
    if name not in SUPPORTED_ACTIVATIONS:
        raise ValueError(f"hidden_act {name!r} is not supported; supported: {list(SUPPORTED_ACTIVATIONS)}")


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2 * I] (gate then up) -> silu(gate) * up, [..., I]: HF's ``act(gate_proj(x)) * up_proj(x)``."""
    if gate_up.is_cuda and gate_up.dim() == 2:
        from rollout.kernels.fused_act import silu_and_mul_triton  # lazy: see rollout.layers.norm

        return silu_and_mul_triton(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
