"""RMSNorm, written op for op like Hugging Face's so bf16 results round the same way.

On CUDA the same math runs as one Triton kernel (``rollout.kernels.fused_norm``), optionally with the
residual add fused in; the kernel module is imported only there, because Triton decides
compile-vs-interpret when a kernel is defined and CPU tests set ``TRITON_INTERPRET=1`` before that.
"""

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
        if x.is_cuda:
            from rollout.kernels.fused_norm import rms_norm

            return rms_norm(x, self.weight, self.eps)[0]
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the decoder's residual add and the next norm together.

        The sum is taken in the model dtype, as HF's ``h = h + sublayer(h)``, so results are the same.
        """
        if x.is_cuda:
            from rollout.kernels.fused_norm import rms_norm

            y, summed = rms_norm(x, self.weight, self.eps, residual)
            assert summed is not None
            return y, summed
        summed = x + residual
        return self.forward(summed), summed

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"
