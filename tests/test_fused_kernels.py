"""Fused elementwise kernels (RMSNorm [+ residual], rotary, silu-and-mul) against the torch path.

Like tests/test_kernels.py, every kernel check runs in one child process started with
TRITON_INTERPRET=1 (this file run as a script), because Triton decides compile-vs-interpret when a
kernel is defined; the pytest process never imports the kernel modules. The torch references are the
CPU paths the model uses (``RMSNorm.forward``, ``apply_rotary``, ``silu_and_mul``), checked in fp32
(and fp16 loosely: the interpreter truncates fp32 -> bf16, so bf16 is for tests/gpu).
"""

from __future__ import annotations

import sys

import pytest
import torch

from rollout.layers.activation import silu_and_mul
from rollout.layers.norm import RMSNorm
from rollout.layers.rotary import RotaryEmbedding, _base_inv_freq, apply_rotary
from tests.interpreter import child_main, child_verdicts

TOKENS = (1, 5, 17)


def assert_close(out: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype, (out.shape, ref.shape, out.dtype, ref.dtype)
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= tol, f"max abs error {err:.3g} > {tol}"


def _norm(n: int, dtype: torch.dtype, gen: torch.Generator) -> RMSNorm:
    norm = RMSNorm(n, 1e-6)
    norm.weight.data = (1 + 0.5 * torch.randn(n, generator=gen)).to(dtype)
    return norm


def check_rms_norm(dtype: torch.dtype = torch.float32, tol: float = 1e-5) -> None:
    from rollout.kernels.fused_norm import rms_norm

    gen = torch.Generator().manual_seed(0)
    for n in (64, 96, 256):
        norm = _norm(n, dtype, gen)
        for t in TOKENS:
            x = (3 * torch.randn(t, n, generator=gen)).to(dtype)
            y, res = rms_norm(x, norm.weight, norm.eps)
            assert res is None
            assert_close(y, norm(x), tol)


def check_rms_norm_residual(dtype: torch.dtype = torch.float32, tol: float = 1e-5) -> None:
    """x + residual is returned (rounded to the dtype) and normalised; inputs are left untouched."""
    from rollout.kernels.fused_norm import rms_norm

    gen = torch.Generator().manual_seed(1)
    for n in (64, 128, 200):
        norm = _norm(n, dtype, gen)
        for t in TOKENS:
            x, r = torch.randn(t, n, generator=gen).to(dtype), torch.randn(t, n, generator=gen).to(dtype)
            x0, r0 = x.clone(), r.clone()
            y, res = rms_norm(x, norm.weight, norm.eps, r)
            ref_y, ref_res = norm.add_forward(x0, r0)  # the CPU torch path
            assert torch.equal(res, x0 + r0), "residual sum must round like the dtype's add"
            assert_close(y, ref_y, tol)
            assert_close(res, ref_res, 0.0)
            assert torch.equal(x, x0) and torch.equal(r, r0)


def check_rms_norm_heads() -> None:
    """Qwen3's per-head q/k norm: [T, H, D] views sliced out of a fused qkv buffer."""
    from rollout.kernels.fused_norm import rms_norm

    gen = torch.Generator().manual_seed(2)
    for d in (32, 64, 128):
        norm = _norm(d, torch.float32, gen)
        for t in (1, 17):
            qkv = torch.randn(t, 7 * d, generator=gen)
            q, k = qkv[:, : 4 * d].view(t, 4, d), qkv[:, 4 * d : 6 * d].view(t, 2, d)
            for x in (q, k):
                assert_close(rms_norm(x, norm.weight, norm.eps)[0], norm(x.contiguous()), 1e-5)


ROTARY_SHAPES = ((32, 4, 2), (64, 6, 1), (128, 3, 3), (96, 2, 2))  # (head_dim, q heads, k heads)


def check_rotary(dtype: torch.dtype = torch.float32, tol: float = 1e-5, shapes=ROTARY_SHAPES) -> None:
    """In-place rotation of strided q/k slices equals apply_rotary; v (same buffer) is untouched."""
    from rollout.kernels.fused_rotary import rotary_qk_

    gen = torch.Generator().manual_seed(3)
    for d, hq, hk in shapes:
        rope = RotaryEmbedding(d, 300, _base_inv_freq(10000.0, d))
        for t in TOKENS:
            qkv = (2 * torch.randn(t, (hq + 2 * hk) * d, generator=gen)).to(dtype)
            q = qkv[:, : hq * d].view(t, hq, d)
            k = qkv[:, hq * d : (hq + hk) * d].view(t, hk, d)
            v_before = qkv[:, (hq + hk) * d :].clone()
            positions = torch.randint(0, 300, (t,), generator=gen)
            cos, sin = rope(positions)
            ref_q, ref_k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            rotary_qk_(q, k, positions.to(torch.int32 if t == 5 else torch.int64), rope.cos_sin_cache)
            assert_close(q, ref_q, tol)
            assert_close(k, ref_k, tol)
            assert torch.equal(qkv[:, (hq + hk) * d :], v_before)


def check_silu_and_mul(dtype: torch.dtype = torch.float32, tol: float = 1e-5) -> None:
    from rollout.kernels.fused_act import silu_and_mul_triton

    gen = torch.Generator().manual_seed(4)
    for inter in (64, 100, 256, 1500):
        for t in TOKENS:
            gate_up = (3 * torch.randn(t, 2 * inter, generator=gen)).to(dtype)
            assert_close(silu_and_mul_triton(gate_up), silu_and_mul(gate_up), tol)


def check_errors() -> None:
    from rollout.kernels.fused_act import silu_and_mul_triton
    from rollout.kernels.fused_norm import rms_norm
    from rollout.kernels.fused_rotary import rotary_qk_

    x, w = torch.randn(3, 64), torch.ones(64)
    cache = torch.randn(10, 32)
    q, k, pos = torch.randn(3, 2, 32), torch.randn(3, 1, 32), torch.zeros(3, dtype=torch.int64)
    bad = [
        (ValueError, lambda: rms_norm(x, torch.ones(32), 1e-6)),
        (ValueError, lambda: rms_norm(x, w, 1e-6, torch.randn(3, 32))),
        (TypeError, lambda: rms_norm(x.double(), w, 1e-6)),
        (ValueError, lambda: silu_and_mul_triton(torch.randn(3, 63))),
        (TypeError, lambda: rotary_qk_(q, k.half(), pos, cache)),
        (TypeError, lambda: rotary_qk_(q, k, pos, cache.half())),
        (ValueError, lambda: rotary_qk_(q, k, pos[:2], cache)),
        (ValueError, lambda: rotary_qk_(q, k, pos, torch.randn(10, 16))),
    ]
    for exc, call in bad:
        with pytest.raises(exc):
            call()


CHECKS = {
    "rms_norm_fp32": check_rms_norm,
    "rms_norm_fp16": lambda: check_rms_norm(torch.float16, 2e-3),
    "rms_norm_residual_fp32": check_rms_norm_residual,
    "rms_norm_residual_fp16": lambda: check_rms_norm_residual(torch.float16, 2e-3),
    "rms_norm_strided_heads": check_rms_norm_heads,
    "rotary_fp32": check_rotary,
    "rotary_fp16": lambda: check_rotary(torch.float16, 2e-3, ROTARY_SHAPES[1:2]),
    "silu_and_mul_fp32": check_silu_and_mul,
    "silu_and_mul_fp16": lambda: check_silu_and_mul(torch.float16, 2e-2),
    "argument_errors": check_errors,
}


@pytest.fixture(scope="module")
def verdicts() -> dict[str, str]:
    return child_verdicts(__file__)


@pytest.mark.parametrize("name", list(CHECKS))
def test_fused_kernel(verdicts: dict[str, str], name: str) -> None:
    assert verdicts[name] == "ok", verdicts[name]


def test_cpu_paths_stay_torch() -> None:
    """On the CPU the layers must not touch Triton: the model's HF parity rests on the torch ops."""
    gen = torch.Generator().manual_seed(5)
    norm = _norm(64, torch.float32, gen)
    x, r = torch.randn(3, 64, generator=gen), torch.randn(3, 64, generator=gen)
    y, res = norm.add_forward(x, r)
    assert torch.equal(res, x + r) and torch.equal(y, norm(x + r))
    assert "rollout.kernels.fused_norm" not in sys.modules
    assert "rollout.kernels.fused_rotary" not in sys.modules
    assert "rollout.kernels.fused_act" not in sys.modules


if __name__ == "__main__":
    child_main(CHECKS)
