"""Triton device functions the fused sampler shares: the counter hash, ``log32`` and an ordered float key.

Each mirrors ``rollout.layers.sampler`` op for op (same association, same float32 constants, launched
with contraction off), so the noise, and with it every seeded token, is bit-identical to the torch
reference. The hash runs in uint32, whose products wrap exactly as the reference's ``& 0xFFFFFFFF``.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Upper bound of -log(E) over every noise value: E >= -log(1 - 2^-24) ~ 5.96e-8, -log of that ~ 16.64.
NOISE_MAX = 17.0


@triton.jit
def mix32(x):
    x = x ^ (x >> 16)
    x = x * 0x21F0AAAD
    x = x ^ (x >> 15)
    x = x * 0x735A2D97
    return x ^ (x >> 15)


@triton.jit
def row_hash(seed, position):
    """Per-row 32-bit state from the int64 seed and output position (``uniform_noise``'s ``h``)."""
    s = (seed ^ (seed >> 32)).to(tl.uint32)
    p = position.to(tl.uint32) + 0x3C6EF372
    return mix32(s ^ mix32(p))


@triton.jit
def log32(x):
    """Cephes logf of positive normal float32, op for op as ``sampler.log32``."""
    bits = x.to(tl.int32, bitcast=True)
    e = (bits >> 23) - 126
    m = ((bits & 0x007FFFFF) | 0x3F000000).to(tl.float32, bitcast=True)
    small = m < 0.7071067690849304
    ef = tl.where(small, e - 1, e).to(tl.float32)
    f = tl.where(small, (m + m) - 1.0, m - 1.0)
    z = f * f
    y = f * 0.07037683576345444 + -0.11514610052108765
    y = y * f + 0.11676998436450958
    y = y * f + -0.12420140951871872
    y = y * f + 0.14249323308467865
    y = y * f + -0.16668057441711426
    y = y * f + 0.2000071406364441
    y = y * f + -0.24999994039535522
    y = y * f + 0.3333333134651184
    y = (y * f) * z
    y = y + ef * -0.00021219444170128554
    y = y + z * -0.5
    return (f + y) + ef * 0.693359375


@triton.jit
def log_exp_noise(h, offs):
    """log E, E = -log U, U in (0, 1) hashed from the row state and token ids (the race adds -log E)."""
    x = mix32(h + offs.to(tl.uint32) * 0x1B873593)
    u = ((x >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07
    return log32(-log32(u))


@triton.jit
def okey(f):
    """float32 -> int32 with the same order (bisection over floats runs on these)."""
    b = f.to(tl.int32, bitcast=True)
    return tl.where(b >= 0, b, b ^ 0x7FFFFFFF)


@triton.jit
def ofloat(k):
    """Inverse of ``okey`` (an int32 key back to its float32)."""
    b = tl.where(k >= 0, k, k ^ 0x7FFFFFFF)
    return b.to(tl.float32, bitcast=True)
