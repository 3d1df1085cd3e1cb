"""scripts/serve.py in a subprocess, driven by the official openai client and by TRL's VLLMClient.

Every answer is checked against ``Engine.generate`` run in this process on the same checkpoint with the
same config and seeds: token ids equal, logprobs equal (float32, CPU).
"""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch

from rollout.assets import materialize_default_model
from rollout.sampling_params import SamplingParams
from tests.serve_helpers import Server, in_process_engine

openai = pytest.importorskip("openai")

ATOL = 1e-5


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    cache = tmp_path_factory.mktemp("serve-cache")
    materialize_default_model(cache)
    overrides = [f"model.cache_dir={cache}"]
    server = Server(*overrides, "server.max_body_mib=1")
    try:
        engine, model_dir = in_process_engine(*overrides)  # while the server starts
        server.wait_ready()
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
        yield SimpleNamespace(server=server, engine=engine, client=client, model=model_dir.name)
    finally:
        server.stop()


def _prompts(k: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 700, (int(n),), generator=g).tolist() for n in torch.randint(3, 20, (k,), generator=g)]


def _extra(obj, key):
    return (obj.model_extra or {})[key]


def _same(got_ids, got_lps, want) -> None:
    assert list(got_ids) == list(want.token_ids)
    assert torch.allclose(torch.tensor(got_lps, dtype=torch.float64), torch.tensor(want.logprobs, dtype=torch.float64),
                          atol=ATOL, rtol=0)


def test_models_and_health(env):
    status, body = env.server.get("/health")
    assert status == 200
    card = env.client.models.list().data[0]
    assert card.id == env.model and _extra(card, "max_model_len") == env.engine.max_model_len


def test_completions_equal_engine_generate(env):
    prompts = _prompts(3)
    resp = env.client.completions.create(model=env.model, prompt=prompts, n=2, max_tokens=6, seed=11, logprobs=0,
                                         extra_body={"ignore_eos": True})
    want = env.engine.generate(prompts, SamplingParams(n=2, max_tokens=6, seed=11, ignore_eos=True))
    assert [c.index for c in resp.choices] == list(range(6))
    for c in resp.choices:
        out = want[c.index // 2]
        _same(_extra(c, "token_ids"), c.logprobs.token_logprobs, out.outputs[c.index % 2])
        assert _extra(c, "prompt_token_ids") == out.prompt_token_ids
        assert _extra(c, "policy_versions") == [0] * 6 and c.finish_reason == "length"
        assert c.text == out.outputs[c.index % 2].text
    assert resp.usage.completion_tokens == 36
    text = env.client.completions.create(model=env.model, prompt="What is 2 + 3?", max_tokens=5, seed=3, logprobs=0,
                                         temperature=0.7, extra_body={"min_p": 0.01, "top_k": 50})
    want = env.engine.generate(["What is 2 + 3?"], SamplingParams(max_tokens=5, seed=3, temperature=0.7, top_k=50,
                                                                  min_p=0.01))[0]
    _same(_extra(text.choices[0], "token_ids"), text.choices[0].logprobs.token_logprobs, want.outputs[0])


def test_chat_uses_the_template_and_equals_engine_generate(env):
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    resp = env.client.chat.completions.create(model=env.model, messages=messages, max_tokens=6, seed=5, logprobs=True,
                                              n=2)
    ids = env.engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                   return_dict=True)["input_ids"]
    assert _extra(resp, "prompt_token_ids") == list(ids)
    want = env.engine.generate([list(ids)], SamplingParams(n=2, max_tokens=6, seed=5))[0]
    for c in resp.choices:
        _same(_extra(c, "token_ids"), [x.logprob for x in c.logprobs.content], want.outputs[c.index])
        assert c.message.content == want.outputs[c.index].text and c.message.role == "assistant"


def test_streaming_equals_the_whole_answer(env):
    prompts = _prompts(2, seed=1)
    want = env.engine.generate(prompts, SamplingParams(n=2, max_tokens=7, seed=21, ignore_eos=True))
    got = {i: {"ids": [], "lps": [], "text": "", "finish": None} for i in range(4)}
    stream = env.client.completions.create(model=env.model, prompt=prompts, n=2, max_tokens=7, seed=21, logprobs=0,
                                           stream=True, stream_options={"include_usage": True},
                                           extra_body={"ignore_eos": True})
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            g = got[c.index]
            g["ids"] += _extra(c, "token_ids")
            g["lps"] += c.logprobs.token_logprobs
            g["text"] += c.text
            g["finish"] = c.finish_reason or g["finish"]
    for i, g in got.items():
        out = want[i // 2].outputs[i % 2]
        _same(g["ids"], g["lps"], out)
        assert g["text"] == out.text and g["finish"] == "length"
    assert usage is not None and usage.completion_tokens == 28
    # Chat, with stop strings: the streamed text is exactly the final (truncated) text.
    messages = [{"role": "user", "content": "Say something."}]
    ids = list(env.engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                        return_dict=True)["input_ids"])
    for seed in range(4):
        params = SamplingParams(max_tokens=24, seed=seed, stop=["e ", "th"])
        out = env.engine.generate([ids], params)[0].outputs[0]
        text, toks, finish = "", [], None
        for chunk in env.client.chat.completions.create(model=env.model, messages=messages, max_tokens=24, seed=seed,
                                                        stop=["e ", "th"], stream=True):
            for c in chunk.choices:
                text += c.delta.content or ""
                toks += _extra(c, "token_ids")
                finish = c.finish_reason or finish
        assert text == out.text and toks == out.token_ids and finish == out.finish_reason


def test_64_concurrent_clients_get_complete_correct_answers(env):
    prompts = _prompts(64, seed=2)
    want = env.engine.generate(prompts, [SamplingParams(max_tokens=8, seed=i, ignore_eos=True) for i in range(64)])

    def ask(i):
        r = env.client.completions.create(model=env.model, prompt=prompts[i], max_tokens=8, seed=i, logprobs=0,
                                          extra_body={"ignore_eos": True})
        return i, r

    with ThreadPoolExecutor(64) as pool:
        answers = list(pool.map(ask, range(64), timeout=120))
    assert len(answers) == 64 and len({r.id for _, r in answers}) == 64
    for i, r in answers:
        assert len(r.choices) == 1
        _same(_extra(r.choices[0], "token_ids"), r.choices[0].logprobs.token_logprobs, want[i].outputs[0])


BAD = [
    ("/v1/completions", '{"prompt": [1, 2', 400, "not valid JSON"),
    ("/v1/completions", '{"prompt": [1, 2], "bogus": 1}', 422, "unknown field 'bogus'"),
    ("/v1/completions", '{"prompt": [1, 2], "max_tokens": "ten"}', 422, "max_tokens"),
    ("/v1/completions", '{"prompt": [1, 2], "temperature": true}', 422, "temperature"),
    ("/v1/completions", json.dumps({"prompt": [5] * 600}), 400, "max_model_len is 512"),
    ("/v1/completions", '{"prompt": [1, 2], "max_tokens": 600}', 400, "max_model_len"),
    ("/v1/completions", '{"prompt": [1, 2], "n": 65}', 400, "n=65 is too large; allowed: 1 .. 64"),
    ("/v1/completions", '{"prompt": [1, 2], "temperature": -1}', 400, "temperature must be >= 0"),
    ("/v1/completions", '{"prompt": [1, 100000]}', 400, "outside the vocabulary"),
    ("/v1/completions", '{"prompt": [], "max_tokens": 2}', 400, "prompt is empty"),
    ("/v1/completions", '{"prompt": [1, 2], "logprobs": 25}', 400, "logprobs=25"),
    ("/v1/completions", '{"prompt": [1, 2], "model": "gpt-4"}', 404, "model 'gpt-4' is not served"),
    ("/v1/completions", '[1, 2]', 422, "body"),
    ("/v1/chat/completions", '{"messages": []}', 422, "messages"),
    ("/v1/chat/completions", '{"messages": [{"content": "hi"}]}', 422, "role is required"),
    ("/v1/nope", "{}", 404, "no route POST /v1/nope"),
    # 8 MiB: far more than the socket buffers hold, so the client is still sending when the 413 comes
    ("/v1/completions", json.dumps({"prompt": "x" * (8 << 20)}), 413, "exceeds"),
]


@pytest.mark.parametrize("path, body, status, needle", BAD, ids=[b[3] for b in BAD])
def test_bad_requests_get_clear_4xx_and_the_server_keeps_serving(env, path, body, status, needle):
    code, text = env.server.post(path, body)
    assert code == status, text
    err = json.loads(text)["error"]
    assert needle in err["message"] and isinstance(err["type"], str) and "code" in err
    ok = env.client.completions.create(model=env.model, prompt=[1, 2, 3], max_tokens=2)
    assert len(ok.choices[0].text) >= 0 and env.server.alive()


def test_a_chunked_body_over_the_limit_gets_413(env):
    """No Content-Length: the limit is counted as the body streams in; the rest is read before the answer."""
    import http.client
    import urllib.parse

    url = urllib.parse.urlsplit(env.server.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    chunks = (b"x" * (1 << 16) for _ in range(128))  # 8 MiB, far past the socket buffers
    try:
        conn.request("POST", "/v1/completions", body=chunks, encode_chunked=True,
                     headers={"Content-Type": "application/json", "Transfer-Encoding": "chunked"})
        r = conn.getresponse()
        assert r.status == 413 and "exceeds" in json.loads(r.read())["error"]["message"]
    finally:
        conn.close()
    assert env.client.completions.create(model=env.model, prompt=[1, 2, 3], max_tokens=2).choices


def test_openai_client_raises_its_own_errors(env):
    with pytest.raises(openai.BadRequestError, match="max_model_len"):
        env.client.completions.create(model=env.model, prompt=[5] * 600, max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        env.client.completions.create(model="nope", prompt=[1], max_tokens=2)


def _metric(env, name: str) -> float:
    text = env.server.get("/metrics")[1]
    return float(next(x for x in text.splitlines() if x.startswith(name + " ")).split()[1])


def _running(env) -> float:
    return _metric(env, "rollout_running_seqs")


def _waiting(env) -> float:
    return _metric(env, "rollout_waiting_seqs")


def test_clients_that_go_away_free_their_sequences(env):
    import http.client
    from urllib.parse import urlparse

    url = urlparse(env.server.url)
    body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 400, "ignore_eos": True, "stream": True})
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.readline().startswith(b"data: ")  # tokens are flowing
    assert env.server.post("/pause?mode=keep", "")[0] == 200  # no more tokens: only aborts can free them now
    try:
        quick = openai.OpenAI(base_url=env.server.url + "/v1", api_key="none", max_retries=0, timeout=1.0)
        with pytest.raises(openai.APITimeoutError):  # a waiting client gives up
            quick.completions.create(model=env.model, prompt=[4, 5, 6], max_tokens=400)
        conn.close()  # a streaming client hangs up
        deadline = time.monotonic() + 30
        while _running(env) + _waiting(env) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _running(env) + _waiting(env) == 0
    finally:
        assert env.server.post("/resume", "")[0] == 200
    assert len(env.client.completions.create(model=env.model, prompt=[1, 2], max_tokens=3).choices) == 1


def test_metrics_are_prometheus_text(env):
    env.client.completions.create(model=env.model, prompt=[1, 2, 3], max_tokens=3)
    status, text = env.server.get("/metrics")
    assert status == 200
    values = {}
    for line in text.splitlines():
        if line.startswith("#"):
            assert re.fullmatch(r"# (HELP [\w:]+ .+|TYPE [\w:]+ (gauge|counter))", line), line
        else:
            name, value = line.split()
            values[name] = float(value)
    assert values["rollout_generation_tokens_total"] >= 3 and values["rollout_policy_version"] == 0
    for key in ("rollout_generation_tokens_per_second", "rollout_running_seqs", "rollout_waiting_seqs",
                "rollout_kv_cache_usage_ratio", "rollout_preemptions_total"):
        assert key in values


def test_trl_vllm_client_server_mode_calls(env, monkeypatch):
    """TRL 1.16's VLLMClient (server mode) against this server: the HTTP calls it makes, verified."""
    import trl.generation.vllm_client as vc

    monkeypatch.setattr(vc, "is_vllm_available", lambda *a, **k: True)  # its constructor insists; HTTP needs none
    client = vc.VLLMClient(base_url=env.server.url, connection_timeout=10)
    assert client.model == env.model and client.get_world_size() == 1
    prompts = _prompts(2, seed=3)
    got = client.generate(prompts, n=2, max_tokens=5, temperature=1.0, generation_kwargs={"seed": 9})
    want = env.engine.generate(prompts, SamplingParams(n=2, max_tokens=5, seed=9))
    assert got["prompt_ids"] == [w.prompt_token_ids for w in want]
    flat = [c for w in want for c in w.outputs]
    for ids, lps, token_ids, c in zip(got["completion_ids"], got["logprobs"], got["logprob_token_ids"], flat):
        _same(ids, [x[0] for x in lps], c)
        assert [t[0] for t in token_ids] == ids
    messages = [[{"role": "user", "content": "What is 2 + 3?"}], [{"role": "user", "content": "Hi"}]]
    chat = client.chat(messages, n=1, max_tokens=4, generation_kwargs={"seed": 1})
    assert len(chat["completion_ids"]) == 2 and all(len(x) == len(y) for x, y in zip(chat["completion_ids"],
                                                                                     chat["logprobs"]))
    client.reset_prefix_cache()
    with client.weight_update():  # start_weight_update / finish_weight_update
        pass
    assert client.get_server_info()["weight_transfer_config"] is None  # /server_info, as TRL reads it
    with pytest.raises(RuntimeError, match="no weight-transfer engine"):
        client.init_communicator(device="cuda")  # a CPU engine: vLLM's NCCL handshake cannot land, refused up front
