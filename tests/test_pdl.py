"""Programmatic dependent launch (rollout/kernels/pdl.py): the PDL knob's kernels wait for the kernel before them
and trigger the next one, only where the hardware has it; off, the kernels compile exactly as before."""

import shutil
from pathlib import Path

import pytest
import torch

import rollout.kernels.pdl as pdl
from rollout.kernels.knobs import knob_module


def _ptx(fn, sig: dict, consts: dict) -> str:
    triton = pytest.importorskip("triton")
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    if not (tools / "ptxas").exists() and shutil.which("ptxas") is None:
        pytest.skip("this Triton wheel carries no ptxas")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {**sig, **{name: "constexpr" for name in consts}}
    return triton.compile(ASTSource(fn, sig, constexprs=consts), target=GPUTarget("cuda", 90, 32)).asm["ptx"]


@pytest.mark.parametrize("on", [False, True])
def test_pdl_kernels_wait_then_trigger(on: bool) -> None:
    from rollout.kernels.fused_act import _silu_and_mul_kernel
    from rollout.kernels.fused_norm import _rms_norm_kernel

    act = _ptx(_silu_and_mul_kernel, {"gu_ptr": "*bf16", "out_ptr": "*bf16", "stride_gt": "i32", "inter": "i32"},
               {"BLOCK": 1024, "PDL": on})  # fmt: skip
    norm = _ptx(_rms_norm_kernel, {**{p: "*bf16" for p in ("x_ptr", "res_ptr", "w_ptr", "y_ptr", "res_out_ptr")},
                                   **{s: "i32" for s in ("stride_xt", "stride_xh", "stride_rt", "stride_rh", "N")},
                                   "inv_n": "fp32", "eps": "fp32"},
                {"H": 1, "BLOCK": 4096, "HAS_RES": True, "PDL": on})  # fmt: skip
    for ptx in (act, norm):
        assert ("griddepcontrol.wait" in ptx) is on and ("griddepcontrol.launch_dependents" in ptx) is on
        if on:  # the wait comes before the first global load: nothing of the previous kernel is read early
            assert ptx.index("griddepcontrol.wait") < ptx.index("ld.global")


def test_pdl_launch_is_off_without_the_knob_and_off_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    assert pdl.PDL is False
    assert pdl.pdl_launch(torch.device("cpu")) == (False, {})
    monkeypatch.setattr(pdl, "PDL", True)
    assert pdl.pdl_launch(torch.device("cpu")) == (False, {})  # the interpreter has no griddepcontrol


def test_pdl_knob_is_found_and_set(monkeypatch: pytest.MonkeyPatch) -> None:
    import rollout.kernels.paged_decode as pd
    import rollout.kernels.paged_decode_stream as ps
    from tests.script_helpers import load_script

    assert knob_module("PDL") is pdl and knob_module("V_PAGES") is pd and knob_module("STREAM_SEGS") is ps
    with pytest.raises(ValueError, match="NOPE"):
        knob_module("NOPE")
    bench = load_script("bench")
    monkeypatch.setattr(pdl, "PDL", False)
    bench.apply_decode_knobs(bench.parse_decode_knobs("PDL=1"))
    assert pdl.PDL is True
