"""A decode-shaped GEMM in Triton: split K as well as N so a few rows cover the machine (issue 23.2).

A decode step's linears multiply a few rows (the batch, M <= 512) by a weight read once per step: out[M, N] =
x[M, K] @ W[N, K]^T (+ bias). Their floor is the weight bytes over the bandwidth. On the H200 (322d99f,
bench/step_profile.py, qwen2.5-1.5b at B=128) cuBLAS runs qkv (1536 -> 2048) and o_proj (1536 -> 1536) at about
a fifth of that floor: 6.4 and 5.5 us a call for 6.3 and 4.7 MB, because its tiles leave most SMs idle on so
few columns. This kernel covers the machine by splitting K as well as N:

- each program computes one [BLOCK_M, BLOCK_N] tile over one K slice (``split_k`` slices), reading its weight
  tile once; M fits one or two row tiles, so the weights are read once per step, as the floor assumes;
- with one slice the program adds the bias and stores the output; with more, it stores float32 partials, and
  the tile's last program to finish (an atomic counter per tile, left at zero again) sums them in slice order,
  adds the bias and casts: one launch, and the same inputs give the same bits whichever program came last (the
  engine's batch-invariance tests want that). ``fused=False`` sums them in a second kernel instead.

``bench/gemm_bench.py`` times it (and a sweep of tiles and splits) against ``torch.nn.functional.linear`` at the
model's shapes. At qwen2.5-1.5b's shapes it lost to cuBLAS (H200, bench/results/h200_2026-12-03e_gemm_304158d.jsonl);
at llama3-8b's qkv and o_proj, where cuBLAS reads at ~0.77 of the byte floor with 32 rows, it is untimed. The
engine's projections take it only where a layer's ``gemm_by_rows`` picks it: by the tuner (engine ``gemm_autotune``)
or by ``rollout.layers.gemm_tune.route_rows`` (the bench's A/B knob ``SKINNY_GEMM_ROWS``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 3
    fused: bool = True  # split K: the last program of a tile reduces (else a second kernel)

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {v}")
        if self.split_k < 1:
            raise ValueError(f"split_k must be >= 1, got {self.split_k}")


@triton.jit
def _split_kernel(x_ptr, w_ptr, b_ptr, out_ptr, part_ptr, counter_ptr, M, N, K, k_per_split, stride_xm, stride_wn,
                  stride_om, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, FUSED: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """One [BLOCK_M, BLOCK_N] tile of x @ W^T over K slice ``program_id(2)``. The row tile is the fastest grid
    axis: with M over one tile, the programs that read the same weight tile run together and share it in L2."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    k_lo = pid_s * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(k_lo, k_hi, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        k_ok = offs_k < k_hi
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :],
                    other=0.0)
        w = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :],
                    other=0.0)
        acc += tl.dot(x, tl.trans(w))
    ok = m_ok[:, None] & n_ok[None, :]
    if SPLIT == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=ok)
    else:
        tile = offs_m[:, None] * N + offs_n[None, :]
        tl.store(part_ptr + pid_s * M * N + tile, acc, mask=ok)
        if FUSED:
            tl.debug_barrier()  # every thread's partial stored before the release below
            count = counter_ptr + pid_m * tl.num_programs(1) + pid_n
            if tl.atomic_add(count, 1, sem="acq_rel", scope="gpu") == SPLIT - 1:
                tl.debug_barrier()
                tl.atomic_xchg(count, 0, sem="relaxed", scope="gpu")  # zero again for the next call
                total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                for s in range(SPLIT):  # slice order, whoever is last: the same bits every time
                    total += tl.load(part_ptr + s * M * N + tile, mask=ok, other=0.0, cache_modifier=".cg")
                if HAS_BIAS:
                    total += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
                tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], total.to(out_ptr.dtype.element_ty),
                         mask=ok)


@triton.jit
def _reduce_kernel(part_ptr, b_ptr, out_ptr, M, N, stride_om, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
                   BLOCK: tl.constexpr):  # fmt: skip
    """out[m, n] = sum over the K slices of the partials, in slice order, + bias[n], in out's dtype."""
    m = tl.program_id(1)
    offs_n = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs_n < N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(SPLIT):
        acc += tl.load(part_ptr + s * M * N + m * N + offs_n, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + offs_n, acc.to(out_ptr.dtype.element_ty), mask=ok)


@functools.lru_cache(maxsize=1024)  # one per (shape, batch): no Python search per call on an eager step
def choose_config(m: int, n: int, k: int, sms: int) -> GemmConfig:
    """A tile and split for a decode linear: rows in one or two tiles (16-128), 64 weight rows a tile, and as many
    K slices (each at least 256 deep) as it takes to give every SM about two programs."""
    block_m = min(128, max(16, triton.next_power_of_2(m)))
    block_n, block_k = 64, 64
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    split = 1
    while tiles * split < 2 * sms and k // (2 * split) >= 256:
        split *= 2
    return GemmConfig(block_m, block_n, block_k, split, num_warps=4 if block_m <= 64 else 8)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  config: GemmConfig | None = None, sms: int | None = None,
                  counters: torch.Tensor | None = None) -> torch.Tensor:
    """``torch.nn.functional.linear(x, weight, bias)`` for 2-D ``x`` [M, K] and ``weight`` [N, K], both with unit
    stride along K. ``counters``: int32 zeros, one per output tile at least, that the fused reduce leaves at zero;
    kept by the caller across calls (a CUDA graph replays them), else made per call."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x must be [M, K] and weight [N, K]; got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("x and weight need unit stride along K")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias must be [{weight.shape[0]}], got {tuple(bias.shape)}")
    m, k = x.shape
    n = weight.shape[0]
    if sms is None:
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 4
    cfg = config or choose_config(m, n, k, sms)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    split = triton.cdiv(k, k_per_split)  # slices that hold some of K
    part = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else out
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), split)
    b = bias if bias is not None else out
    fused = cfg.fused and split > 1
    if fused and counters is None:
        counters = torch.zeros(grid[0] * grid[1], dtype=torch.int32, device=x.device)
    elif fused and (counters.dtype != torch.int32 or counters.numel() < grid[0] * grid[1]):
        raise ValueError(f"counters must be int32 with at least {grid[0] * grid[1]} entries")
    _split_kernel[grid](
        x, weight, b, out, part, counters if fused else out, m, n, k, k_per_split, x.stride(0), weight.stride(0),
        out.stride(0), HAS_BIAS=bias is not None, SPLIT=split, FUSED=fused, BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if split > 1 and not fused:
        block = 256
        _reduce_kernel[(triton.cdiv(n, block), m)](part, b, out, m, n, out.stride(0), HAS_BIAS=bias is not None,
                                                   SPLIT=split, BLOCK=block, num_warps=4)  # fmt: skip
    return out
