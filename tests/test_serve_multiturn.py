"""A multi-turn agent over the OpenAI chat API: each turn's request re-sends the conversation, and the server's
prefix cache must serve the earlier turns' KV (measured from /metrics, not assumed)."""

from __future__ import annotations

import json

import pytest

from rollout.assets import materialize_default_model
from tests.serve_helpers import Server

BLOCK = 16  # rollout/conf/engine/default.yaml


def _counters(server: Server) -> dict[str, float]:
    status, text = server.get("/metrics")
    assert status == 200
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line.startswith("rollout_")}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    cache = tmp_path_factory.mktemp("serve-cache")
    materialize_default_model(cache)
    s = Server(f"model.cache_dir={cache}").wait_ready()
    yield s
    s.stop()


def test_chat_turns_hit_the_prefix_cache(server) -> None:
    model = json.loads(server.get("/v1/models")[1])["data"][0]["id"]
    messages = [{"role": "user", "content": "Let us play a game of numbers, one turn at a time."}]
    hits, prompts, shared, previous = [], [], [], []
    for turn in range(4):
        before = _counters(server)
        status, body = server.post("/v1/chat/completions", json.dumps({
            "model": model, "messages": messages, "max_tokens": 12, "temperature": 0, "return_token_ids": True}))
        assert status == 200, body
        answer = json.loads(body)
        after = _counters(server)
        prompt_len = answer["usage"]["prompt_tokens"]
        hit = after["rollout_prefix_cache_hit_tokens_total"] - before["rollout_prefix_cache_hit_tokens_total"]
        queried = after["rollout_prefix_cache_queried_tokens_total"] - before[
            "rollout_prefix_cache_queried_tokens_total"]
        assert queried == prompt_len
        hits.append(hit)
        prompts.append(prompt_len)
        ids = answer["prompt_token_ids"]
        common = next((i for i, (a, b) in enumerate(zip(ids, previous)) if a != b), min(len(ids), len(previous)))
        # tokens this prompt shares with the previous turn's sequence whose KV exists (its last token is never an input)
        shared.append(max(0, min(common, len(previous) - 1)))
        previous = ids + answer["choices"][0]["token_ids"]
        messages += [{"role": "assistant", "content": answer["choices"][0]["message"]["content"]},
                     {"role": "user", "content": f"Turn {turn + 1}: your move."}]
    assert hits[0] == 0
    for k in range(1, 4):
        # every full block the turn shares with the previous turn's sequence (its prompt and the answer, as far as
        # the answer's re-rendered text gives the same tokens) is served from the cache: nothing is recomputed
        assert hits[k] >= (prompts[k - 1] // BLOCK) * BLOCK, (hits, prompts)
        assert hits[k] == (min(shared[k], prompts[k] - 1) // BLOCK) * BLOCK, (hits, shared, prompts)
    print("multi-turn prefix-cache hit rate per turn:", [round(h / p, 3) for h, p in zip(hits, prompts)],
          "shared with the previous sequence:", [round(s / p, 3) for s, p in zip(shared, prompts)])
