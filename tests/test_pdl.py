"""Programmatic dependent launch (rollout/kernels/pdl.py): the PDL knob's kernels wait for the kernel before them
and trigger the next one, only where the hardware has it; off, the kernels compile exactly as before."""

import shutil
from pathlib import Path

import pytest
import torch

import rollout.kernels.pdl as pdl
from rollout.kernels.knobs import knob_module


def _ptx_tools() -> bool:
    triton = pytest.importorskip("triton")
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    return (tools / "ptxas").exists() or shutil.which("ptxas") is not None


def _ptx(fn, sig: dict, consts: dict) -> str:
    import triton

    if not _ptx_tools():
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
    assert pdl.pdl_launch(torch.device("cpu")) == {}
    monkeypatch.setattr(pdl, "PDL", True)
    assert pdl.pdl_launch(torch.device("cpu")) == {}  # the interpreter has no griddepcontrol


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


def _before_first_load(ptx: str) -> bool:
    return "griddepcontrol.launch_dependents" in ptx and ptx.index("griddepcontrol.wait") < ptx.index("ld.global")


@pytest.mark.parametrize("kv,stream", [("bf16", False), ("fp8", True)])
def test_decode_kernels_launch_with_pdl(kv: str, stream: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode split as ``paged_decode_attention`` launches it with the knob on (the chunked split for bf16,
    the stream split for fp8): launched with ``launch_pdl`` and its PDL constexpr on, and compiled for sm_90 it
    waits for the kernel before it ahead of any load. The reduce kernel the same."""
    import rollout.kernels.paged_decode as pd
    import rollout.kernels.paged_decode_stream as ps
    from tests.script_helpers import load_bench

    sass = load_bench("kernel_sass")
    for mod in (pd, ps):  # as on an sm_90 device with the knob on
        monkeypatch.setattr(mod, "pdl_launch", lambda device: {"PDL": True, "launch_pdl": True})
    launch = sass.capture_launch(kv, hq=12, hkv=2, d=128, page=16, batch=64, swap_ab=None, stream=stream)
    assert launch["kw"]["PDL"] is True and launch["kw"]["launch_pdl"] is True
    if not _ptx_tools():
        pytest.skip("this Triton wheel carries no ptxas")
    kernel = sass.compile_sm90(launch, ps._decode_stream_kernel if stream else pd._decode_split_kernel)
    assert kernel.metadata.launch_pdl is True
    assert _before_first_load(kernel.asm["ptx"])
    reduce = _ptx(pd._decode_reduce_kernel, {"part_o_ptr": "*fp32", "part_lse_ptr": "*fp32", "seq_info_ptr": "*i32",
                                             "out_ptr": "*bf16", "num_heads": "i32", "stride_ot": "i32",
                                             "stride_oh": "i32"},
                  {"HEAD_DIM": 128, "S_BLOCK_N": 16, "ZERO_EMPTY": stream, "PDL": True})  # fmt: skip
    assert _before_first_load(reduce)


def test_rope_kv_write_launches_with_pdl(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rotary + K/V store, the kernel between the qkv GEMM and the split: the same, captured as rope_write_kv
    launches it."""
    import rollout.kernels.rope_kv_write as rk
    from tests.script_helpers import load_bench

    sass = load_bench("kernel_sass")
    real, got = rk._rope_kv_write_kernel, {}

    class Grab:
        def __getitem__(self, grid):
            return lambda *args, **kw: got.update(args=args, kw=kw)

    monkeypatch.setattr(rk, "_rope_kv_write_kernel", Grab())
    monkeypatch.setattr(rk, "pdl_launch", lambda device: {"PDL": True, "launch_pdl": True})
    t, hq, hkv, d, page = 4, 8, 2, 128, 16
    q, k, v = (torch.zeros(t, h, d, dtype=torch.bfloat16) for h in (hq, hkv, hkv))
    cache = torch.zeros(2, 8, page, hkv, d, dtype=torch.bfloat16)
    rk.rope_write_kv(q, k, v, torch.arange(t), torch.zeros(64, d), cache, torch.arange(t))
    assert got["kw"]["PDL"] is True and got["kw"]["launch_pdl"] is True
    if not _ptx_tools():
        pytest.skip("this Triton wheel carries no ptxas")
    assert _before_first_load(sass.compile_sm90(got, real).asm["ptx"])
