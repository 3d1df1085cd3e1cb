"""Tensor-parallel bars on a two-GPU machine (issue 16): one JSON line per run.

    python scripts/bench_tp.py --bar parity   --out bench/results/tp_h200x2.jsonl  # qwen3-0.6b fp32, 256 x 512
    python scripts/bench_tp.py --bar w1-short --out bench/results/tp_h200x2.jsonl  # llama3-8b bf16, TP=2 vs TP=1
    python scripts/bench_tp.py --bar 70b      --out bench/results/tp_h200x2.jsonl  # llama3-70b shape, 32 x 128 -> 2048
    python scripts/bench_tp.py --bar w1-short --tp 2 --tp-all-reduce symm_mem ...     # A/B: the opt-in all-reduce

Weights are random (seeded per tensor name) and made on the GPU one tensor at a time as the engine
asks for them, so TP=1 and TP=2 get identical weights and a 70B-shaped model never exists whole on
one GPU. ``mean_decode_compute_ms`` is rank 0's compute-stream time per decode step (it includes
waiting in the all-reduces for rank 1); ``gpu_busy_frac_rank1`` is the worker's own compute time
over the same wall. ``floor_ratio``: weights + live KV one rank must read per decode step over the
copy bandwidth, divided by that step time. ``--tp-all-reduce symm_mem`` runs the TP > 1 engines with the
opt-in symmetric-memory all-reduce (one such engine per process: PyTorch counts its rendezvous per process).
Each record is appended to ``--out`` as soon as it is made, so a run cut by a timeout keeps what finished.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import importlib.util
import json
import os
import sys
import time
import zlib

import torch

# Python puts this directory first on sys.path, where scripts/rollout.py would shadow the `rollout` package
# (which comes from the install or PYTHONPATH).
sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.curdir) != os.path.dirname(os.path.realpath(__file__))]

from rollout import Engine, SamplingParams  # noqa: E402
from rollout.config import TP_ALL_REDUCE  # noqa: E402

_spec = importlib.util.spec_from_file_location("bench", os.path.join(os.path.dirname(__file__), "bench.py"))
bench = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
_spec.loader.exec_module(bench)  # type: ignore[union-attr]

PRESETS = {**bench.PRESETS, "llama3-70b": ("llama", dict(
    hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
    vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0))}
BARS = {
    "parity": dict(preset="qwen3-0.6b", prompts=256, prompt_len=128, new=512, dtype="float32", tp=(1, 2)),
    "w1-short": dict(preset="llama3-8b", prompts=32, prompt_len=128, new=1024, dtype="bfloat16", tp=(1, 2)),
    "70b": dict(preset="llama3-70b", prompts=32, prompt_len=128, new=2048, dtype="bfloat16", tp=(2,)),
}


class RandomWeights:
    """Stands in for a PreTrainedModel: a config, and named_parameters() making each tensor when asked."""

    def __init__(self, preset: str, dtype: torch.dtype) -> None:
        from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

        family, kw = PRESETS[preset]
        self.config = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[family](**kw)
        with torch.device("meta"):
            meta = AutoModelForCausalLM.from_config(self.config)
        self.shapes = [(n, tuple(p.shape)) for n, p in meta.named_parameters()]
        self.dtype = dtype

    def named_parameters(self):
        for name, shape in self.shapes:
            if name.endswith("norm.weight"):
                yield name, torch.ones(shape, dtype=self.dtype, device="cuda")
            elif name.endswith(".bias"):
                yield name, torch.zeros(shape, dtype=self.dtype, device="cuda")
            else:
                g = torch.Generator("cuda").manual_seed(zlib.crc32(name.encode()))
                yield name, torch.empty(shape, dtype=self.dtype, device="cuda").normal_(0.0, 0.02, generator=g)


def run(bar: dict, tp: int, source: RandomWeights, bw: float, max_num_seqs: int,
        tp_all_reduce: str = "nccl") -> tuple[dict, list]:
    w = dict(prompts=bar["prompts"], prompt_len=bar["prompt_len"], new=bar["new"])
    prompts, params = bench.make_prompts(w, source.config.vocab_size)
    blocks = int(len(prompts) * -(-(w["prompt_len"] + w["new"]) // 16) * 1.1) + 64
    all_reduce = tp_all_reduce if tp > 1 else "nccl"  # one rank has nothing to all-reduce
    engine = Engine.from_pretrained(source, dtype=bar["dtype"], tensor_parallel_size=tp, num_blocks=blocks,
                                    max_model_len=w["prompt_len"] + w["new"] + 16, max_num_seqs=max_num_seqs,
                                    tp_all_reduce=all_reduce)
    runner = getattr(engine.runner, "inner", engine.runner)
    warm = [[1] * 8] * min(len(prompts), max_num_seqs)
    for b in sorted(runner.graph_sizes, reverse=True):  # capture every decode graph before timing
        if b <= len(warm):
            engine.generate(warm[:b], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    rank1_before = engine.workers.call("compute_seconds")[0] if engine.workers else None
    runner.clock.records.clear()
    runner.clock.record_steps = True
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    rank1 = engine.workers.call("compute_seconds")[0] - rank1_before if engine.workers else None
    recs = runner.clock.records
    dec = [r for r in recs if r.decode]
    m = engine.model
    kv_token_bytes = 2 * m.num_layers * m.num_kv_heads * m.head_dim * engine.dtype.itemsize  # this rank's heads
    floor_s = sum((m.weight_bytes_per_step() + r.kv_tokens * kv_token_bytes) / (bw * 1e12) for r in dec)
    dec_s = sum(r.compute_ms for r in dec) / 1e3
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    rec = dict(
        bar=bar["name"], preset=bar["preset"], dtype=bar["dtype"], tensor_parallel_size=tp, tp_all_reduce=all_reduce,
        prompts=len(prompts),
        new_tokens=w["new"], timestamp=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        wall_s=round(wall, 3), generated_tokens=tokens, tok_s=round(tokens / wall, 1), steps=len(recs),
        decode_steps=len(dec), mean_step_ms=round(wall / max(1, len(recs)) * 1e3, 3),
        mean_decode_compute_ms=round(dec_s / max(1, len(dec)) * 1e3, 3),
        gpu_busy_frac=round(sum(r.compute_ms for r in recs) / 1e3 / wall, 4),
        gpu_busy_frac_rank1=round(rank1 / wall, 4) if rank1 is not None else None,
        floor_ms=round(floor_s / max(1, len(dec)) * 1e3, 3), floor_ratio=round(floor_s / dec_s, 4) if dec_s else None,
        peak_mem_gib_rank0=round(torch.cuda.max_memory_allocated() / 2**30, 2), copy_bw_tbps=round(bw, 3),
        device=f"{torch.cuda.device_count()} x {torch.cuda.get_device_name()}", commit=bench._commit(),
    )
    result = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]
    if engine.workers is not None:
        engine.workers.shutdown()
    del engine, runner, outs
    gc.collect()
    torch.cuda.empty_cache()
    return rec, result


def compare(one: list, two: list) -> dict:
    """Greedy tokens of TP=2 vs TP=1: identical sequences, and where not, how close the call was."""
    same, lp_diff, first_diffs, tie_gaps = 0, 0.0, [], []
    for (t1, l1), (t2, l2) in zip(one, two):
        k = next((i for i, (a, b) in enumerate(zip(t1, t2)) if a != b), len(t1))
        same += k == len(t1) == len(t2)
        if k:
            lp_diff = max(lp_diff, max(abs(a - b) for a, b in zip(l1[:k], l2[:k])))
        if k < len(t1):
            first_diffs.append(k)
            tie_gaps.append(abs(l1[k] - l2[k]))  # a near-tie: both picks nearly equally likely
    return dict(identical_seqs=same, seqs=len(one), max_logprob_diff=lp_diff, first_divergence=first_diffs[:16],
                divergence_logprob_gap=[round(g, 8) for g in tie_gaps[:16]])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bar", choices=sorted(BARS), required=True)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--tp", type=int, nargs="+", default=None,
                   help="only these of the bar's tensor_parallel_size runs (e.g. --tp 2 skips TP=1)")
    p.add_argument("--tp-all-reduce", choices=TP_ALL_REDUCE, default="nccl",
                   help="the TP > 1 engines' all-reduce (symm_mem: opt-in, unverified on GPUs)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    bar = {**BARS[args.bar], "name": args.bar}
    tps = [tp for tp in bar["tp"] if args.tp is None or tp in args.tp]
    if not tps:
        p.error(f"--tp {args.tp}: bar {args.bar} runs tensor_parallel_size {bar['tp']}")

    def emit(rec: dict) -> None:
        print(json.dumps(rec), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(rec) + "\n")

    bw = bench.copy_bandwidth_tbps()
    source = RandomWeights(bar["preset"], getattr(torch, bar["dtype"]))
    recs, results = [], {}
    for tp in tps:
        rec, results[tp] = run(bar, tp, source, bw, args.max_num_seqs, args.tp_all_reduce)
        recs.append(rec)
        emit(rec)
    if len(results) == 2:
        emit(dict(bar=args.bar, kind="tp2_vs_tp1", tp_all_reduce=args.tp_all_reduce,
                  **compare(results[1], results[2]),
                  step_ratio_decode_compute=round(recs[1]["mean_decode_compute_ms"]
                                                  / recs[0]["mean_decode_compute_ms"], 4),
                  step_ratio_wall=round(recs[1]["mean_step_ms"] / recs[0]["mean_step_ms"], 4)))


if __name__ == "__main__":
    main()
