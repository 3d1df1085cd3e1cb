"""Partial vs drain rollouts through the actor on W2-shaped lengths (issue 14's bar): one JSON line per mode.

    python bench/partial_rollout.py --modes drain,partial --out bench/results/partial_w2.jsonl     # H200
    python bench/partial_rollout.py --preset tiny --prompts 4 --n 2 --new 48 --rounds 3 --prompt-len 64  # CPU

W2's shape: qwen2.5-1.5b (random init, bf16), 512-token prompts, ``--prompts`` groups of ``--n`` handed
out per round, each group's length log-uniform in [256, --new] (fixed per group: ignore_eos), and a push of
the same weights under a new version between rounds. Reported: generated tokens/s over the whole run
(engine count: carried-over tokens once), handed-out tokens/s, each round's mean batch over
``max_num_seqs`` (issue 23's bar: >= 0.9 in every round for partial) and tail batch, whether every row's
per-token versions are consistent with the pushes (non-decreasing, each a pushed version, drain: one), and per
round the engine's tokens generated and prefilled (a push's recompute), GPU compute seconds and byte floor.
Needs no hydra, wandb or datasets (the GPU machine has none).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import importlib.util
import math
import random
import sys
import time
from pathlib import Path
from types import ModuleType

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rollout import Engine, SamplingParams  # noqa: E402
from rollout.job.data import PromptDataset  # noqa: E402
from rollout.job.rounds import RoundDriver  # noqa: E402
from rollout.layers.gemm_tune import route_knobs  # noqa: E402


class Rows:
    """Just enough of a `datasets.Dataset` for PromptDataset: token-id prompts."""

    column_names = ["prompt"]

    def __init__(self, prompts: list[list[int]]) -> None:
        self.prompts = prompts

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, i: int) -> dict:
        return {"prompt": self.prompts[i]}


class LongTailActor(RoundDriver):
    """Each group's max_tokens is log-uniform in [lo, new], fixed by its stream position (W2's tail)."""

    lo, new = 256, 16384

    def _params(self, r: int, group: int) -> SamplingParams:
        rng = random.Random(group)
        k = int(min(self.new, math.exp(rng.uniform(math.log(self.lo), math.log(self.new)))))
        return dataclasses.replace(super()._params(r, group), max_tokens=k)


def build_model(preset: str) -> torch.nn.Module:
    if preset == "tiny":
        from transformers import AutoModelForCausalLM

        from rollout.assets import materialize_default_model

        return AutoModelForCausalLM.from_pretrained(materialize_default_model(), dtype=torch.float32)
    return load_bench().build_hf(preset)


def load_bench() -> ModuleType:
    """scripts/bench.py: its presets, model builder and JSON-line output."""
    spec = importlib.util.spec_from_file_location("bench_main", ROOT / "scripts" / "bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def run(mode: str, hf: torch.nn.Module, args: argparse.Namespace) -> dict:
    cuda = torch.cuda.is_available() and args.preset != "tiny"
    vocab = hf.config.vocab_size
    g = torch.Generator().manual_seed(1)
    total_groups = args.prompts * (args.rounds + 2)
    prompts = [torch.randint(100, vocab - 100, (args.prompt_len,), generator=g).tolist() for _ in range(total_groups)]
    engine = Engine.from_pretrained(
        hf, dtype="bfloat16" if cuda else "float32", device="cuda" if cuda else "cpu",
        max_model_len=args.prompt_len + args.new + 16, max_num_seqs=args.max_num_seqs,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    route_knobs(engine.model, args.decode_knobs or {})  # GEMM_SWAP_ROWS / SKINNY_GEMM_ROWS are per layer
    # Warm-up in the run's sampling: every decode graph size, with even lengths and with one long context (the
    # decode kernel's two split kinds), so no capture lands inside a timed round.
    warm, long = [[1] * 8] * args.max_num_seqs, [1] * 64
    engine.generate(warm[:64], SamplingParams(max_tokens=3, ignore_eos=True))
    for b in sorted(getattr(engine.runner, "graph_sizes", []) or [], reverse=True):
        engine.generate(warm[:b], SamplingParams(max_tokens=3, ignore_eos=True))
        if b >= 3:
            engine.generate(warm[: b - 1] + [long], SamplingParams(max_tokens=3, ignore_eos=True))
    LongTailActor.lo, LongTailActor.new = max(1, min(256, args.new // 16)), args.new
    actor = LongTailActor(
        engine, PromptDataset(Rows(prompts), None, "prompt", None), SamplingParams(n=args.n, ignore_eos=True),
        args.prompts, seed=0, mode=mode, recompute_running=not args.keep_kv,
        max_inflight_groups=(args.inflight or None) if mode == "partial" else None,
    )
    bw = load_bench().copy_bandwidth_tbps() if cuda else None
    gen0, pushes, rounds, versions_ok = engine.get_stats().num_generated_tokens, [0], [], True
    counters = [engine_counters(engine)]
    t0 = time.perf_counter()
    for r in range(args.rounds):
        res = actor.run_round()
        counters.append(engine_counters(engine))
        for t in res.trajectories:
            v = t.policy_versions
            versions_ok &= v == sorted(v) and set(v) <= set(pushes) and (mode == "partial" or set(v) <= {r})
        rounds.append(res.metrics)
        m = res.metrics  # one line per round as it ends: a run cut off by its time limit still tells its rounds
        print(f"{mode} round {r + 1}/{args.rounds}: {m['round_time_s']:.2f} s, handed out {m['completion_tokens']} "
              f"tokens, occupancy {m['mean_batch_size'] / args.max_num_seqs:.3f}, carried over "
              f"{m['carried_over_tokens']}", file=sys.stderr, flush=True)
        if r + 1 == args.rounds:
            break
        if out_of_time(time.monotonic(), args.deadline, [x["round_time_s"] for x in rounds]):
            print(f"{mode}: stopping after {r + 1} rounds: another would end past --time-budget-s",
                  file=sys.stderr, flush=True)
            break
        t_push = time.perf_counter()
        pushes.append(actor.update_weights(hf.named_parameters()))
        rounds[-1]["push_after_s"] = time.perf_counter() - t_push
    if cuda:
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    generated = engine.get_stats().num_generated_tokens - gen0
    handed = sum(m["completion_tokens"] for m in rounds)
    occupancy = [m["mean_batch_size"] / args.max_num_seqs for m in rounds]
    steady = steady_state(rounds, args.warmup_rounds)
    return dict(
        workload="W2-actor", timestamp=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), mode=mode,
        preset=args.preset, prompts=args.prompts, n=args.n, new_tokens=args.new, rounds=len(rounds),
        rounds_asked=args.rounds,
        recompute_running=not args.keep_kv, kv_cache_dtype=args.kv_cache_dtype,
        **({"decode_knobs": args.decode_knobs} if args.decode_knobs else {}), wall_s=round(wall, 3),
        generated_tokens=generated,
        tok_s=round(generated / wall, 1), handed_out_tokens=handed, handed_out_tok_s=round(handed / wall, 1),
        round_time_s=[round(m["round_time_s"], 2) for m in rounds],
        handed_out_tokens_per_round=[m["completion_tokens"] for m in rounds],
        push_s=[round(m["push_after_s"], 3) for m in rounds if "push_after_s" in m], **steady,
        mean_batch_over_max_num_seqs=[round(x, 3) for x in occupancy], min_occupancy=round(min(occupancy), 3),
        tail_batch_size=[round(m["tail_batch_size"], 1) for m in rounds],
        carried_over_tokens=[m["carried_over_tokens"] for m in rounds],
        staleness_hist=[m["staleness_hist"] for m in rounds], versions_consistent=bool(versions_ok),
        **per_round_counters(counters, bw), copy_bw_tbps=bw,
        max_num_seqs=args.max_num_seqs, device=torch.cuda.get_device_name() if cuda else "cpu", commit=_commit(),
    )


def engine_counters(engine: Engine) -> dict:
    """The engine's cumulative counters a round's deltas come from (a push's recompute lands in the next round)."""
    s = engine.get_stats()
    return dict(generated=s.num_generated_tokens, prefill=s.num_prefill_tokens, bytes=s.bytes_read,
                compute_s=s.gpu_compute_s or 0.0)


def per_round_counters(counters: list[dict], bw_tbps: float | None) -> dict:
    """Per round: tokens generated, tokens prefilled (prompts, and after a push with recompute the in-flight
    sequences' contexts), GPU compute seconds, and the byte floor (what the steps had to read over the copy
    bandwidth). Where handed-out tokens/s stalls although occupancy is full, these tell whether the steps sit at
    their floor (long contexts read at full batch) or the recompute is what costs."""
    d = [{k: b[k] - a[k] for k in a} for a, b in zip(counters, counters[1:])]
    out = dict(generated_tokens_per_round=[x["generated"] for x in d],
               prefill_tokens_per_round=[x["prefill"] for x in d],
               gpu_compute_s_per_round=[round(x["compute_s"], 2) for x in d])
    if bw_tbps:
        out["floor_s_per_round"] = [round(x["bytes"] / (bw_tbps * 1e12), 2) for x in d]
    return out


def out_of_time(now: float, deadline: float | None, round_times: list[float]) -> bool:
    """Whether a next round, as long as the longest so far, would end past ``deadline`` (None: no budget). A
    device call has a hard limit; stopping between rounds keeps the record of the rounds that did run."""
    return deadline is not None and bool(round_times) and now + max(round_times) > deadline


def steady_state(rounds: list[dict], warmup: int) -> dict:
    """Handed-out tokens/s over the rounds after the first ``warmup``, each with the push before it. A partial
    run starts with nothing carried over and ends holding its in-flight groups' tokens, so over a few rounds its
    handed-out rate trails what it hands out once the pipeline is full (the carry-over at each round's end shows
    when it stops growing); a drain round has no such transient. Empty when no round is left after the warm-up."""
    later = rounds[warmup:]
    if warmup <= 0 or not later:
        return {}
    # each steady round is charged the weight push before it (a push's recompute is the price of partial mode)
    secs = sum(m["round_time_s"] for m in later) + sum(m.get("push_after_s", 0.0) for m in rounds[warmup - 1:-1])
    tokens = sum(m["completion_tokens"] for m in later)
    return dict(warmup_rounds=warmup, steady_handed_out_tokens=tokens, steady_wall_s=round(secs, 3),
                steady_handed_out_tok_s=round(tokens / secs, 1))


def _commit() -> str:
    """scripts/bench.py's: $COMMIT first (the GPU machine's copy of the tree may carry a stale .git), then git."""
    return load_bench()._commit()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen2.5-1.5b")
    p.add_argument("--modes", default="drain,partial")
    p.add_argument("--prompts", type=int, default=64, help="groups handed out per round")
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--new", type=int, default=16384, help="the longest group's max_tokens")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--warmup-rounds", type=int, default=0,
                   help="also report the handed-out tokens/s of the rounds after these (partial's pipeline fill)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--inflight", type=int, default=0, help="partial: max_inflight_groups (0 = --prompts)")
    p.add_argument("--keep-kv", action="store_true", help="partial: recompute_running=False across pushes")
    p.add_argument("--time-budget-s", type=float, default=0.0,
                   help="all modes together: start no round that would end past this many seconds (0: no limit)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                   help="the engine's KV cache (both modes alike)")
    p.add_argument("--decode-knobs", default="", metavar="NAME=INT[,...]",
                   help="scripts/bench.py's --decode-knobs (the decode kernel's tuning constants), e.g. STREAM_K_FP8=1")
    p.add_argument("--out", default=None, help="append the JSON lines to this file")
    args = p.parse_args()
    if args.time_budget_s < 0:
        p.error(f"--time-budget-s must be >= 0 (0: no limit), got {args.time_budget_s}")
    args.deadline = time.monotonic() + args.time_budget_s if args.time_budget_s else None
    bench = load_bench()
    try:
        args.decode_knobs = bench.parse_decode_knobs(args.decode_knobs)
    except ValueError as e:
        p.error(str(e))
    bench.apply_decode_knobs(args.decode_knobs)
    hf, emit = build_model(args.preset), bench.emit
    for mode in [m for m in args.modes.split(",") if m]:
        emit(run(mode, hf, args), args.out)


if __name__ == "__main__":
    main()
