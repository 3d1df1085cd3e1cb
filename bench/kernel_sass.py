"""The paged decode kernel's machine code for the H200 (sm_90), compiled here without a GPU.

Triton compiles for any target on the CPU (its wheel carries ptxas and cuobjdump), so a kernel change can be
read as SASS before it costs device time: this script builds ``_decode_split_kernel`` exactly as
``paged_decode_attention`` would launch it for a given shape and cache (the launch's arguments are captured,
and the JIT's specialisation is reproduced: ints equal to 1 become constants, multiples of 16 and 16-byte
aligned pointers are marked divisible), disassembles it and reports, per loop that issues tensor-core
instructions (the key-tile loops), its instruction count and mix, and the bytes of K/V one instruction
of one warp moves. Device time is what decides; this says why.

    python bench/kernel_sass.py --kv bf16,fp8 --swap-ab 0,1                      # W2's qwen2.5-1.5b shapes
    PYTHONPATH=/tmp/t36 python bench/kernel_sass.py --kv fp8                     # another Triton (the H200's 3.6)

Compile with the Triton the GPU runs (the device has 3.6; ``pip install --target /tmp/t36 triton==3.6.0`` and
put it first on PYTHONPATH): code generation differs between versions (3.9 turns the swapped fp8 products
into wgmma, 3.6 into mma.sync).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32",
         torch.float8_e4m3fn: "fp8e4nv", torch.uint8: "u8", torch.int64: "i64"}  # fmt: skip
LAUNCH_OPTIONS = ("num_warps", "num_stages", "maxnreg", "launch_pdl")


class _Captured(Exception):
    pass


def capture_launch(kv: str, hq: int, hkv: int, d: int, page: int, batch: int, swap_ab: bool | None,
                   config: tuple | None = None, stream: bool = False) -> dict:
    """The positional arguments and keywords ``paged_decode_attention`` passes to the chunked split kernel, or
    with ``stream`` to the stream split's (its plan kernel skipped: a zero plan stands in)."""
    import rollout.kernels.paged_decode as pd
    import rollout.kernels.paged_decode_stream as ps
    from rollout.layers.kv_quant import fp8_block_bytes, fp8_views

    nb = 64
    if kv == "fp8":
        cache, scales = fp8_views(torch.zeros(2, nb, fp8_block_bytes(page, hkv, d), dtype=torch.uint8), hkv, d)
    else:
        cache, scales = torch.zeros(2, nb, page, hkv, d, dtype=torch.bfloat16), None
    q = torch.zeros(batch, hq, d, dtype=torch.bfloat16)
    tables = torch.zeros(batch, 8, dtype=torch.int32)
    lens = torch.full((batch,), 100, dtype=torch.int32)
    got: dict = {}

    class Grab:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                got.update(args=args, kw=kw)
                raise _Captured

            return launch

    real, real_config, real_sms = pd._decode_split_kernel, pd.decode_config, pd.num_sms
    pd.num_sms = lambda device: 132  # an H100's or H200's: the launch's program count (and STREAM_SEGS's bound)
    real_stream, real_plan = ps._decode_stream_kernel, ps.stream_plan
    pd._decode_split_kernel, ps._decode_stream_kernel = Grab(), Grab()
    ps.stream_plan = lambda plans, seq_lens, block_n, window, programs, min_chunk, segs=0: (
        torch.zeros((programs, 5), dtype=torch.int32), torch.zeros((seq_lens.shape[0], 2), dtype=torch.int32))
    if config:
        pd.decode_config = lambda *_: config if len(config) == 4 else (*config, None)
    try:
        pd.paged_decode_attention(q, cache, tables, lens, 0.1, kv_scales=scales, swap_ab=swap_ab, stream=stream)
    except _Captured:
        pass
    finally:
        pd._decode_split_kernel, pd.decode_config, pd.num_sms = real, real_config, real_sms
        ps._decode_stream_kernel, ps.stream_plan = real_stream, real_plan
    return got


def compile_sm90(launch: dict, fn=None):
    """``triton.compile`` of ``fn`` (default: the decode split kernel) for sm_90 with the captured launch's
    specialisation."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if fn is None:
        import rollout.kernels.paged_decode as pd

        fn = pd._decode_split_kernel
    kw = dict(launch["kw"])
    options = {k: kw.pop(k) for k in LAUNCH_OPTIONS if k in kw}
    sig, consts, attrs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in kw or i >= len(launch["args"]):  # a keyword, or a constexpr left at its default
            sig[name], consts[name] = "constexpr", kw[name] if name in kw else fn.params[i].default
            continue
        v = launch["args"][i]
        if isinstance(v, torch.Tensor):
            sig[name] = "*" + TYPES[v.dtype]
            if v.data_ptr() % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, float):
            sig[name] = "fp32"
        elif v == 1:
            sig[name], consts[name] = "constexpr", 1
        else:
            sig[name] = "i32"
            if v % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(fn, sig, constexprs=consts, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                          options=options)  # fmt: skip


def cuobjdump(kernel, flag: str) -> str:
    import triton

    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        return subprocess.run([str(tools / "cuobjdump"), flag, str(cubin)], capture_output=True, text=True,
                              check=True).stdout  # fmt: skip


def registers(kernel) -> int | None:
    """Registers per thread (cuobjdump -res-usage)."""
    m = re.search(r"REG:(\d+)", cuobjdump(kernel, "-res-usage"))
    return int(m.group(1)) if m else None


def resident_programs(regs: int | None, shared: int, warps: int, sm_regs: int = 65536, sm_shared: int = 233472,
                      max_warps: int = 64) -> int | None:
    """Programs one H100/H200 SM holds at once: the least of what registers, shared memory and warps allow
    (register allocation rounded to 256 per warp; 228 KiB of shared memory, 1 KiB reserved per block)."""
    if regs is None:
        return None
    per_warp = -(-regs * 32 // 256) * 256
    by_regs = sm_regs // (per_warp * warps)
    by_shared = sm_shared // (shared + 1024) if shared else by_regs
    return min(by_regs, by_shared, max_warps // warps)


def disassemble(kernel) -> list[tuple[int, str, str]]:
    """(address, opcode, operands) per instruction, from cuobjdump of the kernel's cubin."""
    text = cuobjdump(kernel, "-sass")
    out = []
    for line in text.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]+)\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_.]+)(.*)", line)
        if m:
            out.append((int(m.group(1), 16), m.group(3), m.group(4)))
    return out


def mma_loops(instrs: list[tuple[int, str, str]]) -> list[dict]:
    """Every loop (a backward branch's span) holding a tensor-core instruction: its size and opcode mix."""
    loops = []
    for addr, op, rest in instrs:
        target = re.search(r"0x([0-9a-f]+)", rest) if op == "BRA" else None
        if target and int(target.group(1), 16) < addr:
            lo = int(target.group(1), 16)
            body = [o for a, o, _ in instrs if lo <= a <= addr]
            if any("MMA" in o for o in body):
                loops.append({"start": hex(lo), "end": hex(addr), "instructions": len(body),
                              "mix": dict(collections.Counter(body).most_common())})  # fmt: skip
    return loops


def report(kv: str, swap_ab: bool | None, hq: int, hkv: int, d: int, page: int, batch: int,
           config: tuple | None = None, stream: bool = False) -> dict:
    import triton

    import rollout.kernels.paged_decode_stream as ps

    launch = capture_launch(kv, hq, hkv, d, page, batch, swap_ab, config, stream)
    kernel = compile_sm90(launch, ps._decode_stream_kernel if stream else None)
    kw = launch["kw"]
    instrs = disassemble(kernel)
    regs = registers(kernel)
    loops = mma_loops(instrs)
    tile_bytes = kw["BLOCK_N"] * 2 * d * (1 if kv == "fp8" else 2)  # K and V of one key tile, one kv head
    main = loops[0] if loops else None
    return {
        "bench": "kernel_sass", "triton": triton.__version__, "target": "sm_90", "kv": kv, "swap_ab": kw["SWAP_AB"],
        "kernel": "stream" if stream else "split", "segs": kw.get("SEGS"),

        "hq": hq, "hkv": hkv, "head_dim": d, "page": page, "block_n": kw["BLOCK_N"], "G_PAD": kw["G_PAD"],
        "num_warps": kw.get("num_warps"), "num_stages": kw.get("num_stages"), "maxnreg": kw.get("maxnreg"),
        "shared_bytes": kernel.metadata.shared, "registers": regs,
        "programs_per_sm": resident_programs(regs, kernel.metadata.shared, kw["num_warps"]),
        "instructions": len(instrs), "tile_bytes": tile_bytes,
        "main_loop_instructions": main and main["instructions"],
        "bytes_per_warp_instruction": main and round(tile_bytes / (main["instructions"] * kw["num_warps"]), 2),
        "loops": loops,
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kv", default="bf16,fp8", help="comma list of bf16, fp8")
    p.add_argument("--swap-ab", default="default", help="comma list of 0, 1, default (the kernel's SWAP_AB)")
    p.add_argument("--hq", type=int, default=12)
    p.add_argument("--hkv", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page", type=int, default=16)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--config", default=None, help="BLOCK_N,num_warps,num_stages[,maxnreg]: the tile to compile")
    p.add_argument("--kernel", default="split", help="comma list of split (the chunked splits' kernel), stream "
                   "(the stream split's)")
    p.add_argument("--stream-segs", type=int, default=None,
                   help="paged_decode_stream.STREAM_SEGS for --kernel stream (0: the loop over a run's sequences)")
    p.add_argument("--out", default=None, help="append the JSON lines to this file")
    args = p.parse_args()
    config = tuple(int(x) for x in args.config.split(",")) if args.config else None
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    if args.stream_segs is not None:
        import rollout.kernels.paged_decode_stream as ps

        ps.STREAM_SEGS = args.stream_segs
    kernels = args.kernel.split(",")
    if not set(kernels) <= {"split", "stream"}:
        p.error(f"--kernel takes split and stream; got {args.kernel!r}")
    for kernel, kv, s in ((k, kv, s) for k in kernels for kv in args.kv.split(",") for s in args.swap_ab.split(",")):
        swap = None if s == "default" else bool(int(s))
        rec = report(kv, swap, args.hq, args.hkv, args.head_dim, args.page, args.batch, config, kernel == "stream")
        line = json.dumps(rec)
        print(line, flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(line + "\n")


if __name__ == "__main__":
    main()
