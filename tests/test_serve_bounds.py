"""One bad or oversized request never hurts the others: out-of-range values are 400s (the engine loop never
sees them), and the caps answer 400 (too many prompts) or 429 with Retry-After (the queue is full)."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import pytest

from rollout.assets import materialize_default_model
from tests.serve_helpers import Server


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    cache = tmp_path_factory.mktemp("serve-cache")
    materialize_default_model(cache)
    server = Server(f"model.cache_dir={cache}", "server.max_prompts_per_request=4",
                    "server.max_queued_sequences=8").wait_ready()
    try:
        vocab = json.loads(server.get("/v1/models")[1])["data"][0]["limits"]["vocab_size"]
        yield SimpleNamespace(server=server, vocab=vocab)
    finally:
        server.stop()


def _post(env, body: dict) -> tuple[int, Any, dict]:
    req = urllib.request.Request(env.server.url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.headers, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, e.headers, json.loads(e.read())


def _served(env) -> bool:
    code, _, body = _post(env, {"prompt": [1, 2, 3], "max_tokens": 3, "ignore_eos": True})
    return code == 200 and body["choices"][0]["finish_reason"] == "length"


def _metric(env, name: str) -> float:
    text = env.server.get("/metrics")[1]
    return float(next(x for x in text.splitlines() if x.startswith(name + " ")).split()[1])


@pytest.mark.parametrize("extra, needle", [
    ({"top_k": 2**63}, "top_k"), ({"top_k": 2**63, "stream": True}, "top_k"), ({"top_k": "VOCAB+1"}, "top_k"),
    ({"seed": -1}, "seed"), ({"seed": 2**64}, "seed"), ({"stop_token_ids": ["VOCAB"]}, "stop_token_ids"),
    ({"stop": ["x"] * 65}, "stop"), ({"n": 2**63}, "n="), ({"max_tokens": 2**63}, "max_tokens"),
])
def test_out_of_range_values_are_400_and_the_next_request_is_served(env, extra, needle):
    """Was: top_k=2**63 overflowed int64 inside a step, the engine loop died and every later request got 503."""
    fix = lambda v: env.vocab + 1 if v == "VOCAB+1" else env.vocab if v == "VOCAB" else v
    extra = {k: [fix(x) for x in v] if isinstance(v, list) else fix(v) for k, v in extra.items()}
    code, _, body = _post(env, {"prompt": "a", "max_tokens": 4, **extra})
    assert code == 400 and needle in body["error"]["message"], body
    assert _served(env) and env.server.get("/health")[0] == 200


def test_too_many_prompts_or_sequences_in_one_request_is_400_naming_the_cap(env):
    code, _, body = _post(env, {"prompt": [[1, 2]] * 5, "max_tokens": 2})
    assert code == 400 and "server.max_prompts_per_request" in body["error"]["message"], body
    code, _, body = _post(env, {"prompt": [[1, 2]] * 3, "n": 3, "max_tokens": 2})
    assert code == 400 and "server.max_queued_sequences" in body["error"]["message"], body
    assert _served(env)


def test_a_full_queue_answers_429_with_retry_after_then_serves_again(env):
    assert env.server.post("/pause?mode=keep", "")[0] == 200
    pool = ThreadPoolExecutor(2)
    try:
        held = [pool.submit(_post, env, {"prompt": [1, 2, 3], "n": 4, "max_tokens": 4}) for _ in range(2)]
        deadline = time.monotonic() + 30
        while _metric(env, "rollout_waiting_seqs") < 8 and time.monotonic() < deadline:
            time.sleep(0.05)
        code, headers, body = _post(env, {"prompt": [1, 2, 3], "max_tokens": 4})
        assert code == 429 and "server.max_queued_sequences" in body["error"]["message"], body
        assert int(headers.get("Retry-After")) >= 1
    finally:
        assert env.server.post("/resume", "")[0] == 200
    assert all(f.result(timeout=60)[0] == 200 for f in held)
    pool.shutdown()
    assert _served(env)


@pytest.mark.parametrize("key", ["max_prompts_per_request", "max_queued_sequences"])
def test_cap_settings_are_mirrored_and_checked(key):
    from rollout.cli import serve
    from rollout.serve.config import ServerConfig
    from tests.script_helpers import compose

    assert getattr(serve.load_config(compose("serve")).server, key) == getattr(ServerConfig(), key)
    with pytest.raises(ValueError, match=f"server.{key}=0"):
        serve.load_config(compose("serve", f"server.{key}=0"))
