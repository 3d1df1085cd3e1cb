"""bench/kernel_sass.py: the decode kernel compiled for sm_90 on the CPU, as paged_decode_attention launches it."""

import shutil
from pathlib import Path

import pytest

from tests.script_helpers import load_bench


def _load():
    return load_bench("kernel_sass")


def _tools() -> bool:
    triton = pytest.importorskip("triton")
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    return (tools / "cuobjdump").exists() and (tools / "ptxas").exists() or shutil.which("cuobjdump") is not None


@pytest.mark.parametrize("kv,swap", [("bf16", False), ("fp8", True)])
def test_decode_kernel_sass_has_its_key_tile_loop(kv: str, swap: bool) -> None:
    if not _tools():
        pytest.skip("this Triton wheel carries no ptxas / cuobjdump")
    rec = _load().report(kv, swap, hq=12, hkv=2, d=128, page=16, batch=256)
    assert rec["target"] == "sm_90" and rec["swap_ab"] is swap and rec["G_PAD"] == (8 if swap else 16)
    assert rec["loops"], "no loop with tensor-core instructions found"
    mix = rec["loops"][0]["mix"]
    assert any("MMA" in op for op in mix)
    assert rec["main_loop_instructions"] > 100 and rec["bytes_per_warp_instruction"] > 1
    # K/V tiles come in by asynchronous copies (16-byte aligned pointers and strides specialised as at launch)
    assert any(op.startswith("LDGSTS") for op in mix)
    if kv == "fp8":  # e4m3 widened to fp16 in registers
        assert any(op.startswith("F2FP.F16.E4M3") for op in mix)


def test_unrolled_stream_kernel_holds_more_programs_and_spills_less() -> None:
    """STREAM_SEGS: the stream kernel with a run's sequences unrolled keeps less state than the loop over them:
    bf16 fits more programs an SM (the loop form: 150-153 registers, 3 an SM), fp8 reloads fewer spilled values in
    its key-tile loops (the loop form: 12-13), compiled for sm_90 as paged_decode_attention launches it."""
    if not _tools():
        pytest.skip("this Triton wheel carries no ptxas / cuobjdump")
    import rollout.kernels.paged_decode_stream as ps

    sass = _load()
    old = ps.STREAM_SEGS
    got = {}
    try:
        for segs in (0, 4):
            ps.STREAM_SEGS = segs
            for kv in ("bf16", "fp8"):
                rec = sass.report(kv, None, hq=12, hkv=2, d=128, page=16, batch=256, stream=True)
                assert rec["kernel"] == "stream" and rec["segs"] == segs
                spills = sum(n for loop in rec["loops"] for op, n in loop["mix"].items() if op.startswith("LDL"))
                got[kv, segs] = rec["programs_per_sm"], spills
    finally:
        ps.STREAM_SEGS = old
    assert got["bf16", 4][0] > got["bf16", 0][0], got
    assert got["fp8", 4][0] == got["fp8", 0][0] and got["fp8", 4][1] < got["fp8", 0][1], got
