"""W4 (issue 22): multi-turn conversations through the engine's environment loop vs a turn-synchronous loop.

    python bench/multiturn.py --out bench/results/w4.jsonl          # H200: qwen3-0.6b shape, bf16
    python scripts/bench.py --workload W4 --out bench/results/w4.jsonl   # the same, from the bench script
    python bench/multiturn.py --tiny                                # CPU: a tiny model, seconds

256 conversations x 4 model turns x 256 generated tokens per turn (ignore_eos), 128-token prompts; after each
of the first three turns the environment sleeps a seeded 0-200 ms and replies 32-64 tokens. Two modes, in the
same run, each on a fresh engine:

- ``env_loop``: ``rollout.envs.EnvLoop``: each conversation's environment runs in a thread pool as soon as its
  turn ends while the others keep decoding, and its reply is appended to the same sequence (resident KV).
- ``turn_sync``: TRL's ``_tool_call_loop`` shape: a turn is generated for every conversation, every conversation
  waits for the slowest environment call of the turn, then all continue as new requests holding the whole
  conversation (re-prefilled, less what the prefix cache still holds).
- ``turn_sync_nocache``: the same with the prefix cache off (every turn re-prefills the whole conversation).
- ``turn_sync_trl``: ``turn_sync`` with the environment called the way TRL 1.16's ``_tool_call_loop`` calls
  tools: one conversation after another on the trainer's thread (``for idx in range(len(idxs_with_tool))``, a sync
  tool called in place, an async one awaited with ``.result()`` before the next conversation's), so a round waits
  for the *sum* of its calls, not the slowest. Prefix cache on (vLLM's default). ``turn_sync`` is the kinder
  model of the issue's text (all calls concurrent); the bar's ratio is reported against both.
- ``env_loop_hold<K>`` / ``env_loop_rows<K>``: the engine loop with ``engine.turn_prefill_hold_steps=K`` (replies
  wait up to K steps to be prefilled together) or ``engine.turn_rows_max_tokens=K`` (replies of up to K tokens
  computed as one-token decode rows, so the step stays a decode-graph replay); ``env_loop_rows<K>_burst`` also
  sets ``engine.max_num_rows`` to the conversations + K, so a reply beside a full batch goes in one step.

``--turn-lengths geometric`` (workload ``W4-geo``): a turn ends at a stop token instead of after exactly 256
tokens, as an agent's turns do: 1/256 of the vocabulary are stop ids, so on the random-init model (a nearly
uniform distribution) a turn's length is geometric with mean ~256, capped at 512. The turn-synchronous loop
then also waits for the longest turn of each round while its batch drains; the fixed form only lets the engine
loop win the tool waits (at most the three slowest sleeps, ~0.6 s of ~10 s: ~1.1x, docs/benchmarks.md).

``--tool-latency agentic`` (workload ``W4-tools``, or ``W4-geo-tools``): the environment calls take what an
agent's tools do (code execution, search: log-normal, median 0.5 s, p99 ~5 s, cap 8 s) instead of 0-200 ms.
The turn-synchronous loop then waits about the slowest of 256 calls (several seconds) after each round; the
engine loop lets each conversation wait only for its own.

Reported per mode: model tok/s (generated tokens / wall), GPU busy fraction (compute-stream time / wall; None on
the CPU), prefill tokens over (prompt + environment) tokens, and for env_loop ``vs_turn_sync`` and
``vs_turn_sync_nocache`` (tok/s ratios).
Needs only torch, transformers and the engine.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import datetime as dt
import gc
import json
import math
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rollout import Engine, SamplingParams  # noqa: E402
from rollout.envs import EnvLimits, EnvLoop, EnvSpec  # noqa: E402

W4 = dict(preset="qwen3-0.6b", conversations=256, turns=4, turn_tokens=256, prompt_len=128, reply=(32, 64),
          sleep_ms=(0, 200))
TINY = dict(preset="tiny", conversations=8, turns=3, turn_tokens=12, prompt_len=16, reply=(4, 8), sleep_ms=(0, 20))
QWEN3_06B = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                 max_position_embeddings=40960, rope_theta=1e6)
TINY_LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=1000, max_position_embeddings=512)


class SleepyEnv:
    """W4's environment (``step`` form): a seeded 0-200 ms sleep, then 32-64 random token ids as the reply
    (written as text of ids; ``IdsRenderer`` reads them back). The last turn gets no reply and no sleep."""

    def reset(self, **row) -> str | None:
        self.rng, self.turn, self.w = random.Random(row["seed"]), 0, row["w"]
        return None

    def step(self, completion_text: str) -> str | None:
        self.turn += 1
        if self.turn >= self.w["turns"]:
            return None
        return reply_text(self.rng, self.w)


# --tool-latency agentic: an agent's tools (code execution, search, a compiler) take from ~0.1 s to several
# seconds: log-normal, median 500 ms, sigma 1 (p90 ~1.8 s, p99 ~5 s), capped at 8 s. Tiny: a fiftieth of that.
AGENTIC_MS = dict(median=500.0, sigma=1.0, cap=8000.0)


def sleep_ms(rng: random.Random, w: dict) -> float:
    """One environment call's latency: W4's uniform 0-200 ms, or the agentic log-normal."""
    if w.get("tool_latency", "w4") == "agentic":
        a = w["agentic_ms"]
        return min(rng.lognormvariate(math.log(a["median"]), a["sigma"]), a["cap"])
    return rng.uniform(*w["sleep_ms"])


def reply_text(rng: random.Random, w: dict) -> str:
    time.sleep(sleep_ms(rng, w) / 1e3)
    n = rng.randint(*w["reply"])
    return " ".join(str(rng.randrange(100, w["vocab"] - 100)) for _ in range(n))


class IdsRenderer:
    """Prompts are token ids, replies are ids written as text: no tokenizer or chat template needed."""

    def prompt(self, prompt: list[int], reset_text: str | None) -> tuple[str, list[int]]:
        return "", list(prompt)

    def reply(self, messages: list[dict], last_model_token: int | None) -> list[int]:
        return [int(t) for t in messages[0]["content"].split()]

    def decode(self, ids: list[int]) -> str:
        return ""


def build_model(w: dict, device: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    cfg = LlamaConfig(**TINY_LLAMA) if w["preset"] == "tiny" else Qwen3Config(**QWEN3_06B)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    torch.manual_seed(0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()


def make_engine(hf: torch.nn.Module, w: dict, device: str, prefix_cache: bool = True, hold: int = 0,
                rows: int = 0, burst: bool = False) -> Engine:
    per_conv = w["prompt_len"] + w["turns"] * w["turn_tokens"] + (w["turns"] - 1) * w["reply"][1] + 16
    blocks = int(w["conversations"] * -(-per_conv // 16) * 1.1) + 64
    eng = Engine.from_pretrained(hf, dtype="float32" if device == "cpu" else "bfloat16", device=device,
                                 max_model_len=per_conv + 16, max_num_seqs=w["conversations"], num_blocks=blocks,
                                 block_size=16, enable_prefix_caching=prefix_cache, turn_prefill_hold_steps=hold,
                                 turn_rows_max_tokens=rows,
                                 max_num_rows=w["conversations"] + rows if burst else None)
    # Warm-up in the run's sampling (temperature 1, seeded: the sampled graph variant, not the greedy one): the
    # prompts' shapes on token ids shifted by one (prefill compiles; no prefix-cache hit later), then every decode
    # graph size with even lengths and with one long context (the decode kernel's two split kinds).
    warm_sp = dict(ignore_eos=True, temperature=1.0, seed=0)
    eng.generate([[t + 1 for t in p] for p in prompts_of(w)], SamplingParams(max_tokens=2, **warm_sp))
    warm, long = [[1] * 8] * w["conversations"], [1] * 64
    for b in sorted(getattr(eng.runner, "graph_sizes", []) or [], reverse=True):  # capture every decode size
        if b <= len(warm):
            eng.generate(warm[:b], SamplingParams(max_tokens=3, **warm_sp))
            if b >= 3:
                eng.generate(warm[: b - 1] + [long], SamplingParams(max_tokens=3, **warm_sp))
    return eng


def prompts_of(w: dict) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(100, w["vocab"] - 100, (w["prompt_len"],), generator=g).tolist()
            for _ in range(w["conversations"])]


def stop_ids_of(w: dict) -> list[int]:
    """``geometric`` turns: every ``stop_every``-th id of the prompts' range ends a turn (none when fixed)."""
    if w.get("turn_lengths", "fixed") != "geometric":
        return []
    return list(range(100, w["vocab"] - 100, w["stop_every"]))


def params_of(w: dict) -> list[SamplingParams]:
    stops = stop_ids_of(w)
    return [SamplingParams(temperature=1.0, seed=i, max_tokens=w["turn_tokens"], ignore_eos=True,
                           stop_token_ids=stops or None) for i in range(w["conversations"])]


def run_env_loop(eng: Engine, w: dict) -> dict:
    loop = EnvLoop(eng, EnvSpec(SleepyEnv), None, EnvLimits(max_turns=w["turns"], max_turn_tokens=w["turn_tokens"],
                                                            env_workers=w["conversations"]),
                   renderer=IdsRenderer())
    rows = [{"seed": i, "w": w} for i in range(w["conversations"])]
    try:
        eps = loop.run(rows, prompts_of(w), params_of(w), request_prefix="w4")
    finally:
        loop.close()
    bad = [ep for ep in eps if ep.error is not None or ep.num_turns != w["turns"]]
    assert not bad, bad[0]
    env = sum(ep.env_mask.count(0) for ep in eps)
    return dict(env_tokens=env, given_tokens=env + sum(len(ep.prompt_ids) for ep in eps),
                model_tokens=sum(ep.env_mask.count(1) for ep in eps))


def run_turn_sync(eng: Engine, w: dict, serial: bool = False) -> dict:
    """Generate a turn for all, call every environment concurrently (``serial``: one after another, as TRL
    1.16's ``_tool_call_loop``), wait for the slowest (the last), re-submit all."""
    histories = prompts_of(w)
    params = params_of(w)
    rngs = [random.Random(i) for i in range(w["conversations"])]
    given, model = sum(map(len, histories)), 0
    pool = cf.ThreadPoolExecutor(w["conversations"])
    try:
        for turn in range(w["turns"]):
            outs = eng.generate(histories, [SamplingParams(**{**_kw(p), "seed": p.seed + 7919 * turn})
                                            for p in params])
            for h, o in zip(histories, outs):
                h += o.outputs[0].token_ids
                model += len(o.outputs[0].token_ids)
            if turn + 1 < w["turns"]:
                if serial:  # TRL: each conversation's tool calls finish before the next conversation's start
                    replies = [reply_text(r, w) for r in rngs]
                else:
                    replies = list(pool.map(lambda r: reply_text(r, w), rngs))  # the slowest gates the turn
                for h, text in zip(histories, replies):
                    ids = [int(t) for t in text.split()]
                    h += ids
                    given += len(ids)
    finally:
        pool.shutdown()
    return dict(env_tokens=given - w["conversations"] * w["prompt_len"], given_tokens=given, model_tokens=model)


def _kw(p: SamplingParams) -> dict:
    return dict(temperature=p.temperature, max_tokens=p.max_tokens, ignore_eos=p.ignore_eos,
                stop_token_ids=p.stop_token_ids)


def _profiled(enabled: bool, fn, *args) -> tuple[object, list | None]:
    """fn(*args) under torch.profiler (CUDA activity) when enabled: its result and the top kernels (name, ms,
    calls)."""
    if not enabled:
        return fn(*args), None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        out = fn(*args)
    ks = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)
    return out, [(e.key[:70], round(e.device_time_total / 1e3, 1), e.count) for e in ks[:14]]


def check_mode(mode: str) -> str:
    """A mode name as the module docstring lists them, else ValueError naming it."""
    loop = mode.removesuffix("_burst") if mode.startswith("env_loop_rows") else mode
    for prefix in ("env_loop_hold", "env_loop_rows"):
        if loop.startswith(prefix) and loop.removeprefix(prefix).isdigit():
            return mode
    if mode in ("env_loop", "turn_sync", "turn_sync_nocache", "turn_sync_trl"):
        return mode
    raise ValueError(f"unknown mode {mode!r}: expected env_loop, env_loop_hold<K>, env_loop_rows<K>[_burst], "
                     "turn_sync, turn_sync_nocache or turn_sync_trl")


def measure(mode: str, hf: torch.nn.Module, w: dict, device: str, prof: bool = False) -> dict:
    check_mode(mode)
    hold = int(mode.removeprefix("env_loop_hold")) if mode.startswith("env_loop_hold") else 0
    burst = mode.endswith("_burst")
    rows = int(mode.removeprefix("env_loop_rows").removesuffix("_burst")) if mode.startswith("env_loop_rows") else 0
    eng = make_engine(hf, w, device, prefix_cache=mode != "turn_sync_nocache", hold=hold, rows=rows, burst=burst)
    before = eng.get_stats()
    clock = getattr(eng.runner, "clock", None)  # CUDA: per-step records (graph replay or eager)
    if clock is not None:
        clock.record_steps = True
        n0 = len(clock.records)
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    if mode.startswith("env_loop"):
        run_mode = run_env_loop
    else:  # turn_sync*: one loop
        run_mode = lambda e, w_: run_turn_sync(e, w_, serial=mode == "turn_sync_trl")  # noqa: E731
    counts, top = _profiled(prof and device == "cuda", run_mode, eng, w)
    if device == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    after = eng.get_stats()
    generated = after.num_generated_tokens - before.num_generated_tokens
    prefill = after.num_prefill_tokens - before.num_prefill_tokens
    busy = None
    if after.gpu_compute_s is not None and before.gpu_compute_s is not None:
        busy = round((after.gpu_compute_s - before.gpu_compute_s) / wall, 4)
    geo = w.get("turn_lengths", "fixed") == "geometric"
    name = ("W4-geo" if geo else "W4") + ("-tools" if w.get("tool_latency") == "agentic" else "")
    rec = dict(workload=name if w["preset"] != "tiny" else f"{name}-tiny", mode=mode, preset=w["preset"],
               conversations=w["conversations"], turns=w["turns"], turn_tokens=w["turn_tokens"],
               turn_lengths=w.get("turn_lengths", "fixed"), tool_latency=w.get("tool_latency", "w4"),
               timestamp=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), wall_s=round(wall, 3),
               model_tokens=generated, tok_s=round(generated / wall, 1), gpu_busy_frac=busy,
               prefill_tokens=prefill, given_tokens=counts["given_tokens"], env_tokens=counts["env_tokens"],
               prefill_over_given=round(prefill / counts["given_tokens"], 4),
               prefix_cached_tokens=after.num_prefix_cached_tokens - before.num_prefix_cached_tokens,
               preemptions=after.num_preemptions - before.num_preemptions, steps=after.num_steps - before.num_steps,
               device=_device(device), commit=_commit())
    if clock is not None:  # steps not replayed from a decode graph (a prefill in them, or too big a batch)
        rec["eager_steps"] = sum(not r.graph_b for r in clock.records[n0:])
    if top is not None:
        rec["top_kernels_ms"] = top  # under the profiler: wall and tok/s include its overhead
    assert counts["model_tokens"] == generated, (counts, rec)
    assert geo or generated == w["conversations"] * w["turns"] * w["turn_tokens"], rec
    del eng
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return rec


def run(tiny: bool, modes: list[str], out: str | None, prof: bool = False, turn_lengths: str = "fixed",
        tool_latency: str = "w4") -> list[dict]:
    device = "cpu" if tiny or not torch.cuda.is_available() else "cuda"
    w = dict(TINY if tiny else W4)
    if tool_latency == "agentic":
        w.update(tool_latency="agentic", agentic_ms={k: v / (50 if tiny else 1) for k, v in AGENTIC_MS.items()}
                 | {"sigma": AGENTIC_MS["sigma"]})
    elif tool_latency != "w4":
        raise ValueError(f"tool_latency must be w4 or agentic, got {tool_latency!r}")
    if turn_lengths == "geometric":  # mean ~turn_tokens, capped at twice it
        w.update(turn_lengths="geometric", stop_every=w["turn_tokens"], turn_tokens=2 * w["turn_tokens"])
    elif turn_lengths != "fixed":
        raise ValueError(f"turn_lengths must be fixed or geometric, got {turn_lengths!r}")
    for m in modes:
        check_mode(m)  # before the model is built
    w["vocab"] = (TINY_LLAMA if tiny else QWEN3_06B)["vocab_size"]
    hf = build_model(w, device)
    recs = [measure(m, hf, w, device, prof) for m in modes]
    by = {r["mode"]: r for r in recs}
    for base in ("turn_sync", "turn_sync_nocache", "turn_sync_trl"):
        for loop in (m for m in by if m.startswith("env_loop") and base in by):
            by[loop][f"vs_{base}"] = round(by[loop]["tok_s"] / by[base]["tok_s"], 3)
    for r in recs:
        line = json.dumps(r)
        print(line, flush=True)
        if out:
            with open(out, "a") as f:
                f.write(line + "\n")
    return recs


def _device(device: str) -> str:
    return torch.cuda.get_device_name() if device == "cuda" else "cpu"


def _commit() -> str:
    if os.environ.get("COMMIT"):
        return os.environ["COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=ROOT).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="a tiny model on the CPU (a smoke run of both modes)")
    p.add_argument("--modes", default="env_loop,turn_sync,turn_sync_trl,turn_sync_nocache",
                   help="env_loop_hold<K>: the engine loop with engine.turn_prefill_hold_steps=K; "
                        "env_loop_rows<K>: with engine.turn_rows_max_tokens=K (replies as decode rows); "
                        "env_loop_rows<K>_burst: and max_num_rows = conversations + K (a reply in one step)")
    p.add_argument("--out", default=None)
    p.add_argument("--profile", action="store_true", help="run each mode under torch.profiler: its top kernels")
    p.add_argument("--turn-lengths", default="fixed", choices=("fixed", "geometric"),
                   help="geometric: turns end at stop ids (mean 256 tokens, cap 512): W4-geo")
    p.add_argument("--tool-latency", default="w4", choices=("w4", "agentic"),
                   help="agentic: environment calls log-normal, median 0.5 s, p99 ~5 s, cap 8 s (workload W4-tools)")
    args = p.parse_args(argv)
    if not args.tiny and not torch.cuda.is_available():
        sys.exit("W4 needs a CUDA GPU (or --tiny for the CPU smoke run)")
    run(args.tiny, [m for m in args.modes.split(",") if m], args.out, args.profile, args.turn_lengths,
        args.tool_latency)


if __name__ == "__main__":
    main()
