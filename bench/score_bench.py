"""GPU benchmark of ``Engine.score``: teacher-forced logprobs of 256 sequences of 4K tokens against the
engine's own prefill of the same tokens (issue 21's bar: score throughput >= 0.8 of prefill's).

Both runs go through the same engine (bf16, random-init model with a real shape, prefix caching off so
neither run reuses the other's blocks): ``prefill`` is ``generate(..., max_tokens=1)`` (every token
computed, one sampled), ``score`` is ``score(...)`` (every token computed, each next token's logprob
from the lm_head over every position). Prints JSON lines (and appends them to ``--out``).

    python bench/score_bench.py --out $OUT/score_bench.jsonl         # qwen2.5-1.5b, 256 x 4096
    python bench/score_bench.py --seqs 32 --len 1024                 # a quick look
    python bench/score_bench.py --block-size 128 --attention-backend fa4 --profile   # FA4 prefill (issue 23.7)
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from rollout import Engine, SamplingParams  # noqa: E402

BAR = 0.8


def load_bench_script():
    """scripts/bench.py's presets and model builder (random-init HF model with real shapes, bf16)."""
    spec = importlib.util.spec_from_file_location("bench_script", ROOT / "scripts" / "bench.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def timed(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def profile(fn) -> dict:
    """Kernel time against wall for one run, and the kernels that take the most of it."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        wall = timed(fn)
    kernels = sorted(((e.key, e.device_time_total) for e in prof.key_averages()), key=lambda kv: -kv[1])
    total_us = sum(t for _, t in kernels)
    return dict(wall_s=round(wall, 3), kernel_s=round(total_us / 1e6, 3), busy=round(total_us / 1e6 / wall, 3),
                **attention_share(kernels), top=[(k[:80], round(t / 1e3, 1)) for k, t in kernels[:12]])  # (kernel, ms)


ATTENTION_KERNELS = ("_prefill_kernel", "_decode_split_kernel", "_decode_reduce_kernel", "_decode_plan_kernel",
                     "flash", "fmha", "attention")  # lower case: matched against lower-cased kernel names


def attention_share(kernels: list[tuple[str, float]]) -> dict:
    """The attention kernels' time (ours: paged prefill / decode split, reduce, plan; FA4's FlashAttention*Sm90)
    and their share of all kernel time, from (kernel name, device us) pairs: issue 23.7's "attention share"."""
    total = sum(t for _, t in kernels)
    attn = sum(t for k, t in kernels if any(a in k.lower() for a in ATTENTION_KERNELS))
    return dict(attention_ms=round(attn / 1e3, 1), attention_share=round(attn / total, 3) if total else 0.0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen2.5-1.5b")
    p.add_argument("--seqs", type=int, default=256)
    p.add_argument("--len", type=int, default=4096, help="tokens per sequence")
    p.add_argument("--top-logprobs", type=int, default=0, help="also time score(..., top_logprobs=k)")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--attention-backend", default="auto", help="auto | triton | fa4 (FA4 prefill, issue 23.7) | ...")
    p.add_argument("--block-size", type=int, default=16, help="128: FA4's TMA page (auto picks fa4 there)")
    p.add_argument("--out", default=None)
    p.add_argument("--profile", action="store_true",
                   help="also run each once under torch.profiler: kernel time vs wall, and the top kernels")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("score_bench.py needs a CUDA GPU")
    bench = load_bench_script()
    hf = bench.build_hf(args.preset)
    vocab = hf.config.vocab_size
    gen = torch.Generator().manual_seed(3)
    seqs = [torch.randint(100, vocab - 100, (args.len,), generator=gen).tolist() for _ in range(args.seqs)]
    engine = Engine.from_pretrained(hf, dtype="bfloat16", max_model_len=args.len + 16, enable_prefix_caching=False,
                                    max_num_seqs=args.seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                                    attention_backend=args.attention_backend, block_size=args.block_size)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    # warm-up: Triton kernels compile, graphs capture, allocator settles
    engine.generate([s[:600] for s in seqs[:4]], one)
    engine.score([s[:600] for s in seqs[:4]], top_logprobs=args.top_logprobs)
    tokens = args.seqs * args.len
    runs = {"prefill": lambda: engine.generate(seqs, one), "score": lambda: engine.score(seqs)}
    if args.top_logprobs:
        runs[f"score_top{args.top_logprobs}"] = lambda: engine.score(seqs, top_logprobs=args.top_logprobs)
    best = {name: min(timed(fn) for _ in range(args.reps)) for name, fn in runs.items()}
    commit = bench._commit()
    if args.profile:
        for name, fn in runs.items():
            rec = dict(bench="score_profile", run=name, commit=commit, attention_backend=engine.attn.backend,
                       **profile(fn))
            print(json.dumps(rec), flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(rec) + "\n")
    for name, wall in best.items():
        rec = dict(bench="score", run=name, preset=args.preset, seqs=args.seqs, len=args.len, wall_s=round(wall, 3),
                   tok_s=round(tokens / wall, 1), timestamp=datetime.datetime.now(datetime.UTC).isoformat(),
                   device=torch.cuda.get_device_name(), commit=commit, attention_backend=engine.attn.backend,
                   block_size=args.block_size)
        if name != "prefill":
            rec["vs_prefill"] = round(best["prefill"] / wall, 3)  # throughput ratio
            rec["bar"] = BAR
            rec["meets_bar"] = rec["vs_prefill"] >= BAR
        line = json.dumps(rec)
        print(line, flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(line + "\n")


if __name__ == "__main__":
    main()
