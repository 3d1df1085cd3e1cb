"""Pick each projection's GEMM per decode batch size by timing it (issue 23.2: "pick GEMM shapes/algorithms per
graph batch size"). Opt-in: ``EngineConfig.gemm_autotune``.

A decode graph of ``rows`` sequences multiplies ``rows`` x K activations by each layer's weights. cuBLAS's
heuristic picks one kernel per shape; at decode's few rows it can leave SMs idle on narrow projections (qkv and
o_proj of W1 read their weights at ~0.77 of the byte floor with 32 rows on an H100, where the wide gate_up and
down read at 0.92-0.95). ``rollout.layers.linear.gemm`` offers two other ways to the same sums: cuBLAS's
transposed product (``swap``: W @ x^T, so the weight's rows are cuBLAS's M and other tiles are chosen) and the
split-K Triton GEMM (``skinny``).

Before the CUDA runner captures a batch size's first graph, ``tune_gemms`` times each method on every group of
projections with one weight shape (all of the group's layers in turn, so the weights stream from memory as in a
step rather than sitting in L2; replayed from a CUDA graph, as a decode step runs them) and writes the winner into
each layer's ``gemm_by_rows``. A method other than
cuBLAS wins only when it is faster by more than ``margin`` (3%): near a tie the choice would flip between runs
with the timing noise, and with it the GEMM's rounding. An alternative that fails to run (a Triton compile, a
capture) is logged and left out; the engine keeps serving on the others. The choices are recorded (``GemmPick``) for
the bench's records. On a CPU nothing is tuned.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from rollout.layers.linear import GEMM_METHODS, MergedLinear, gemm
from rollout.layers.parallel import RowParallelLinear

log = logging.getLogger(__name__)

Timer = Callable[[Callable[[], object]], float]  # the mean microseconds of one call of fn


@dataclass(frozen=True, slots=True)
class GemmPick:
    """One group's choice at one row count: the weight shape [N, K], how many layers share it, and the
    microseconds per call of the whole group under each method timed."""

    rows: int
    shape: tuple[int, int]
    layers: int
    method: str
    us: tuple[tuple[str, float], ...]

    def as_record(self) -> dict:
        return {"rows": self.rows, "shape": list(self.shape), "layers": self.layers, "method": self.method,
                "us": {m: round(t, 2) for m, t in self.us}}


def tunable_linears(model: nn.Module) -> dict[tuple, list[nn.Module]]:
    """The model's projections that take a tuned GEMM (the fused and row-parallel ones, which keep
    ``gemm_by_rows``), grouped by weight shape, dtype and whether they add a bias."""
    groups: dict[tuple, list[nn.Module]] = {}
    for mod in model.modules():
        if isinstance(mod, (MergedLinear, RowParallelLinear)):
            w = mod.weight
            groups.setdefault((tuple(w.shape), w.dtype, mod.bias is not None), []).append(mod)
    return groups


def route_rows(model: nn.Module, method: str, max_rows: int) -> int:
    """Every tuned-kind projection (``tunable_linears``) runs ``method`` for batches of 1..``max_rows`` rows,
    decode and prefill alike: the bench's A/B of one method against cuBLAS without timing anything
    (``--decode-knobs GEMM_SWAP_ROWS=N`` / ``SKINNY_GEMM_ROWS=N``). Returns how many layers it set."""
    if method not in GEMM_METHODS:
        raise ValueError(f"GEMM method must be one of {GEMM_METHODS}, got {method!r}")
    if isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 0:
        raise ValueError(f"max_rows must be an int >= 0, got {max_rows!r}")
    layers = [mod for group in tunable_linears(model).values() for mod in group]
    for mod in layers:
        mod.gemm_by_rows.update(dict.fromkeys(range(1, max_rows + 1), method))
    return len(layers)


ROUTE_KNOBS = {"GEMM_SWAP_ROWS": "swap", "SKINNY_GEMM_ROWS": "skinny"}  # bench knob -> method, in the order applied


def route_knobs(model: nn.Module, knobs: Mapping[str, int]) -> None:
    """The bench's GEMM knobs (``--decode-knobs GEMM_SWAP_ROWS=N,SKINNY_GEMM_ROWS=M``, any other names ignored):
    ``route_rows`` for each one set; both set, the Triton GEMM takes the rows they share."""
    for name, method in ROUTE_KNOBS.items():
        if knobs.get(name):
            route_rows(model, method, knobs[name])


def cuda_timer(reps: int = 10) -> Timer:
    """Times ``fn`` as a step runs it, from a CUDA graph: one eager call (compiles, cuBLAS's set-up), one capture,
    then the mean of ``reps`` replays between two events. Timed eagerly instead, the launches of a group's small
    GEMMs would outpace nothing: the host's launch rate, not the kernels, would set the time (and the transposed
    product's extra copy would count as a launch more)."""

    def time_us(fn: Callable[[], object]) -> float:
        fn()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        graph.replay()  # the first replay uploads the graph
        stream = torch.cuda.current_stream()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        for _ in range(reps):
            graph.replay()
        end.record(stream)
        end.synchronize()
        return start.elapsed_time(end) * 1e3 / reps

    return time_us


def _run_group(x: torch.Tensor, mods: list[nn.Module], method: str) -> None:
    """Each layer's GEMM in turn, each output dropped at once: in a capture the next one reuses its memory, so
    timing a group of 32 layers at 512 rows holds one [512, N] output, not 32 (~1 GB for llama3-8b's gate_up)."""
    for mod in mods:
        gemm(x, mod.weight, mod.bias, method)


def _methods(x: torch.Tensor, weight: torch.Tensor, allowed: Iterable[str]) -> list[str]:
    out = ["cublas"]
    for m in allowed:
        if m == "skinny" and not (x.is_cuda and weight.stride(1) == 1):
            continue  # the Triton kernel: CUDA tensors, unit stride along K
        if m != "cublas" and m in GEMM_METHODS:
            out.append(m)
    return out


def tune_gemms(model: nn.Module, rows: int, *, timer: Timer | None = None, margin: float = 0.03,
               methods: Iterable[str] = ("swap", "skinny")) -> list[GemmPick]:
    """Time ``methods`` against cuBLAS for every projection group at ``rows`` rows; write each group's winner into
    its layers' ``gemm_by_rows[rows]`` (cuBLAS unless another is more than ``margin`` faster)."""
    if rows < 1:
        raise ValueError(f"rows must be >= 1, got {rows}")
    if not 0.0 <= margin < 1.0:
        raise ValueError(f"margin must be in [0, 1), got {margin}")
    methods = tuple(methods)
    picks = []
    for (shape, dtype, _), mods in tunable_linears(model).items():
        w0 = mods[0].weight
        x = torch.randn(rows, shape[1], dtype=dtype, device=w0.device)
        timer_ = timer if timer is not None else cuda_timer()
        us = {}
        with torch.inference_mode():
            for m in _methods(x, w0, methods):
                try:
                    us[m] = timer_(functools.partial(_run_group, x, mods, m))
                except Exception:  # noqa: BLE001 - an alternative that fails here (a compile, a capture) is skipped
                    if m == "cublas":
                        raise
                    log.warning("gemm_autotune: %s failed at %d rows on weights %s; skipped", m, rows, list(shape),
                                exc_info=True)
        best = min(us, key=us.__getitem__)
        if best != "cublas" and us[best] > us["cublas"] * (1.0 - margin):
            best = "cublas"
        for mod in mods:
            mod.gemm_by_rows[rows] = best
        picks.append(GemmPick(rows, shape, len(mods), best, tuple(us.items())))
    return picks
