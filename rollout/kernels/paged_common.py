"""What the paged kernels share: argument checks (errors name the bad value and what is allowed) and
the FP8 KV format's device-side rounding.

FP8 KV cache (``kv_cache_dtype="fp8"``): K and V are stored as float8_e4m3fn with one float16 scale
per (token, kv head), i.e. per row of ``head_dim`` values; see ``rollout.layers.kv_quant`` for why
that granularity and the layout. Kernels take the values as a ``KVPair`` of logical
``[num_blocks, block_size, Hkv, D]`` views (V token-contiguous) and the scale view
``[2, num_blocks, block_size, Hkv]`` (fp16) of the same per-layer storage; any cache may also come as
one ``[2, num_blocks, block_size, Hkv, D]`` tensor. K must be contiguous over D; V over D or over
tokens (``V_TRANS``): the kernels read whichever with full-width vector loads.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rollout.layers.kv_quant import (  # noqa: F401 - re-exported
    FP8_DTYPE,
    FP8_MAX,
    SCALE_DTYPE,
    SCALE_MIN,
    KVPair,
    kv_halves,
)

LOG2E = 1.4426950408889634
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def round_to_e4m3(x):
    """fp32 already clamped to [-448, 448] -> the nearest e4m3 value (ties to even), still in fp32.

    Converting an exactly representable value to fp8 is then exact on every backend; Triton 3.9's
    interpreter truncates fp32 -> fp8 conversions that cross a power of two, so the rounding is ours.
    """
    a = tl.abs(x)
    bits = a.to(tl.uint32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
    y = a * 512.0  # subnormals (|x| < 2^-6) are multiples of 2^-9
    fl = tl.floor(y)
    frac = y - fl
    up = (frac > 0.5) | ((frac == 0.5) & ((fl.to(tl.int32) & 1) == 1))
    sub = (fl + up.to(tl.float32)) * (1.0 / 512.0)
    r = tl.where(a < 0.015625, sub, normal)
    return tl.where(x < 0, -r, r)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8_DTYPE


def check_kv_scales(kv_cache: torch.Tensor | KVPair, kv_scales: torch.Tensor | None) -> None:
    """An fp8 cache needs its scales ([2, num_blocks, block_size, Hkv] fp16); other caches take none."""
    k = kv_halves(kv_cache)[0]
    if is_fp8(k.dtype):
        if kv_scales is None or kv_scales.dtype != SCALE_DTYPE or kv_scales.shape != (2, *k.shape[:3]):
            got = None if kv_scales is None else (kv_scales.dtype, tuple(kv_scales.shape))
            raise ValueError(
                f"an fp8 kv_cache {tuple(k.shape)} per half needs kv_scales of shape {(2, *k.shape[:3])} "
                f"and dtype {SCALE_DTYPE}; got {got}"
            )
    elif kv_scales is not None:
        raise ValueError(f"kv_scales are only for an fp8 kv_cache, not {k.dtype}")


def check_kv_layout(kv_cache: torch.Tensor | KVPair) -> tuple[torch.Tensor, torch.Tensor]:
    """(K, V) ``[num_blocks, block_size, Hkv, D]`` after the layout checks every kernel shares."""
    if isinstance(kv_cache, torch.Tensor) and (kv_cache.dim() != 5 or kv_cache.shape[0] != 2):
        raise ValueError(f"kv_cache must be [2, num_blocks, block_size, Hkv, D]; got {tuple(kv_cache.shape)}")
    k, v = kv_halves(kv_cache)
    if k.dim() != 4 or k.shape != v.shape or k.dtype != v.dtype:
        raise ValueError(f"K and V caches must be equal [num_blocks, block_size, Hkv, D]; got {k.shape}, {v.shape}")
    if k.stride(3) != 1 or (v.stride(3) != 1 and v.stride(1) != 1):
        raise ValueError("the K cache must be contiguous over head_dim, the V cache over head_dim or tokens")
    return k, v


def check_paged_inputs(
    q: torch.Tensor, kv_cache: torch.Tensor | KVPair, block_tables: torch.Tensor, kv_scales: torch.Tensor | None = None
) -> None:
    """Shape/dtype checks shared by the paged kernels; errors name the bad value and what is allowed."""
    if q.dim() != 3:
        raise ValueError(f"q must be [T, Hq, D]; got {tuple(q.shape)}")
    k, _ = check_kv_layout(kv_cache)
    if q.dtype not in _DTYPES or (k.dtype not in _DTYPES and not is_fp8(k.dtype)):
        raise TypeError(
            f"q dtype {q.dtype} must be one of {_DTYPES}; kv_cache dtype {k.dtype} one of them or {FP8_DTYPE}"
        )
    _, page, hkv, d = k.shape
    if q.shape[2] != d or d < 16 or d & (d - 1):
        raise ValueError(
            f"head_dim must be a power of two >= 16 and equal in q and kv_cache; got {q.shape[2]}, {d}"
        )
    if page < 8 or page & (page - 1):
        raise ValueError(f"block_size must be a power of two >= 8; got {page}")
    if q.shape[1] % hkv:
        raise ValueError(f"num q heads {q.shape[1]} must be a multiple of num kv heads {hkv}")
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2:
        raise TypeError(
            f"block_tables must be a 2-D int32 tensor; got {block_tables.dtype} {tuple(block_tables.shape)}"
        )
    if q.stride(2) != 1:
        raise ValueError("q must have a contiguous last (head_dim) axis")
    check_kv_scales(kv_cache, kv_scales)


def kv_args(
    kv_cache: torch.Tensor | KVPair, kv_scales: torch.Tensor | None, q: torch.Tensor | None = None
) -> tuple[tuple, tuple, dict]:
    """The kernels' cache arguments: (pointers (k, v, k scales, v scales), strides (K block, token,
    head; V block, token, head, dim; scale block, token, head), constexprs; ``DOT16`` with ``q``: see
    ``to_dot16``). Scale pointers are dummies and their strides 0 when the cache is not fp8 (the
    kernels then never touch them)."""
    k, v = kv_halves(kv_cache)
    strides = (*k.stride()[:3], *v.stride())
    if kv_scales is None:
        ptrs, s_strides = (k, v, k, v), (0, 0, 0)
    else:
        ptrs, s_strides = (k, v, kv_scales[0], kv_scales[1]), tuple(kv_scales.stride()[1:])
    v_trans = v.stride(3) != 1
    page = k.shape[1]
    if v_trans and (v.stride(0) % page or v.stride(2) % page):
        raise ValueError(f"token-contiguous V needs block and head strides that are multiples of block_size {page}; "
                         f"got {v.stride()}")  # fmt: skip
    consts = dict(
        KV_FP8=is_fp8(k.dtype), V_TRANS=v_trans,
        SCALE_CONTIG=kv_scales is not None and kv_scales.stride(2) == 1 and not kv_scales.stride(1) % page
        and not kv_scales.stride(3) % page,
    )
    if q is not None:
        consts["DOT16"] = is_fp8(k.dtype) and q.dtype != torch.float32
    return ptrs, strides + s_strides, consts


def kv_shape(kv_cache: torch.Tensor | KVPair) -> tuple[int, int, int]:
    """(block_size, Hkv, D)."""
    _, page, hkv, d = kv_halves(kv_cache)[0].shape
    return page, hkv, d


def check_window(sliding_window: int | None) -> int:
    """Kernel form of the window: 0 = none."""
    if sliding_window is None:
        return 0
    if sliding_window < 1:
        raise ValueError(f"sliding_window must be None or >= 1; got {sliding_window}")
    return int(sliding_window)


def dot_precision(q: torch.Tensor) -> str:
    return "ieee" if q.dtype == torch.float32 else "tf32"


@triton.jit
def to_dot16(x, DOT16: tl.constexpr):
    """Queries in the type the fp8 path multiplies in (``DOT16``: fp8 K/V and 16-bit q): fp8 widens to
    fp16 in one instruction per two values (to bf16 it takes three: e4m3 -> f16 -> bf16 per value), so
    q goes to fp16, clamped to its range; otherwise (fp32 q in the interpreter tests) q is kept."""
    if DOT16:
        x = tl.minimum(tl.maximum(x.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
    return x


@triton.jit
def load_v_tile(v_ptr, blk, slot, pos, seq_len, kvh, ok, offs_d, stride_vb, stride_vs, stride_vh, stride_vd,
                PAGE: tl.constexpr, V_TRANS: tl.constexpr, TAIL: tl.constexpr):  # fmt: skip
    """A key tile's V as [BLOCK_N, D], or as [D, BLOCK_N] for token-contiguous V (fp8); the caller
    converts it, then transposes it into the dot's operand (in that order, so that Triton pipelines
    the load into shared memory as it does K's): the tensor core then reads V contiguous along its
    contraction axis (tokens), like K along D.

    Token-contiguous V is masked per page, never per token: one mask bit per 16-byte vector (one
    dim of a page) keeps it one asynchronous copy (a per-token mask made it 16 byte loads). Tiles
    that end at or before ``seq_len`` load unmasked (every byte there was written, finite; P is 0
    wherever ``ok`` is not); the ``TAIL`` tile, which holds the sequence's end, skips the pages past
    it, and the caller zeroes its stale slots past ``seq_len`` (maybe NaN bytes: 0 * NaN is not 0)."""
    off = blk * stride_vb + slot * stride_vs + kvh * stride_vh
    if V_TRANS:
        off = tl.max_contiguous(tl.multiple_of(off, PAGE), PAGE)  # a page's tokens are consecutive bytes
        ptrs = v_ptr + off[None, :] + offs_d[:, None] * stride_vd
        if TAIL:
            page_ok = (pos // PAGE) * PAGE < seq_len
            v = tl.load(ptrs, mask=page_ok[None, :], other=0.0)
        else:
            v = tl.load(ptrs)
    else:
        v = tl.load(v_ptr + off[:, None] + offs_d[None, :], mask=ok[:, None], other=0.0)
    return v


@triton.jit
def load_v_pages(v_ptr, bt_row, t, kvh, offs_d, stride_vb, stride_vs, stride_vh, stride_vd, PAGE: tl.constexpr,
                 BLOCK_N: tl.constexpr):  # fmt: skip
    """Token-contiguous V of key tile ``t`` (every page written: not the tail tile) as [D, BLOCK_N], copied page
    by page: a [D, pages, PAGE] load puts the copy's lanes along D, so one instruction reads 32 dims of one page
    (512 contiguous bytes), where ``load_v_tile``'s [D, BLOCK_N] spreads them over pages."""
    NP: tl.constexpr = BLOCK_N // PAGE
    offs_p = tl.arange(0, NP)
    offs_t = tl.arange(0, PAGE)
    pblk = tl.load(bt_row + t * NP + offs_p).to(tl.int64)
    base = tl.multiple_of(pblk * stride_vb + kvh * stride_vh, PAGE)
    v3 = tl.load(v_ptr + offs_d[:, None, None] * stride_vd + base[None, :, None] + offs_t[None, None, :] * stride_vs)
    return tl.reshape(v3, (offs_d.shape[0], BLOCK_N))


@triton.jit
def v_operand(v, ok, V_TRANS: tl.constexpr, TAIL: tl.constexpr):
    """A converted ``load_v_tile`` as the PV dot's [BLOCK_N, D] operand: the tail tile's stale slots
    zeroed, token-contiguous V transposed."""
    if V_TRANS:
        if TAIL:
            v = tl.where(ok[None, :], v, 0.0)
        v = tl.trans(v)
    return v


@triton.jit
def scale_offsets(blk, slot, kvh, stride_sb, stride_ss, stride_sh, PAGE: tl.constexpr, SCALE_CONTIG: tl.constexpr):
    """Offsets of a key tile's per-token scales; one kv head's scales of a block are contiguous."""
    off = blk * stride_sb + slot * stride_ss + kvh * stride_sh
    if SCALE_CONTIG:
        off = tl.max_contiguous(tl.multiple_of(off, PAGE), PAGE)
    return off
