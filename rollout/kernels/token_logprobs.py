"""Teacher-forced token logprobs in one pass over the logits (prompt logprobs, ``Engine.score``).

Per row: the online max / sum-exp of s = x * inv (inv = 1 / T, or 1), then s[target] - logsumexp(s).
It reads the lm_head's output in its own dtype, so scoring a long prefill never writes [tokens, vocab]
float32 logits; ``rollout.engine.runners.prompt_logprobs.token_logprobs_torch`` is the specification
(and the CPU path).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _token_lp_kernel(logits_ptr, stride_row, V, inv_ptr, tgt_ptr, lp_ptr, lse_ptr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    inv = tl.load(inv_ptr + row)
    ar = tl.arange(0, BLOCK)
    m = -3.0e38
    z = 0.0
    for start in range(0, V, BLOCK):
        offs = start + ar
        s = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32) * inv
        m_new = tl.maximum(m, tl.max(s, 0))
        z = z * tl.exp(m - m_new) + tl.sum(tl.exp(s - m_new), 0)
        m = m_new
    lse = m + tl.log(z)
    s_t = tl.load(row_ptr + tl.load(tgt_ptr + row)).to(tl.float32) * inv
    tl.store(lp_ptr + row, s_t - lse)
    tl.store(lse_ptr + row, lse)


def token_logprobs(logits: torch.Tensor, inv: torch.Tensor, targets: torch.Tensor,
                   block: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, V] (any float dtype), inv [N] float32, targets [N] int64 -> (logprobs [N], logsumexp [N])."""
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    n, vocab = logits.shape
    lp = torch.empty(n, dtype=torch.float32, device=logits.device)
    lse = torch.empty(n, dtype=torch.float32, device=logits.device)
    if n:
        _token_lp_kernel[(n,)](logits, logits.stride(0), vocab, inv, targets, lp, lse, BLOCK=block, num_warps=8)
    return lp, lse
