"""A CPU estimate of ``scripts/bench.py --kv-budget-frac`` runs (issue 23.5): the real scheduler and block
manager, fake samples, and a rough H200 step-time model, to size a memory-bound workload and predict its
preemptions, swaps, recompute and wall time before the GPU run. No GPU, no model.

    PYTHONPATH=$PWD python bench/membound_sim.py --workload W2-mem --kv-cache-dtype auto,fp8 \\
        --kv-budget-frac 0.3 --preemption swap,recompute

The step-time model (qwen2.5-1.5b on one H200; rough, only for sizing; the GPU run is the measurement):
``fixed_ms`` (weights read + small kernels + launch) + ``per_seq_ms`` x batch (the GEMMs turn compute-bound)
+ live KV bytes / the decode kernel's bandwidth (bf16 3.7 TB/s, fp8 2.0 TB/s: docs/benchmarks.md's kernel
runs) + ``prefill_ms_per_token`` x tokens computed that are not a decode (prompts, recompute) + swapped bytes /
``pcie_gbps``. Samples are distinct per (sequence, position), so recomputed blocks never hit the prefix cache
by accident.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import sys
from pathlib import Path

from rollout.engine.block_manager import BlockManager
from rollout.engine.plan import SampleResult
from rollout.engine.scheduler import Scheduler, SchedulerLimits
from rollout.engine.sequence import Request, Sequence

ROOT = Path(__file__).resolve().parent.parent
MODEL = dict(fixed_ms=1.2, per_seq_ms=0.004, prefill_ms_per_token=0.008, pcie_gbps=25.0)
KV_BW_TBPS = {"auto": 3.7, "bfloat16": 3.7, "float16": 3.7, "float32": 3.7, "fp8": 2.0}


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_script_sim", ROOT / "scripts" / "bench.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def simulate(w: dict, params: list, num_blocks: int, num_host_blocks: int, block_bytes: int, kv: str,
             max_num_seqs: int = 256, max_num_batched_tokens: int = 8192, block_size: int = 16,
             max_steps: int = 10**6, on_step=None) -> dict:
    """Run the workload's requests through the scheduler to the end; model each step's time. ``on_step``: called
    with every step's plan before its samples are applied (bench/w2_lengths.py reads the live lengths)."""
    bm = BlockManager(num_blocks, block_size, num_host_blocks=num_host_blocks)
    sched = Scheduler(SchedulerLimits(max_num_seqs, max_num_batched_tokens), bm)
    ids = itertools.count()
    for r, sp in enumerate(params):
        prompt = [100 + (r * 7919 + i * 104729) % 100000 for i in range(w["prompt_len"])]
        seqs: list[Sequence] = []
        for i in range(sp.n):
            seqs.append(Sequence(next(ids), f"r{r}", i, list(prompt), len(prompt), sp, r,
                                 parent=seqs[0] if seqs else None))
        sched.add(Request(f"r{r}", list(prompt), sp, seqs))
    token_bytes = block_bytes / block_size
    bw = KV_BW_TBPS[kv] * 1e12
    wall = steps = prefill = generated = 0
    max_batch = max_used = 0
    while sched.has_unfinished():
        plan = sched.schedule()
        if plan is None or steps >= max_steps:
            break
        steps += 1
        if on_step is not None:
            on_step(plan)
        batch = len(plan.seqs)
        max_batch = max(max_batch, batch)
        max_used = max(max_used, num_blocks - bm.num_free_blocks)
        computed = sum(len(s.input_ids) for s in plan.seqs)
        decodes = sum(len(s.input_ids) == 1 for s in plan.seqs)
        prefill += computed - decodes
        swap_bytes = (len(plan.swap_out) + len(plan.swap_in)) * block_bytes
        wall += (MODEL["fixed_ms"] + MODEL["per_seq_ms"] * batch + plan.num_context_tokens * token_bytes / bw * 1e3
                 + MODEL["prefill_ms_per_token"] * (computed - decodes) + swap_bytes / (MODEL["pcie_gbps"] * 1e6))
        toks = [(s.seq_id * 1_000_003 + s.sample_pos * 7919) % 150000 + 100 for s in plan.sample_seqs]
        generated += len(toks)
        sched.update_from_output(plan, SampleResult(plan.step_id, toks, [-1.0] * len(toks)))
    return dict(steps=steps, generated_tokens=generated, est_wall_s=round(wall / 1e3, 1),
                est_tok_s=round(generated / max(wall / 1e3, 1e-9)), preemptions=sched.num_preemptions,
                swap_outs=sched.num_swap_outs, swap_ins=sched.num_swap_ins, prefill_tokens=prefill,
                max_batch=max_batch, max_used_blocks=max_used,
                mean_batch=round(generated / max(1, steps), 1), finished=not sched.has_unfinished())


def main() -> None:
    bench = load_bench()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", default="W2-mem")
    p.add_argument("--kv-cache-dtype", default="auto,fp8")
    p.add_argument("--kv-budget-frac", type=bench.parse_budget_fracs, default=[0.3])
    p.add_argument("--preemption", type=bench.parse_preemptions, default=["swap", "recompute"])
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--prompts", type=int, default=None, help="override the workload's prompts (sizing)")
    p.add_argument("--new", type=int, default=None, help="override the workload's new tokens (sizing)")
    p.add_argument("--min-new", type=int, default=None, help="override the workload's shortest length (sizing)")
    args = p.parse_args()
    w = dict(bench.WORKLOADS[args.workload])
    w.update({k: v for k, v in (("prompts", args.prompts), ("new", args.new), ("min_new", args.min_new)) if v})
    _, params = bench.make_prompts(w, bench.PRESETS[w["preset"]][1]["vocab_size"], "t1")
    bs = 16
    need = bench.kv_need_blocks(w["prompt_len"], params, bs)
    print(f"{args.workload} {w}: need {need} blocks, {sum(p.n * p.max_tokens for p in params)} tokens to generate",
          flush=True)
    for frac in args.kv_budget_frac:
        for pre in args.preemption:
            for kv in args.kv_cache_dtype.split(","):
                blocks, nbytes = bench.kv_budget(need, frac, w["preset"], kv, bs)
                block_bytes = bench.kv_block_bytes(w["preset"], kv, bs)
                pool_gib = bench.swap_space_gib(need, blocks, block_bytes) if pre == "swap" else 0.0
                host = int(pool_gib * 2**30) // block_bytes
                rec = simulate(w, params, blocks, host, block_bytes, kv, args.max_num_seqs)
                print(json.dumps(dict(workload=args.workload, kv_cache_dtype=kv, kv_budget_frac=frac, preemption=pre,
                                      num_blocks=blocks, kv_gib=round(nbytes / 2**30, 2), **rec)), flush=True)


if __name__ == "__main__":
    main()
