"""RMSNorm, written op for op like Hugging Face's so bf16 results round the same way."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """Normalise in float32, cast back, then scale: the order HF's LlamaRMSNorm uses.

    Scaling after the cast (not before) matters in bf16: it is what the trainer's HF model does, and
    the logprobs we return must be the ones it recomputes.
    """

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"
