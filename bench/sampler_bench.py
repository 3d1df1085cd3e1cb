"""GPU benchmark of sampling: the sampler alone and a whole decode step, greedy vs sampled.

Prints JSON lines. ``bench: sampler``: ms per call of the fused Triton sampler (and of the torch
reference, the path before it) on [256, 151936] fp32 logits, replayed from a CUDA graph as the engine
runs it, for logits of the random-init model (nearly flat: the worst case, every token's noise is
drawn and top-p rejects often) and LM-like ones (a few strong candidates). ``bench: decode_step``: the
engine's compute-stream ms per decode step at 256 sequences (qwen2.5-1.5b shape, 512-token prompts,
CUDA graphs captured before timing), its ratio to greedy (bars: t1 <= 1.10, t1p95 <= 1.25) and the
sampler's share of the step (sampler-alone ms on the model's logits over the step's ms).
``t1pen`` is t1 with repetition / presence / frequency penalties (device-side token counts): its step
over t1's is ``vs_no_penalties`` (bar <= 1.10).

    python bench/sampler_bench.py                      # ~1 minute on an H200
    python bench/sampler_bench.py --samplings t1,t1pen --skip-torch-sampler   # the penalties bar only
    python bench/sampler_bench.py --compare-torch      # also whole steps with the torch sampler
    python bench/sampler_bench.py --sweep              # fused sampler: block x num_warps grid
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from rollout import Engine, SamplingParams  # noqa: E402
from rollout.kernels.sampling import fused_sample  # noqa: E402
from rollout.layers.sampler import MODES, Penalties, SamplingTensors, sample_torch  # noqa: E402

PENALTIES = dict(repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.5)
SAMPLINGS = {"greedy": dict(temperature=0.0), "t1": dict(temperature=1.0), "t1p95": dict(temperature=1.0, top_p=0.95),
             "t1pen": dict(temperature=1.0, **PENALTIES)}
BARS = {"t1": 1.10, "t1p95": 1.25}
PENALTY_BAR = 1.10  # t1pen's step over t1's


def load_bench_script():
    """scripts/bench.py's presets and model builder (random-init HF model with real shapes, bf16)."""
    spec = importlib.util.spec_from_file_location("bench_script", ROOT / "scripts" / "bench.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def tensors(n: int, sampling: str, step: int = 0, vocab: int = 151936) -> SamplingTensors:
    """What the engine builds for n rows all sampled with ``sampling``."""
    kw, dev = SAMPLINGS[sampling], "cuda"
    return SamplingTensors(
        temperature=torch.full((n,), kw["temperature"], device=dev),
        top_k=torch.zeros(n, dtype=torch.int64, device=dev), top_p=torch.full((n,), kw.get("top_p", 1.0), device=dev),
        min_p=torch.zeros(n, device=dev), seed=torch.arange(n, dtype=torch.int64, device=dev) * 7919,
        position=torch.full((n,), step, dtype=torch.int64, device=dev),
        mode=torch.full((n,), MODES["policy"], dtype=torch.int64, device=dev),
        needs_filter="top_p" in kw, all_greedy=kw["temperature"] == 0, penalties=penalties(n, kw, vocab),
    )  # fmt: skip


def penalties(n: int, kw: dict, vocab: int) -> Penalties | None:
    """Rows as the engine builds them mid-generation: 512 prompt tokens and 64 output tokens per sequence."""
    if "repetition_penalty" not in kw:
        return None
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(2)
    hist = torch.zeros(n + 1, vocab, dtype=torch.int32, device=dev)
    rows = torch.arange(n, device=dev)[:, None]
    hist[rows, torch.randint(0, vocab, (n, 512), device=dev, generator=gen)] = 1
    hist.index_put_((rows.expand(n, 64).reshape(-1), torch.randint(0, vocab, (n * 64,), device=dev, generator=gen)),
                    torch.full((n * 64,), 2, dtype=torch.int32, device=dev), accumulate=True)
    full = lambda v: torch.full((n,), v, dtype=torch.float32, device=dev)  # noqa: E731
    return Penalties(hist, torch.arange(n, device=dev), full(kw["repetition_penalty"]), full(kw["presence_penalty"]),
                     full(kw["frequency_penalty"]))



def graph_ms(fn, reps: int = 30) -> float:
    """Median ms of one call replayed from a CUDA graph (warm-up and compile outside the capture)."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        graph.replay()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


def lm_like(n: int, vocab: int) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(n, vocab, device="cuda", generator=gen) * 2.0
    peaks = torch.randint(0, vocab, (n, 40), device="cuda", generator=gen)
    return x.scatter_add_(1, peaks, 6.0 + 6.0 * torch.rand(n, 40, device="cuda", generator=gen))


def bench_sampler(logit_sets: dict, args) -> dict:
    """Sampler-alone ms per (logits kind, sampling, impl); returns the fused ones on model logits."""
    model_ms = {}
    for kind, logits in logit_sets.items():
        for sampling in args.samplings:
            st = tensors(logits.shape[0], sampling, vocab=logits.shape[1])
            impls = {"fused": lambda x=logits, s=st: fused_sample(x, s, block=args.block, num_warps=args.num_warps)}
            if not args.skip_torch_sampler:
                impls["torch"] = lambda x=logits, s=st: sample_torch(x, s)
            for impl, fn in impls.items():
                ms = graph_ms(fn)
                rec = dict(bench="sampler", logits=kind, sampling=sampling, impl=impl, rows=logits.shape[0],
                           vocab=logits.shape[1], ms=round(ms, 4))  # fmt: skip
                if impl == "fused" and kind == "model":
                    model_ms[sampling] = ms
                print(json.dumps(rec), flush=True)
    return model_ms


def sweep(logits: torch.Tensor) -> None:
    for sampling in ("t1", "t1p95"):
        st = tensors(logits.shape[0], sampling)
        for block in (1024, 2048, 4096):
            for warps in (4, 8, 16):
                ms = graph_ms(lambda b=block, w=warps, s=st: fused_sample(logits, s, block=b, num_warps=w))
                print(json.dumps(dict(bench="sweep", sampling=sampling, block=block, num_warps=warps,
                                      ms=round(ms, 4))), flush=True)  # fmt: skip


def decode_steps(engine: Engine, prompts: list[list[int]], sampling: str, new: int) -> float:
    """Median compute-stream ms of the decode steps that ran all the prompts together."""
    warm = SamplingParams(max_tokens=4, ignore_eos=True, **SAMPLINGS[sampling])
    engine.generate([p[:8] for p in prompts], warm)  # captures the full batch's graph for this variant
    params = [SamplingParams(max_tokens=new, ignore_eos=True, seed=i, **SAMPLINGS[sampling])
              for i in range(len(prompts))]  # fmt: skip
    clock = engine.runner.clock
    clock.records.clear()
    clock.record_steps = True
    engine.generate(prompts, params)
    clock.record_steps = False
    full = [r.compute_ms for r in clock.records if r.decode and r.batch == len(prompts)]
    assert full, "no decode step ran the whole batch"
    return statistics.median(full)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="qwen2.5-1.5b")
    p.add_argument("--seqs", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--new", type=int, default=64, help="tokens per sequence in the timed decode run")
    p.add_argument("--block", type=int, default=2048)
    p.add_argument("--num-warps", type=int, default=8)
    p.add_argument("--compare-torch", action="store_true", help="also time whole steps with the torch sampler")
    p.add_argument("--skip-torch-sampler", action="store_true", help="skip the torch sampler-alone timings")
    p.add_argument("--sweep", action="store_true", help="fused sampler alone over block x num_warps")
    p.add_argument("--out", default=None, help="append the JSON lines to this file too")
    p.add_argument("--samplings", default=",".join(SAMPLINGS), help=f"comma-separated subset of {list(SAMPLINGS)}")
    args = p.parse_args()
    args.samplings = args.samplings.split(",")
    unknown = [s for s in args.samplings if s not in SAMPLINGS]
    if unknown:
        sys.exit(f"unknown --samplings {unknown}; allowed: {list(SAMPLINGS)}")
    if not torch.cuda.is_available():
        sys.exit("sampler_bench.py needs a CUDA GPU")
    if args.out:
        sys.stdout = _Tee(sys.stdout, open(args.out, "a"))
    bench = load_bench_script()
    hf = bench.build_hf(args.preset)
    vocab = hf.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(100, vocab - 100, (args.prompt_len,), generator=gen).tolist() for _ in range(args.seqs)]
    with torch.no_grad():  # the model's own head on normalised random states: its logits' distribution
        h = torch.randn(args.seqs, hf.config.hidden_size, device="cuda", dtype=torch.bfloat16)
        model_logits = hf.lm_head(hf.model.norm(h)).float().contiguous()
    model_ms = bench_sampler({"model": model_logits, "lm_like": lm_like(args.seqs, vocab)}, args)
    if args.sweep:
        sweep(model_logits)
    del model_logits
    torch.cuda.empty_cache()

    blocks = args.seqs * -(-(args.prompt_len + args.new + 16) // 16) + 64
    engine = Engine.from_pretrained(hf, dtype="bfloat16", max_model_len=args.prompt_len + args.new + 16,
                                    num_blocks=blocks, max_num_seqs=args.seqs)  # fmt: skip
    engine.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    import rollout.engine.runners.base as runner_mod  # forward_and_sample calls its ``sample``

    engine_sample = runner_mod.sample  # dispatches CUDA logits to the fused kernel
    for impl in ("fused", "torch") if args.compare_torch else ("fused",):
        runner_mod.sample = engine_sample if impl == "fused" else sample_torch  # bench-only swap
        engine.runner.graphs.clear()  # graphs captured with the other sampler
        steps = {s: decode_steps(engine, prompts, s, args.new) for s in args.samplings}
        for sampling, ms in steps.items():
            rec = dict(bench="decode_step", impl=impl, preset=args.preset, seqs=args.seqs, sampling=sampling,
                       ms_per_step=round(ms, 3), tok_s=round(args.seqs / ms * 1e3, 1))  # fmt: skip
            if "greedy" in steps:
                rec["vs_greedy"] = round(ms / steps["greedy"], 3)
            if sampling == "t1pen" and "t1" in steps:
                rec["vs_no_penalties"] = round(ms / steps["t1"], 3)
                rec["penalty_bar"] = PENALTY_BAR
                rec["meets_penalty_bar"] = rec["vs_no_penalties"] <= PENALTY_BAR
            if impl == "fused" and sampling in model_ms:
                rec["sampler_ms"] = round(model_ms[sampling], 4)
                rec["sampler_share"] = round(model_ms[sampling] / ms, 4)
            if sampling in BARS and "vs_greedy" in rec:
                rec["bar"] = BARS[sampling]
                rec["meets_bar"] = rec["vs_greedy"] <= BARS[sampling]
            print(json.dumps(rec), flush=True)


class _Tee:
    def __init__(self, *streams) -> None:
        self.streams = streams

    def write(self, text: str) -> None:
        for s in self.streams:
            s.write(text)
            s.flush()

    def flush(self) -> None:
        for s in self.streams:
            s.flush()


if __name__ == "__main__":
    main()
