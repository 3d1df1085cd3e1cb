"""Fused ``silu(gate) * up`` over the merged gate/up GEMM output: one kernel instead of three.

Rounds like torch's two ops on the model dtype: silu in float32, cast to the dtype, then the product
in float32 and cast again. CUDA-graph capturable (no host syncs, output sized from shapes only).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rollout.kernels.pdl import pdl_enter, pdl_launch

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _silu_and_mul_kernel(gu_ptr, out_ptr, stride_gt, inter, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < inter
    g = tl.load(gu_ptr + t * stride_gt + offs, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + t * stride_gt + inter + offs, mask=ok, other=0.0)
    s = (g / (1.0 + tl.exp(-g))).to(gu_ptr.dtype.element_ty)
    out = s.to(tl.float32) * u.to(tl.float32)
    tl.store(out_ptr + t * inter + offs, out.to(out_ptr.dtype.element_ty), mask=ok)


def silu_and_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2 * I] (gate then up) -> new contiguous [T, I]."""
    if gate_up.dtype not in _DTYPES:
        raise TypeError(f"gate_up dtype {gate_up.dtype} is not supported; supported: {_DTYPES}")
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(1) != 1:
        raise ValueError(
            f"gate_up must be [T, 2 * I] with a contiguous last axis; got {tuple(gate_up.shape)}, "
            f"strides {gate_up.stride()}"
        )
    t, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((t, inter), dtype=gate_up.dtype, device=gate_up.device)
    if t == 0 or inter == 0:
        return out
    block = min(1024, triton.next_power_of_2(inter))
    _silu_and_mul_kernel[(t, triton.cdiv(inter, block))](
        gate_up, out, gate_up.stride(0), inter, BLOCK=block, num_warps=4, enable_fp_fusion=False,
        **pdl_launch(gate_up.device),
    )
    return out
