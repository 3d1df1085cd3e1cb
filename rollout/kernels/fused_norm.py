"""Fused RMSNorm (optionally with the residual add before it): one kernel instead of about six.

In a decode step each torch elementwise op is its own launch, and the decoder's norms alone were
hundreds of them. One program normalises one row. The numerics follow ``rollout.layers.norm.RMSNorm``
(HF's order): the residual sum is rounded to the model dtype first (HF adds in the model dtype),
then normalised in float32, cast to the input dtype, and only then scaled by the weight in float32
and cast again. Floating-point contraction is turned off so products round as torch's separate ops do.

Rows may be strided in two levels ([T, H, N] views, e.g. Qwen3's per-head q/k norm on slices of the
fused qkv output); outputs are new contiguous tensors. No host syncs: CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rollout.kernels.pdl import pdl_enter, pdl_launch

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, y_ptr, res_out_ptr,
    stride_xt, stride_xh, stride_rt, stride_rh,
    N, inv_n, eps,
    H: tl.constexpr, BLOCK: tl.constexpr, HAS_RES: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    pdl_enter(PDL)
    t = tl.program_id(0)
    h = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    ok = offs < N
    x = tl.load(x_ptr + t * stride_xt + h * stride_xh + offs, mask=ok, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + t * stride_rt + h * stride_rh + offs, mask=ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(res_out_ptr + (t * H + h) * N + offs, x, mask=ok)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, 0) * inv_n
    normed = (xf * tl.math.rsqrt(var + eps)).to(x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + offs, mask=ok, other=0.0)
    y = w.to(tl.float32) * normed.to(tl.float32)
    tl.store(y_ptr + (t * H + h) * N + offs, y.to(y_ptr.dtype.element_ty), mask=ok)


def _rows(x: torch.Tensor) -> tuple[int, int, int, int]:
    """(T, H, stride_t, stride_h) of a [T, N] or [T, H, N] tensor with a contiguous last axis."""
    if x.dim() == 2:
        return x.shape[0], 1, x.stride(0), 0
    if x.dim() == 3:
        return x.shape[0], x.shape[1], x.stride(0), x.stride(1)
    raise ValueError(f"rms_norm takes [T, N] or [T, H, N] tensors; got shape {tuple(x.shape)}")


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(rmsnorm(x [+ residual]) * weight, x [+ residual]) over the last axis; the second is None
    without ``residual``. Both outputs are new contiguous tensors of x's shape."""
    if x.dtype not in _DTYPES:
        raise TypeError(f"x dtype {x.dtype} is not supported; supported: {_DTYPES}")
    n = x.shape[-1]
    if weight.shape != (n,) or x.stride(-1) != 1 or weight.stride(0) != 1:
        raise ValueError(
            f"weight must be [{n}] and x's last axis contiguous; got weight {tuple(weight.shape)}, "
            f"x strides {x.stride()}"
        )
    t, h, sxt, sxh = _rows(x)
    y = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    res_out, srt, srh = None, 0, 0
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(-1) != 1:
            raise ValueError(
                f"residual must match x ({tuple(x.shape)}, {x.dtype}, contiguous last axis); got "
                f"{tuple(residual.shape)}, {residual.dtype}, strides {residual.stride()}"
            )
        _, _, srt, srh = _rows(residual)
        res_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if t == 0:
        return y, res_out
    block = triton.next_power_of_2(n)
    _rms_norm_kernel[(t, h)](
        x, residual if residual is not None else x, weight, y, res_out if res_out is not None else y,
        sxt, sxh, srt, srh, n, 1.0 / n, eps,
        H=h, BLOCK=block, HAS_RES=residual is not None,
        num_warps=min(16, max(1, block // 512)), enable_fp_fusion=False, **pdl_launch(x.device),
    )  # fmt: skip
    return y, res_out
