"""Throughput benchmark on the GPU (DESIGN section 4): one JSON line per run.

    python scripts/bench.py --workload W1-short --modes async,sync --compare-hf --out bench/results/x.jsonl

Random-init models with real shapes, bf16, ignore_eos; ``--sampling`` picks greedy (the default, W2 aside),
``t1`` (temperature 1.0, seeded: W2's default) or ``t1p95`` (plus top_p 0.95), recorded as ``sampling``.
Ratios are measured in the same run:
``floor_ratio`` = the byte floor (weights + live KV each decode step must read, over the copy
bandwidth measured here) / the compute-stream time of those steps; ``roofline_ratio`` the same with
the roofline, per step and op class max(bytes / copy bandwidth, FLOPs / bf16 GEMM peak measured here)
(GEMMs: weights and 2 FLOPs per weight per row; attention: live KV and 4 * Hq * D FLOPs per cached
token per layer), so the bar is honest where a large batch makes the GEMMs compute-bound;
``gpu_busy_frac`` = compute-stream time / wall time; ``vs_hf`` = our tok/s over Hugging Face
continuous batching's on the same prompts.
Memory-bound runs (issue 23.5): ``--kv-budget-frac 0.3`` sizes the KV cache to 30% of the bf16 bytes the
workload needs at full length (fp8: the same bytes), ``--preemption swap,recompute`` runs each KV dtype with and
without a host swap pool; records carry ``fp8_vs_bf16`` and ``swap_vs_recompute`` (docs/benchmarks.md, W2-mem).
Imports only torch, transformers and the engine (the GPU machine has no hydra/wandb/datasets).
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import math
import os
import subprocess
import sys
import time

import torch

# Python puts this directory first on sys.path, where scripts/rollout.py would shadow the `rollout` package
# (which comes from the install or PYTHONPATH).
sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.curdir) != os.path.dirname(os.path.realpath(__file__))]

from rollout import Engine, SamplingParams  # noqa: E402
from rollout.config import EngineConfig  # noqa: E402
from rollout.engine.runners.graphs import EVEN, UNEVEN, UNIFORM  # noqa: E402
from rollout.engine.runners.kv_cache import KVCacheTooLarge  # noqa: E402
from rollout.kernels.knobs import knob_module  # noqa: E402
from rollout.layers.gemm_tune import ROUTE_KNOBS, route_knobs  # noqa: E402
from rollout.layers.kv_quant import fp8_block_bytes  # noqa: E402

PRESETS = {  # public config shapes, random weights
    "llama3-8b": ("llama", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                max_position_embeddings=32768, rope_theta=500000.0)),
    "qwen2.5-1.5b": ("qwen2", dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                   num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                                   tie_word_embeddings=True, max_position_embeddings=32768, rope_theta=1e6)),
    "qwen3-0.6b": ("qwen3", dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                                 tie_word_embeddings=True, max_position_embeddings=40960, rope_theta=1e6)),
}
WORKLOADS = {
    "W1": dict(preset="llama3-8b", prompts=32, prompt_len=128, new=8192),
    "W1-short": dict(preset="llama3-8b", prompts=32, prompt_len=128, new=1024),
    "W2": dict(preset="qwen2.5-1.5b", prompts=64, prompt_len=512, new=16384, n=8),
    "W3": dict(preset="qwen3-0.6b", prompts=256, prompt_len=128, new=1024),
    # 512 + 32000 + 16 stays within qwen2.5-1.5b's 32768 positions
    "W2-32K": dict(preset="qwen2.5-1.5b", prompts=64, prompt_len=512, new=32000, n=8),
    # Memory-bound W2 (issue 23.5): W2's shape (qwen2.5-1.5b, 512-token prompts, n=8, log-uniform long-tail lengths,
    # t1 seeded) with 32 prompts = 256 sequences, all admitted at once (max_num_seqs 256), and lengths from 3,072
    # to 6,144 (W2's run from 256: there few sequences are long at once, so a budget of the all-at-full-length need
    # hardly binds and the longest sequence's steps set the wall time). ~1.15 M tokens per config. At
    # --kv-budget-frac 0.3 bf16 KV holds 30% of the need (~10 GiB), fp8 the same bytes (~59%); both preempt.
    # Expected on one H200 (bench/membound_sim.py, its step model within 4% of W2's measured 113 s): ~45-55 s a
    # config, so auto,fp8 x swap,recompute (4 configs) ~3.5 min of generation, ~5-6 min with engine builds,
    # graph capture and the swap pools' pinned allocation.
    "W2-mem": dict(preset="qwen2.5-1.5b", prompts=32, prompt_len=512, new=6144, min_new=3072, n=8),
}
# W4 (multi-turn, issue 22) lives in bench/multiturn.py: 256 conversations x 4 turns x 256 tokens, qwen3-0.6b
MULTITURN = ("W4", "W4-geo")  # W4-geo: turns end at stop ids (geometric lengths, mean 256, cap 512)


def build_hf(preset: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    family, kw = PRESETS[preset]
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[family]
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cls(**kw), dtype=torch.bfloat16, attn_implementation="paged|sdpa")
    return model.eval()


def copy_bandwidth_tbps() -> float:
    x = torch.empty(4 * 1024**3, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(20):
        y.copy_(x)
    e.record()
    torch.cuda.synchronize()
    ms = s.elapsed_time(e) / 20
    del x, y
    torch.cuda.empty_cache()
    return 2 * 4 * 1024**3 / (ms / 1e3) / 1e12


def matmul_peak_tflops(n: int = 8192, reps: int = 20) -> float:
    """bf16 GEMM TFLOP/s measured here (n x n x n, median of ``reps``): the roofline's compute roof."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        a @ b
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    del a, b
    torch.cuda.empty_cache()
    return 2 * n**3 / (sorted(times)[reps // 2] / 1e3) / 1e12


def gemm_params(hf: torch.nn.Module) -> int:
    """Weights multiplied per token per step: every Linear, the lm_head included (tied or not)."""
    return sum(m.weight.numel() for m in hf.modules() if isinstance(m, torch.nn.Linear))


def roofline_s(records: list, weight_bytes: int, kv_token_bytes: float, gemm_weights: int, attn_flops_per_token: int,
               bw_tbps: float, peak_tflops: float) -> dict[str, float]:
    """Seconds of the decode ``records`` (batch, kv_tokens each) at the roofline: per step and op class,
    max(bytes / bandwidth, FLOPs / peak). GEMMs: the weights, 2 FLOPs per weight per row (compute-bound
    at large batch); attention: the live KV, ``attn_flops_per_token`` per cached token. Norms, rotary,
    sampling are left out, as in the byte floor."""
    bw, peak = bw_tbps * 1e12, peak_tflops * 1e12
    gemm = attn = 0.0
    compute_bound = 0
    for r in records:
        g_bytes, g_flops = weight_bytes / bw, 2 * gemm_weights * r.batch / peak
        gemm += max(g_bytes, g_flops)
        compute_bound += g_flops > g_bytes
        attn += max(r.kv_tokens * kv_token_bytes / bw, r.kv_tokens * attn_flops_per_token / peak)
    return dict(total=gemm + attn, gemm=gemm, attn=attn, gemm_compute_bound_steps=compute_bound)


def decode_by_batch(records: list, weight_bytes: int, kv_token_bytes: float, bw_tbps: float,
                    bucket: int = 32) -> dict[str, list]:
    """Decode steps grouped by batch size (buckets of ``bucket`` sequences, keyed by their first size):
    [steps, mean compute ms, mean byte-floor ms, floor / compute]. Two runs' tables, side by side, say at which
    batch sizes one path (fp8 KV, a split rule) gains or loses, where the means over a run cannot."""
    groups: dict[int, list] = {}
    for r in records:
        g = groups.setdefault(r.batch // bucket * bucket, [0, 0.0, 0.0])
        g[0] += 1
        g[1] += r.compute_ms
        g[2] += (weight_bytes + r.kv_tokens * kv_token_bytes) / (bw_tbps * 1e12) * 1e3
    return {str(k): [n, round(ms / n, 3), round(fl / n, 3), round(fl / ms, 3) if ms else None]
            for k, (n, ms, fl) in sorted(groups.items())}


SPLIT_KINDS = {UNEVEN: "uneven", EVEN: "even", UNIFORM: "uniform"}  # graphs.split_kind's kinds, by name


def decode_by_kind(records: list, weight_bytes: int, kv_token_bytes: float, bw_tbps: float) -> dict[str, dict]:
    """``decode_by_batch`` within each split kind the decode kernel took (the balanced partition for uneven
    lengths, the fixed even split, one wave for uniform ones): fp8 and bf16 steps of one bucket may differ in how
    they were cut, and a bucket whose ratio breaks from its neighbours' says which rule to look at."""
    kinds: dict[str, list] = {}
    for r in records:
        kinds.setdefault(SPLIT_KINDS[getattr(r, "split", UNEVEN)], []).append(r)
    return {k: decode_by_batch(rs, weight_bytes, kv_token_bytes, bw_tbps) for k, rs in sorted(kinds.items())}


SAMPLING = {"greedy": dict(temperature=0.0), "t1": dict(temperature=1.0), "t1p95": dict(temperature=1.0, top_p=0.95)}


def sampling_of(w: dict, args: argparse.Namespace) -> str:
    return args.sampling or ("t1" if "n" in w else "greedy")  # W2 has always sampled


def sampling_kw(sampling: str, seed: int) -> dict:
    kw = dict(SAMPLING[sampling])
    return kw if sampling == "greedy" else dict(kw, seed=seed)


def make_prompts(w: dict, vocab: int, sampling: str = "greedy") -> tuple[list[list[int]], list[SamplingParams]]:
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(100, vocab - 100, (w["prompt_len"],), generator=g).tolist() for _ in range(w["prompts"])]
    if "n" in w:  # W2: long-tailed lengths (log-uniform) from `min_new` (256) up to `new`, a group of n per prompt
        low = math.log(w.get("min_new", 256))
        lens = [int(min(w["new"], math.exp(torch.empty(1).uniform_(low, math.log(w["new"]), generator=g).item())))
                for _ in prompts]
        params = [SamplingParams(n=w["n"], max_tokens=k, ignore_eos=True, **sampling_kw(sampling, i))
                  for i, k in enumerate(lens)]
    else:
        params = [SamplingParams(max_tokens=w["new"], ignore_eos=True, **sampling_kw(sampling, i))
                  for i in range(len(prompts))]
    return prompts, params


PREEMPTION = ("swap", "recompute")  # swap: a host pool (engine swap_space_gib) for what the budget leaves out


def kv_block_bytes(preset: str, kv_cache_dtype: str, block_size: int) -> int:
    """Bytes of one KV block (K and V of every layer, fp8's scales included), as the engine lays it out for
    ``preset``; ``auto`` is the bench's model dtype, bf16."""
    _, kw = PRESETS[preset]
    head_dim = kw.get("head_dim") or kw["hidden_size"] // kw["num_attention_heads"]
    heads = kw["num_key_value_heads"]
    if kv_cache_dtype == "fp8":
        layer = fp8_block_bytes(block_size, heads, head_dim)
    else:
        itemsize = {"auto": 2, "bfloat16": 2, "float16": 2, "float32": 4}[kv_cache_dtype]
        layer = block_size * heads * head_dim * itemsize
    return 2 * kw["num_hidden_layers"] * layer


def kv_need_blocks(prompt_len: int, params: list[SamplingParams], block_size: int) -> int:
    """Blocks the workload needs with every sequence at full length (prompt + its own ``max_tokens``, W2's
    long tail included), a group's prompt counted once per sample: what a KV budget is a fraction of."""
    return sum(p.n * -(-(prompt_len + p.max_tokens) // block_size) for p in params)


def check_budget_frac(frac: float) -> float:
    if not 0.0 < frac <= 1.0:  # NaN fails too
        raise ValueError(f"--kv-budget-frac must be in (0, 1] (the KV cache as a fraction of the blocks the "
                         f"workload needs at full length), got {frac}")
    return frac


def kv_budget(need_blocks: int, frac: float, preset: str, kv_cache_dtype: str, block_size: int) -> tuple[int, int]:
    """(num_blocks, bytes) of a KV cache of ``frac`` x the need's bytes *in bf16*, in ``kv_cache_dtype``'s blocks:
    fp8 gets the same bytes, so ~1.97x bf16's blocks (what FP8 KV is for when memory binds)."""
    budget = int(check_budget_frac(frac) * need_blocks * kv_block_bytes(preset, "bfloat16", block_size))
    block = kv_block_bytes(preset, kv_cache_dtype, block_size)
    num_blocks = max(1, budget // block)
    return num_blocks, num_blocks * block


def swap_space_gib(need_blocks: int, num_blocks: int, block_bytes: int) -> float:
    """A host pool holding every block the budget leaves out (rounded up to 1/4 GiB, at least 1/4 GiB)."""
    return max(0.25, math.ceil(max(0, need_blocks - num_blocks) * block_bytes / 2**30 * 4) / 4)


def parse_budget_fracs(text: str) -> list[float]:
    """``--kv-budget-frac``: a comma list of fractions in (0, 1]."""
    fracs = []
    for part in text.split(","):
        try:
            frac = float(part)
        except ValueError:
            raise argparse.ArgumentTypeError(f"--kv-budget-frac takes a comma list of numbers in (0, 1], "
                                             f"got {part!r}") from None
        try:
            fracs.append(check_budget_frac(frac))
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return fracs


def parse_preemptions(text: str) -> list[str]:
    """``--preemption``: a comma list of swap, recompute (each once)."""
    modes = text.split(",")
    bad = [m for m in modes if m not in PREEMPTION]
    if bad or len(set(modes)) != len(modes):
        raise argparse.ArgumentTypeError(f"--preemption takes a comma list of {', '.join(PREEMPTION)} "
                                         f"(each once), got {text!r}")
    return modes


def config_ratios(recs: list[dict], first_kv: str) -> list[str]:
    """Ratios between configurations of one run, written into the records: ``vs_first_kv`` (tok/s over the
    first --kv-cache-dtype's), ``fp8_vs_bf16`` (fp8 over bf16 KV) at the same workload, mode, budget and
    preemption; ``swap_vs_recompute`` at the same workload, mode, budget and KV dtype. Returns one summary
    line per record."""
    runs = [r for r in recs if "tok_s" in r and "push_ms" not in r]

    def find(r: dict, **want: object) -> dict | None:
        keys = ("workload", "mode", "kv_budget_frac", "preemption", "kv_cache_dtype")
        return next((o for o in runs if o is not r and all(o.get(k) == want.get(k, r.get(k)) for k in keys)), None)

    lines = []
    for r in runs:
        kv = r.get("kv_cache_dtype")
        base = find(r, kv_cache_dtype=first_kv) if kv != first_kv else None
        if base:
            r["vs_first_kv"] = round(r["tok_s"] / base["tok_s"], 3)
        bf16 = (find(r, kv_cache_dtype="auto") or find(r, kv_cache_dtype="bfloat16")) if kv == "fp8" else None
        if bf16:
            r["fp8_vs_bf16"] = round(r["tok_s"] / bf16["tok_s"], 3)
        rec = find(r, preemption="recompute") if r.get("preemption") == "swap" else None
        if rec:
            r["swap_vs_recompute"] = round(r["tok_s"] / rec["tok_s"], 3)
        line = (f"summary {r['workload']} {r['mode']} kv={kv} budget={r.get('kv_budget_frac')} "
                f"preemption={r.get('preemption')}: {r['tok_s']} tok/s, {r.get('preemptions')} preemptions "
                f"(swap out/in {r.get('swap_outs')}/{r.get('swap_ins')}), wall {r.get('wall_s')} s")
        for key in ("fp8_vs_bf16", "swap_vs_recompute"):
            if key in r:
                line += f", {key} {r[key]}"
        lines.append(line)
    return lines


def make_engine(hf: torch.nn.Module, w: dict, params: list[SamplingParams], mode: str,
                args: argparse.Namespace) -> tuple[Engine, dict]:
    """Blocks for every sequence at full length (+10%), or the most that fit beside the step's workspace; with
    ``args.kv_budget_frac``, that fraction of the need's bf16 bytes (``kv_budget``) and, for ``args.preemption``
    swap, a host pool for the rest. Returns the engine and the sizing for the record."""
    n = w.get("n", 1)
    opts = dict(dtype="bfloat16", max_model_len=w["prompt_len"] + w["new"] + 16, max_num_seqs=args.max_num_seqs,
                async_mode=(mode == "async"), kv_cache_dtype=args.kv_cache_dtype)
    bs = getattr(args, "block_size", None) or EngineConfig().block_size
    opts.update(block_size=bs, attention_backend=getattr(args, "attention_backend", "auto"))
    if getattr(args, "gemm_autotune", False):
        opts["gemm_autotune"] = True
    frac = getattr(args, "kv_budget_frac", None)
    need = kv_need_blocks(w["prompt_len"], params, bs)
    info = dict(kv_budget_frac=frac, kv_need_blocks=need, preemption=getattr(args, "preemption", None) or "recompute")
    if frac is None:
        blocks = int(sum(-(-(w["prompt_len"] + p.max_tokens) // bs) * n for p in params) * 1.1) + 64
    else:
        blocks, _ = kv_budget(need, frac, w["preset"], args.kv_cache_dtype, bs)
        if info["preemption"] == "swap":
            opts["swap_space_gib"] = swap_space_gib(need, blocks, kv_block_bytes(w["preset"], args.kv_cache_dtype, bs))
    info["swap_space_gib"] = opts.get("swap_space_gib", 0.0)
    if getattr(args, "decode_split", "balanced") == "legacy":
        with legacy_decode_split(opts["max_model_len"]):
            engine, info = make_engine(hf, w, params, mode, argparse.Namespace(**{**vars(args), "decode_split": None}))
        return engine, dict(info, decode_split="legacy")
    info["decode_split"] = "balanced"
    try:
        return Engine.from_pretrained(hf, num_blocks=blocks, **opts), dict(info, kv_budget_fit=True)
    except KVCacheTooLarge as e:
        fit = e.max_num_blocks  # the engine keeps headroom beside it (EXPLICIT_HEADROOM_FRACTION)
    # Retry outside the except block, whose traceback holds the failed engine's frames (its weights are freed by
    # the engine itself: loading.release), so the count that fits is measured as the error measured it.
    print(f"num_blocks {blocks} does not fit; using {fit}", flush=True)
    return Engine.from_pretrained(hf, num_blocks=fit, **opts), dict(info, kv_budget_fit=False)


def generate_with_push(engine: Engine, hf: torch.nn.Module, prompts: list, params: list, recompute: bool) -> tuple:
    """generate(), with one update_weights(recompute_running=...) once half the tokens are out (issue 13.5)."""
    start = engine.get_stats().num_generated_tokens  # warm-up tokens
    half = sum(p.max_tokens * p.n for p in params) // 2
    rids = [engine.add_request(prompt, sp) for prompt, sp in zip(prompts, params)]
    weights = [(name, t.detach()) for name, t in hf.named_parameters()]
    done, push = {}, None
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step())
        stats = engine.get_stats()
        if push is None and stats.num_generated_tokens - start >= half:
            kv_tokens = int(stats.kv_cache_usage * engine.kv.num_tokens)
            torch.cuda.synchronize()
            t = time.perf_counter()
            engine.update_weights(weights, recompute_running=recompute)
            torch.cuda.synchronize()
            push = dict(recompute_running=recompute, push_ms=round((time.perf_counter() - t) * 1e3, 1),
                        running_at_push=stats.num_running_seqs, live_kv_tokens_at_push=kv_tokens,
                        generated_at_push=stats.num_generated_tokens - start)
    return [done[r] for r in rids], push


class legacy_decode_split:
    """Within the block, engines built take the previous split heuristic for decode (issue 23.4's A/B): every
    sequence of a step in ``choose_num_splits(batch, kv heads, max_tiles, SMs)`` fixed chunks, ``max_tiles``
    from the engine's ``max_model_len`` (a host constant per batch size, so the captured graphs stay valid),
    instead of chunks balanced over the live lengths on the device. The Triton backend binds the kernel when
    it is built, so the wrapper must be in place while the engine is built."""

    def __init__(self, max_model_len: int) -> None:
        self.max_model_len = max_model_len

    def __enter__(self):
        import rollout.kernels.paged_decode as pd

        self.pd, self.real = pd, pd.paged_decode_attention
        self.kernel = self.real  # what decode() calls (a test may stand in for it)
        pd.paged_decode_attention = self.decode
        return self

    def __exit__(self, *exc) -> None:
        self.pd.paged_decode_attention = self.real

    def num_splits(self, q: torch.Tensor, kv_cache) -> int:
        from rollout.kernels.paged_common import kv_halves, kv_shape

        pd = self.pd
        page, hkv, d = kv_shape(kv_cache)
        block_n = pd.decode_config(page, d, kv_halves(kv_cache)[0].dtype)[0]
        return pd.choose_num_splits(q.shape[0], hkv, -(-self.max_model_len // block_n), pd.num_sms(q.device))

    def decode(self, q, kv_cache, block_tables, seq_lens, scale, sliding_window=None, out=None, num_splits=None,
               **kw):  # fmt: skip
        if num_splits is None:
            num_splits = self.num_splits(q, kv_cache)
        return self.kernel(q, kv_cache, block_tables, seq_lens, scale, sliding_window, out, num_splits, **kw)


def warm_up(engine, prompts: list[list[int]], n: int, max_num_seqs: int, warm_kw: dict) -> None:
    """Everything the timed run will compile or capture, run first: the run's prompts shifted by one token id (no
    prefix-cache hit later) in groups of ``n`` as the run samples them, so the siblings' prefix-cache hits and the
    mixed steps they join compile here (W2's records had a 1.2-1.5 s step there, inside the timing), then every
    decode graph size, with even and uneven lengths. ``warm_kw``: the run's graph variant (greedy / filtered)."""
    engine.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    shifted = [[t + 1 for t in p] for p in prompts[:max_num_seqs]]
    engine.generate(shifted, SamplingParams(n=n, max_tokens=2, ignore_eos=True, **warm_kw))
    warm = [[1] * 8] * min(len(prompts) * n, max_num_seqs)
    engine.generate(warm, SamplingParams(max_tokens=2, ignore_eos=True, **warm_kw))
    long = [1] * 64  # one long context among short ones: the graphs of uneven lengths (the balanced split)
    for b in sorted(engine.runner.graph_sizes, reverse=True):
        if b <= len(warm):
            engine.generate(warm[:b], SamplingParams(max_tokens=3, ignore_eos=True, **warm_kw))
            if b >= 3:  # two lengths are always even (the longest is at most their sum)
                engine.generate(warm[: b - 1] + [long], SamplingParams(max_tokens=3, ignore_eos=True, **warm_kw))


def run_ours(name: str, w: dict, hf: torch.nn.Module, mode: str, bw: float, args: argparse.Namespace,
             push: bool | None = None, peak: float | None = None) -> dict:
    sampling = sampling_of(w, args)
    prompts, params = make_prompts(w, hf.config.vocab_size, sampling)
    n = w.get("n", 1)
    engine, sizing = make_engine(hf, w, params, mode, args)
    route_knobs(engine.model, getattr(args, "decode_knobs", None) or {})  # the GEMM knobs are per layer
    if engine.kv.block_bytes != kv_block_bytes(w["preset"], args.kv_cache_dtype, engine.kv.config.block_size):
        sizing["kv_block_bytes_mismatch"] = engine.kv.block_bytes  # the budget's bytes are off: say so
    warm_up(engine, prompts, n, args.max_num_seqs, sampling_kw(sampling, 0))
    runner = engine.runner
    runner.clock.records.clear()
    runner.clock.record_steps = True
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    s0 = engine.get_stats()  # warm-up counts stay out of the record
    t0 = time.perf_counter()
    if push is None:
        outs, push_rec = engine.generate(prompts, params), None
    else:
        outs, push_rec = generate_with_push(engine, hf, prompts, params, push)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    s1 = engine.get_stats()
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    m = engine.model
    weight_bytes = m.weight_bytes_per_step()  # an untied input embedding is gathered, not read whole
    kv_token_bytes = engine.kv.token_bytes  # fp8: values + scales
    dec = [r for r in runner.clock.records if r.decode]
    pre = [r for r in runner.clock.records if not r.decode]
    floor_s = sum((weight_bytes + r.kv_tokens * kv_token_bytes) / (bw * 1e12) for r in dec)
    dec_s = sum(r.compute_ms for r in dec) / 1e3
    cfg = hf.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    roof = roofline_s(dec, weight_bytes, kv_token_bytes, gemm_params(hf),
                      4 * cfg.num_attention_heads * head_dim * cfg.num_hidden_layers, bw, peak or float("inf"))
    busy = sum(r.compute_ms for r in runner.clock.records) / 1e3 / wall
    rec = dict(
        workload=name, timestamp=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), mode=mode,
        sampling=sampling,
        preset=w["preset"], prompts=len(prompts), n=n, new_tokens=w["new"], wall_s=round(wall, 3),
        generated_tokens=tokens, tok_s=round(tokens / wall, 1), decode_steps=len(dec),
        steps=len(runner.clock.records), mean_step_ms=round(wall / max(1, len(runner.clock.records)) * 1e3, 3),
        mean_decode_compute_ms=round(dec_s / max(1, len(dec)) * 1e3, 3),
        gpu_busy_frac=round(busy, 4), floor_ms=round(floor_s / max(1, len(dec)) * 1e3, 3),
        floor_ratio=round(floor_s / dec_s, 4) if dec_s else None,
        floor_ratio_wall=round(floor_s / wall, 4),
        roofline_ms=round(roof["total"] / max(1, len(dec)) * 1e3, 3),
        roofline_ratio=round(roof["total"] / dec_s, 4) if dec_s else None,
        roofline_gemm_ms=round(roof["gemm"] / max(1, len(dec)) * 1e3, 3),
        roofline_attn_ms=round(roof["attn"] / max(1, len(dec)) * 1e3, 3),
        gemm_compute_bound_steps=roof["gemm_compute_bound_steps"], matmul_peak_tflops=peak and round(peak, 1),
        mean_decode_batch=round(sum(r.batch for r in dec) / max(1, len(dec)), 1),
        decode_by_batch=decode_by_batch(dec, weight_bytes, kv_token_bytes, bw),
        decode_by_kind=decode_by_kind(dec, weight_bytes, kv_token_bytes, bw),
        max_decode_batch=max((r.batch for r in dec), default=0),
        eager_decode_steps=sum(not getattr(r, "graph_b", 0) for r in dec) if runner.cuda_graphs else len(dec),
        peak_mem_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2),
        copy_bw_tbps=round(bw, 3), device=torch.cuda.get_device_name(), commit=_commit(),
        attention_backend=engine.attn.backend, block_size=engine.kv.config.block_size, cuda_graphs=runner.cuda_graphs,
        kv_cache_dtype=args.kv_cache_dtype, kv_capacity_tokens=engine.kv.num_tokens,
        kv_workspace_gib=round(engine.kv.workspace_bytes / 2**30, 2),
        **sizing, num_blocks=engine.kv.num_blocks, kv_bytes=engine.kv.num_blocks * engine.kv.block_bytes,
        preemptions=s1.num_preemptions - s0.num_preemptions, swap_outs=s1.num_swap_outs - s0.num_swap_outs,
        swap_ins=s1.num_swap_ins - s0.num_swap_ins, swapped_out_bytes=s1.swapped_out_bytes - s0.swapped_out_bytes,
        prefill_tokens=s1.num_prefill_tokens - s0.num_prefill_tokens, prefill_steps=len(pre),
        prefill_compute_s=round(sum(r.compute_ms for r in pre) / 1e3, 3),
        prefill_step_ms=[[r.batch, round(r.compute_ms, 1)] for r in pre][:64],  # [sequences, compute ms] per step
        max_len_reached=max(len(c.token_ids) for o in outs for c in o.outputs),
        truncated=sum(len(c.token_ids) < sp.max_tokens for o, sp in zip(outs, params) for c in o.outputs),
    )
    if getattr(runner, "gemm_picks", None):  # --gemm-autotune: each graph size's tuned projections
        rec["gemm_picks"] = [p.as_record() for b in sorted(runner.gemm_picks) for p in runner.gemm_picks[b]]
    if push_rec is not None:
        rec.update(push_rec, workload=f"{name}+push")
    print(f"{rec['workload']} {mode} kv={rec['kv_cache_dtype']} budget={rec['kv_budget_frac']} "
          f"preemption={rec['preemption']}: {rec['tok_s']} tok/s, wall {rec['wall_s']} s, {rec['preemptions']} "
          f"preemptions, swap out/in {rec['swap_outs']}/{rec['swap_ins']}", flush=True)  # kept if the call times out
    del engine, runner
    gc.collect()
    torch.cuda.empty_cache()
    if args.logprob_check and push is None:
        try:  # a failed check must not lose the run's numbers
            rec["logprob_mean_abs_diff_vs_hf"] = logprob_check(hf, prompts, outs, args.logprob_check)
        except Exception as e:  # noqa: BLE001
            rec["logprob_check_error"] = f"{type(e).__name__}: {e}"[:300]
    del outs
    return rec


@torch.no_grad()
def logprob_check(hf: torch.nn.Module, prompts: list, outs: list, samples: int) -> float:
    """Mean |our logprob - HF bf16's| over the tokens of the first ``samples`` completions, teacher-forced
    (T = 1 policy logprobs; logits in chunks so a 16K-token sample stays small)."""
    diffs: list = []
    paged = hf.config._attn_implementation
    hf.set_attn_implementation("sdpa")  # the bench's model is built for HF continuous batching (paged|sdpa)
    try:
        _teacher_force(hf, prompts, outs, samples, diffs)
    finally:
        hf.set_attn_implementation(paged)
    return round(torch.cat(diffs).mean().item(), 5)


def _teacher_force(hf: torch.nn.Module, prompts: list, outs: list, samples: int, diffs: list) -> None:
    done = 0
    for prompt, o in zip(prompts, outs):
        for c in o.outputs:
            if done == samples:
                break
            ids = torch.tensor([prompt + c.token_ids], device="cuda")
            hidden = hf.model(ids).last_hidden_state[0, len(prompt) - 1 : -1]
            toks = torch.tensor(c.token_ids, device="cuda")
            for i in range(0, len(toks), 2048):
                lp = torch.log_softmax(hf.lm_head(hidden[i : i + 2048]).float(), -1)
                ref = lp.gather(1, toks[i : i + 2048, None])[:, 0]
                diffs.append((ref.cpu() - torch.tensor(c.logprobs[i : i + 2048])).abs())
            done += 1


def with_config(args: argparse.Namespace, kv: str, frac: float | None = None,
                preemption: str | None = None) -> argparse.Namespace:
    """``args`` for one configuration: KV dtype, KV budget fraction (None: enough for the workload), preemption."""
    return argparse.Namespace(**{**vars(args), "kv_cache_dtype": kv, "kv_budget_frac": frac, "preemption": preemption})


def configs_of(args: argparse.Namespace) -> list[tuple[str, float | None, str | None]]:
    """Every (kv dtype, budget, preemption) the options ask for, KV dtype innermost (fp8 right after bf16)."""
    return [(kv, frac, pre) for frac in args.kv_budget_fracs or [None] for pre in args.preemptions or [None]
            for kv in args.kv_cache_dtypes]


def run_hf(hf: torch.nn.Module, w: dict, modes: list[str]) -> dict:
    """Hugging Face continuous batching on the same prompts (as ../shared/anchors/hf_cb_bench.py)."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    prompts, _ = make_prompts(w, hf.config.vocab_size)
    gen = GenerationConfig(max_new_tokens=w["new"], do_sample=False, eos_token_id=None, pad_token_id=0)
    res = {}
    for mode in modes:
        kw = {"sync": dict(use_async_batching=False), "sync_graph": dict(use_async_batching=False, use_cuda_graph=True),
              "async": dict(use_async_batching=True, use_cuda_graph=True)}[mode]
        try:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = hf.generate_batch(inputs=prompts, generation_config=gen,
                                    continuous_batching_config=ContinuousBatchingConfig(**kw), warmup=True)
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
            ntok = sum(len(o.generated_tokens) for o in out.values())
            res[mode] = dict(seconds=round(wall, 2), tokens=ntok, tok_s=round(ntok / wall, 1))
        except Exception as e:  # record HF's failure, keep benchmarking
            res[mode] = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
        print("hf", mode, res[mode], flush=True)
        gc.collect()
        torch.cuda.empty_cache()
    return res


def run_weight_push(hf: torch.nn.Module, preset: str, repeats: int = 3) -> dict:
    """Seconds to push every weight into a live engine: from GPU tensors and from pinned CPU tensors."""
    engine = Engine.from_pretrained(hf, dtype="bfloat16", max_model_len=1024, num_blocks=256)
    gpu = [(n, p.detach()) for n, p in hf.named_parameters()]
    host = [(n, t.to("cpu").pin_memory()) for n, t in gpu]
    nbytes = sum(t.numel() * t.element_size() for _, t in gpu)
    rec = dict(workload="weight_push", preset=preset, bytes=nbytes, device=torch.cuda.get_device_name(),
               timestamp=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), commit=_commit())
    for label, src in (("gpu", gpu), ("pinned_cpu", host)):
        times = []
        for _ in range(repeats):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            engine.update_weights(src)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        rec[f"{label}_ms"] = round(min(times) * 1e3, 1)
        rec[f"{label}_gbps"] = round(nbytes / min(times) / 1e9, 1)
    del engine, host
    gc.collect()
    torch.cuda.empty_cache()
    return rec


def run_multiturn(out: str | None, name: str = "W4") -> list[dict]:
    """W4: bench/multiturn.py's engine environment loop vs the turn-synchronous loops: concurrent calls, TRL 1.16's
    own (one conversation's calls after another's), no prefix cache (it prints the lines)."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(__file__))), "bench", "multiturn.py")
    spec = importlib.util.spec_from_file_location("bench_multiturn", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    lengths = "geometric" if name == "W4-geo" else "fixed"
    return module.run(False, ["env_loop", "turn_sync", "turn_sync_trl", "turn_sync_nocache"], out, turn_lengths=lengths)


def _commit() -> str:
    """$COMMIT first: the GPU machine's copy of the tree may carry a stale .git."""
    if os.environ.get("COMMIT"):
        return os.environ["COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(__file__)).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def emit(record: dict, out: str | None) -> None:
    """One run's JSON line on stdout, and appended to ``out`` (``--out``) when given."""
    line = json.dumps(record)
    print(line, flush=True)
    if out:
        with open(out, "a") as f:
            f.write(line + "\n")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", default="W1-short", help=f"comma list of {sorted(WORKLOADS) + list(MULTITURN)}")
    p.add_argument("--modes", default="async,sync")
    p.add_argument("--compare-hf", action="store_true")
    p.add_argument("--hf-modes", default="sync_graph", help="HF modes to run (its best measured: sync_graph)")
    p.add_argument("--sampling", choices=sorted(SAMPLING), default=None,
                   help="greedy | t1 (temperature 1, seeded) | t1p95 (plus top_p 0.95); default: W2 t1, others greedy")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--new", type=int, default=None, help="override new tokens (smoke runs)")
    p.add_argument("--weight-push", action="store_true", help="also time update_weights of the workload's model")
    p.add_argument("--kv-cache-dtype", default="auto",
                   help="comma list of auto, bfloat16, float16, float32, fp8; the first is the main run, the others "
                        "repeat --modes and carry vs_first_kv (tok/s over the first's, same mode, budget, "
                        "preemption); fp8 runs carry fp8_vs_bf16 when auto or bfloat16 ran too")
    p.add_argument("--kv-budget-frac", dest="kv_budget_fracs", type=parse_budget_fracs, default=None, metavar="F[,F]",
                   help="size the KV cache (explicit num_blocks) to F x the bf16 bytes of the blocks the workload "
                        "needs with every sequence at full length; fp8 gets the same bytes (~2x the blocks). "
                        "F in (0, 1]; a comma list runs each. Default: room for everything")
    p.add_argument("--preemption", dest="preemptions", type=parse_preemptions, default=None, metavar="MODE[,MODE]",
                   help="swap (a host pool for the KV the budget leaves out) and/or recompute (no pool); each "
                        "runs every KV dtype, swap runs carry swap_vs_recompute. Needs --kv-budget-frac")
    p.add_argument("--logprob-check", type=int, default=0, metavar="N",
                   help="teacher-force the first N completions through HF's bf16 model: mean |dlogprob|")
    p.add_argument("--push-mid-run", action="store_true",
                   help="also run the workload (async) with one update_weights mid-run, recompute_running=True "
                        "and False; extra_wall_s is against the plain async run")
    p.add_argument("--block-size", type=int, default=None, help="engine block_size (default: EngineConfig's, 16); "
                   "128 is FA4's TMA page, where attention_backend auto picks fa4")
    p.add_argument("--attention-backend", default="auto", help="auto | triton | fa4 | flash_attn | torch")
    p.add_argument("--compare-legacy", action="store_true",  # live, legacy, live again (run="repeat")
                   help="also run each mode with the previous decode split (fixed chunks per batch size, "
                        "choose_num_splits) instead of chunks balanced over the live lengths; the balanced record "
                        "carries vs_legacy")
    p.add_argument("--decode-knobs", default="", metavar="NAME=INT[,...]",
                   help="set the decode path's tuning constants (the decode kernels', PDL, the projections' GEMM) for "
                        "the whole run (A/B of a change "
                        f"that is off by default): {', '.join(DECODE_KNOBS)}; every record carries decode_knobs")
    p.add_argument("--gemm-autotune", action="store_true",
                   help="engine gemm_autotune: before each decode graph size's first capture, time the projections' "
                        "GEMM methods (cuBLAS, its transposed product, the split-K Triton GEMM) and keep the fastest; "
                        "records carry gemm_picks")
    p.add_argument("--out", default=None)
    return p


DECODE_KNOBS = ("V_PAGES", "FUSED_MERGE", "DECODE_WAVES", "MIN_CHUNK_TILES", "PROGRAMS_PER_SM", "FP8_DECODE_MAXNREG",
                "EVEN_FIXED_SPLIT", "FUSED_ROPE", "FP8_PROGRAMS_PER_SM", "EVEN_WAVES", "EVEN_MAX_SPLITS",
                "EVEN_MIN_CHUNK_TILES", "EVEN_MIN_ROWS", "FP8_EVEN_MIN_CHUNK_TILES",
                "UNIFORM_ONE_WAVE", "STREAM_K", "STREAM_K_FP8", "STREAM_WAVES", "STREAM_PROGRAMS_PER_SM",
                "STREAM_MAXNREG", "STREAM_BLOCK_N", "STREAM_WARPS", "STREAM_SEGS", "PDL", "GEMM_SWAP_ROWS",
                "SKINNY_GEMM_ROWS")


def parse_decode_knobs(text: str) -> dict[str, int]:
    """``NAME=INT,...`` -> {NAME: INT}; names from DECODE_KNOBS only."""
    knobs: dict[str, int] = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        name, sep, value = item.partition("=")
        if not sep or name not in DECODE_KNOBS:
            raise ValueError(f"--decode-knobs item {item!r}: expected NAME=INT with NAME one of {DECODE_KNOBS}")
        try:
            knobs[name] = int(value)
        except ValueError:
            raise ValueError(f"--decode-knobs {name}={value!r}: the value must be an integer") from None
    return knobs


def apply_decode_knobs(knobs: dict[str, int]) -> None:
    """Set each knob's module constant (rollout.kernels.knobs.knob_module: the decode kernels', PDL's; read at each
    call, so engines built later use them). The GEMM knobs are per layer: ``gemm_tune.route_knobs`` on each engine."""
    from rollout.layers.triton_backend import TritonAttentionBackend

    for name, value in knobs.items():
        if name in ROUTE_KNOBS:
            continue
        if name == "FUSED_ROPE":  # the Triton backends' rotary fused with the K/V store (its class attribute)
            TritonAttentionBackend.fuses_rope = bool(value)
            continue
        mod = knob_module(name)
        setattr(mod, name, bool(value) if isinstance(getattr(mod, name), bool) else value)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    names = args.workload.split(",")
    unknown = [n for n in names if n not in WORKLOADS and n not in MULTITURN]
    if unknown:
        p.error(f"unknown --workload {unknown}; allowed: {sorted(WORKLOADS) + list(MULTITURN)}")
    if args.preemptions and not args.kv_budget_fracs:
        p.error("--preemption compares preemption under a KV budget: give --kv-budget-frac too (e.g. 0.3)")
    try:
        args.decode_knobs = parse_decode_knobs(args.decode_knobs)
    except ValueError as e:
        p.error(str(e))
    if args.kv_budget_fracs and any(n in MULTITURN for n in names):
        p.error(f"--kv-budget-frac and --preemption apply to {sorted(WORKLOADS)}, not {list(MULTITURN)}")
    args.kv_cache_dtypes = args.kv_cache_dtype.split(",")
    args.kv_cache_dtype, args.kv_budget_frac, args.preemption = configs_of(args)[0]
    return args


def main() -> None:
    args = parse_args()
    configs = configs_of(args)
    if not torch.cuda.is_available():
        sys.exit("bench.py needs a CUDA GPU")
    apply_decode_knobs(args.decode_knobs)
    bw = copy_bandwidth_tbps()
    peak = matmul_peak_tflops()
    print(f"copy bandwidth {bw:.2f} TB/s, bf16 GEMM peak {peak:.0f} TFLOP/s", flush=True)
    models: dict[str, torch.nn.Module] = {}
    for name in args.workload.split(","):
        if name in MULTITURN:
            run_multiturn(args.out, name)
            continue
        w = dict(WORKLOADS[name])
        if args.new:
            w["new"] = args.new
        if w["preset"] not in models:
            models.clear()
            gc.collect()
            torch.cuda.empty_cache()
            models[w["preset"]] = build_hf(w["preset"])
        hf = models[w["preset"]]
        recs = [run_ours(name, w, hf, mode, bw, args, peak=peak) for mode in args.modes.split(",") if mode]
        firsts = list(recs)
        if len(recs) == 2 and recs[1]["mode"] == "sync":
            recs[0]["vs_sync"] = round(recs[0]["tok_s"] / recs[1]["tok_s"], 3)
            recs[0]["peak_mem_over_sync_gib"] = round(recs[0]["peak_mem_gib"] - recs[1]["peak_mem_gib"], 2)
        if args.compare_hf:
            hf_res = run_hf(hf, w, args.hf_modes.split(","))
            best = max((r["tok_s"] for r in hf_res.values() if "tok_s" in r), default=None)
            for r in recs:
                r["hf"] = hf_res
                r["vs_hf"] = round(r["tok_s"] / best, 3) if best else None
        if args.weight_push:
            recs.append(run_weight_push(hf, w["preset"]))
        for config in configs[1:]:
            for first in firsts:
                recs.append(run_ours(name, w, hf, first["mode"], bw, with_config(args, *config), peak=peak))
        if args.compare_legacy:
            legacy = argparse.Namespace(**{**vars(args), "decode_split": "legacy"})
            for first in firsts:
                r = run_ours(name, w, hf, first["mode"], bw, legacy, peak=peak)
                first["vs_legacy"] = round(first["tok_s"] / r["tok_s"], 3)
                first["decode_compute_vs_legacy"] = round(
                    r["mean_decode_compute_ms"] / first["mean_decode_compute_ms"], 3)
                recs.append(r)
                # The live split once more, now after another engine as the legacy one ran: the first engine of a
                # process paid slower prefill steps at 0b958d9 (W1-short's one prefill-only step too, which the
                # split never touches), so the repeat is the order-fair comparison.
                again = run_ours(name, w, hf, first["mode"], bw, args, peak=peak)
                again.update(run="repeat", vs_legacy=round(again["tok_s"] / r["tok_s"], 3),
                             decode_compute_vs_legacy=round(
                                 r["mean_decode_compute_ms"] / again["mean_decode_compute_ms"], 3))
                recs.append(again)
        if args.push_mid_run:
            base = next((r for r in recs if r.get("mode") == "async" and "push_ms" not in r), None)
            for recompute in (True, False):
                r = run_ours(name, w, hf, "async", bw, args, push=recompute, peak=peak)
                if base is not None:
                    r["extra_wall_s"] = round(r["wall_s"] - base["wall_s"], 3)
                    r["extra_prefill_compute_s"] = round(r["prefill_compute_s"] - base["prefill_compute_s"], 3)
                recs.append(r)
        summary = config_ratios(recs, args.kv_cache_dtypes[0])
        for r in recs:
            if args.decode_knobs:
                r["decode_knobs"] = args.decode_knobs
            emit(r, args.out)
        if len(configs) > 1:
            print("\n".join(summary), flush=True)


if __name__ == "__main__":
    main()
