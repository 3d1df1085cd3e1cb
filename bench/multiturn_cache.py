"""Multi-turn agents over the OpenAI API: how much of each turn's prompt the server's prefix cache held.

N conversations run concurrently, each T turns in order; every request is the whole conversation so far
(system + user, then each assistant reply as text plus a new user message), as agent frameworks send it.
One JSON line: prompt tokens sent, cached tokens reported (``usage.prompt_tokens_details.cached_tokens``),
prefill tokens computed (prompt - cached), the hit rate, and ``reusable_tokens``: for turns after the first,
how many leading ids of the previous turn's prompt + completion the re-rendered prompt repeats exactly (the
most a prefix cache can hit; below the previous conversation's length the chat template or the text
round trip re-tokenized a turn differently, counted in ``drifted_turns``).

    # against a running server (e.g. on the H200: python -m rollout.cli.serve model=... engine=h200)
    python bench/multiturn_cache.py --url http://127.0.0.1:8000 --conversations 64 --turns 4 --out $OUT/mt.jsonl
    # CPU, embedded model: starts ``python -m rollout.cli.serve server.port=0`` itself
    python bench/multiturn_cache.py --conversations 4 --turns 4 --max-tokens 32
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
WORDS = ("add", "seven", "plus", "three", "what", "is", "the", "sum", "of", "and", "then", "divide", "by", "two",
         "result", "answer", "number", "check", "again", "tool", "output", "next", "step", "please")

Post = Callable[[str, dict], dict]


def _sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def conversation(post: Post, model: str, turns: int, max_tokens: int, user_words: int, seed: int,
                 temperature: float = 1.0) -> list[dict]:
    """One agent loop; per turn: prompt tokens, cached tokens, and the ids the previous turn left."""
    rng = random.Random(seed)
    messages = [{"role": "system", "content": _sentence(rng, 12)},
                {"role": "user", "content": _sentence(rng, user_words)}]
    prev: list[int] | None = None
    rows = []
    for turn in range(turns):
        body = post("/v1/chat/completions", {"model": model, "messages": messages, "max_tokens": max_tokens,
                                             "temperature": temperature, "seed": seed * 1000 + turn})
        choice, usage = body["choices"][0], body["usage"]
        prompt = body.get("prompt_token_ids") or []
        reusable = 0
        if prev is not None:
            while reusable < min(len(prev), len(prompt)) and prev[reusable] == prompt[reusable]:
                reusable += 1
        rows.append({"turn": turn, "prompt_tokens": usage["prompt_tokens"],
                     "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
                     "previous_tokens": len(prev or []), "reusable_tokens": reusable})
        prev = prompt + list(choice.get("token_ids") or [])
        messages += [{"role": "assistant", "content": choice["message"]["content"] or ""},
                     {"role": "user", "content": _sentence(rng, user_words)}]
    return rows


def run(post: Post, model: str, conversations: int, turns: int, max_tokens: int = 64, user_words: int = 24,
        concurrency: int = 32, seed: int = 0, temperature: float = 1.0) -> dict:
    """Every conversation, ``concurrency`` at a time; the summary line (see the module docstring)."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max(1, min(concurrency, conversations))) as pool:
        futures = [pool.submit(conversation, post, model, turns, max_tokens, user_words, seed + i, temperature)
                   for i in range(conversations)]
        rows = [r for f in tqdm(futures, desc="conversations", disable=None) for r in f.result()]
    later = [r for r in rows if r["turn"] > 0]
    prompt = sum(r["prompt_tokens"] for r in rows)
    cached = sum(r["cached_tokens"] for r in rows)
    return {
        "bench": "multiturn_cache", "conversations": conversations, "turns": turns, "max_tokens": max_tokens,
        "temperature": temperature,
        "seconds": round(time.perf_counter() - t0, 3), "prompt_tokens": prompt, "cached_tokens": cached,
        "prefill_tokens": prompt - cached, "hit_rate": round(cached / max(prompt, 1), 4),
        "later_turns_hit_rate": round(sum(r["cached_tokens"] for r in later)
                                      / max(sum(r["prompt_tokens"] for r in later), 1), 4),
        "previous_tokens": sum(r["previous_tokens"] for r in later),
        "reusable_tokens": sum(r["reusable_tokens"] for r in later),
        "cached_of_reusable": round(sum(r["cached_tokens"] for r in later)
                                    / max(sum(r["reusable_tokens"] for r in later), 1), 4),
        "drifted_turns": sum(r["reusable_tokens"] < r["previous_tokens"] for r in later),
        "later_turns": len(later),
    }


def http_post(url: str) -> Post:
    def post(path: str, body: dict) -> dict:
        req = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            return json.loads(r.read())
    return post


def _start_embedded() -> tuple[subprocess.Popen, str]:
    """``rollout-serve`` on the embedded model (CPU-runnable), on a free port; (process, url)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.Popen([sys.executable, "-m", "rollout.cli.serve", "server.port=0", "server.log_level=warning"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        if "rollout server: serving" in line:
            return proc, line.split(" on ")[1].split()[0]
    proc.wait()
    raise RuntimeError("the embedded server did not start")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", help="a running server; left out: start the embedded model's server here")
    ap.add_argument("--model", help="model name sent in requests (default: the server's first /v1/models entry)")
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--user-words", type=int, default=24)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--out", help="append the JSON line to this file too")
    args = ap.parse_args()
    proc = None
    url = args.url
    if url is None:
        proc, url = _start_embedded()
    try:
        url = url.rstrip("/")
        with urllib.request.urlopen(url + "/v1/models", timeout=60) as r:
            model = args.model or json.loads(r.read())["data"][0]["id"]
        line = run(http_post(url), model, args.conversations, args.turns, args.max_tokens, args.user_words,
                   args.concurrency, args.seed, args.temperature)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    print(json.dumps(line), flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
