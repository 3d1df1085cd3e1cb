"""Programmatic dependent launch (PDL, Hopper and later): a kernel starts while the one before it drains.

A decode step is ~330 kernels (llama3-8b: ten a layer), and at a small batch each boundary costs the GPU
a launch and a ramp: the next grid waits for the last block of the previous one to exit and its writes to
flush. Launched with PDL (``launch_pdl=True``), a kernel's blocks may be scheduled as soon as every block
of the kernel before it has called ``gdc_launch_dependents`` (or exited); each then waits in
``gdc_wait`` until that kernel has finished and its memory is visible, so the overlap never reads a
stale value. Our kernels call both at their very top: nothing is read before the wait, and the trigger
comes once every block of the grid is resident, so a dependent only fills slots the grid has left.

cuBLAS's GEMMs between our kernels launch normally and wait as before; a kernel of ours after one of
them still gets its launch earlier (the GEMM's exit is its trigger). In a CUDA graph the dependency is
captured as a programmatic edge. Off by default (``PDL``): W1 on an H100 at 8858c88 ran 0.8977 of its
floor with it against 0.8982 without, in one call, and its 4K step's wall was 12.02 ms against 11.91
(bench/results/h100_2026-12-07f_w1pdl_8858c88.jsonl, ..._step_profile_w1_8858c88.jsonl). Under CUDA graphs the
boundaries cost only 0.19 ms of that step. ``scripts/bench.py --decode-knobs PDL=1`` A/Bs it; it is always off on
the CPU, where the interpreter has no such thing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

PDL = False  # launch the decode step's Triton kernels with programmatic dependent launch (sm_90+)


def pdl_launch(device: torch.device) -> dict:
    """Keywords for a PDL-aware kernel's launch on ``device``: its ``PDL`` constexpr and Triton's ``launch_pdl``
    option where the knob is on and the device has it, else none (the kernel's ``PDL`` defaults to off)."""
    if not PDL or device.type != "cuda" or torch.cuda.get_device_capability(device)[0] < 9:
        return {}
    return {"PDL": True, "launch_pdl": True}


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """First statement of a PDL-aware kernel: wait for the kernel before (its writes visible), then let the
    next one start scheduling its blocks."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
