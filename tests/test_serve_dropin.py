"""scripts/serve.py as a drop-in for the RL stacks (issue 21): vLLM's request extras, SGLang's native API and
TRL's server-mode routes, in one subprocess server on the embedded model.

Clients: the official ``openai`` client for the OpenAI routes; SGLang's routes and slime's weight sequence
are replayed request by request from their sources (sglang ``GenerateReqInput``/``SamplingParams``;
slime ``sglang_utils/sglang_engine.py`` payloads and ``update_weight_from_distributed.py``'s order: pause,
flush, init group + trainer's group, metadata + one broadcast per tensor, continue). Tests marked
"needs engineparams branch" exercise engine fields (top logprobs, prompt logprobs, penalties, priority...)
added on another branch; until it is merged they fail with this server's 400 naming the field.
"""

from __future__ import annotations

import datetime
import json
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from rollout.assets import materialize_default_model
from rollout.sampling_params import SamplingParams
from tests.serve_helpers import Server, in_process_engine, vllm_unique_id_pickle

openai = pytest.importorskip("openai")
@pytest.fixture(scope="module")
def env(tmp_path_factory):
    cache = tmp_path_factory.mktemp("dropin-cache")
    materialize_default_model(cache)
    overrides = [f"model.cache_dir={cache}"]
    server = Server(*overrides, "server.log_stats_s=0.5")
    try:
        engine, model_dir = in_process_engine(*overrides)
        server.wait_ready()
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
        yield SimpleNamespace(server=server, engine=engine, client=client, model=model_dir.name, dir=model_dir)
    finally:
        server.stop()


def _post(env, path: str, body: object) -> tuple[int, dict]:
    code, text = env.server.post(path, json.dumps(body))
    return code, json.loads(text) if text.strip().startswith(("{", "[")) else {"text": text}


def _prompt(n: int = 6, seed: int = 0) -> list[int]:
    return torch.randint(3, 700, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# ---- OpenAI / vLLM extras -----------------------------------------------------------------------------------
VLLM_DEFAULTS = {  # what vLLM-written clients (SkyRL, prime-rl...) send at their defaults
    "include_stop_str_in_output": False, "spaces_between_special_tokens": True, "skip_special_tokens": True,
    "priority": 0, "request_id": "abc", "cache_salt": "s", "kv_transfer_params": None, "vllm_xargs": {"k": 1},
    "use_beam_search": False, "length_penalty": 1.0, "add_special_tokens": True, "allowed_token_ids": None,
    "bad_words": [], "logits_processors": None, "structured_outputs": None, "repetition_penalty": 1.0,
    "presence_penalty": 0.0, "frequency_penalty": 0.0, "min_tokens": 0, "truncate_prompt_tokens": None,
    "return_token_ids": True, "prompt_logprobs": None, "mm_processor_kwargs": None,
}


def test_vllm_extras_at_their_defaults_are_accepted_and_change_nothing(env):
    prompt = _prompt()
    plain = env.client.completions.create(model=env.model, prompt=prompt, max_tokens=5, temperature=0, logprobs=0)
    extra = env.client.completions.create(model=env.model, prompt=prompt, max_tokens=5, temperature=0, logprobs=0,
                                          extra_body=VLLM_DEFAULTS)
    assert extra.choices[0].model_extra["token_ids"] == plain.choices[0].model_extra["token_ids"]
    chat = env.client.chat.completions.create(
        model=env.model, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
        extra_body={**VLLM_DEFAULTS, "documents": None, "chat_template_kwargs": {}, "echo": False,
                    "reasoning_effort": None, "include_reasoning": True, "parallel_tool_calls": False})
    assert chat.choices[0].message.role == "assistant"


REFUSED = [
    ("/v1/completions", {"structured_outputs": {"json": {"type": "object"}}}, "structured_outputs"),
    ("/v1/completions", {"guided_regex": "a+"}, "guided_regex"),
    ("/v1/completions", {"response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format"),
    ("/v1/completions", {"best_of": 3}, "best_of"),
    ("/v1/completions", {"use_beam_search": True}, "use_beam_search"),
    ("/v1/completions", {"logit_bias": {"5": 1.0}}, "logit_bias"),
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
    ("/v1/chat/completions", {"tool_choice": {"type": "function", "function": {"name": "nope"}},
                              "tools": [{"type": "function", "function": {"name": "add"}}]}, "tool_choice"),
]


@pytest.mark.parametrize("path, extra, field", REFUSED, ids=[r[2] + r[0][-5:] for r in REFUSED])
def test_refused_fields_are_400s_naming_the_field(env, path, extra, field):
    base = {"prompt": [1, 2, 3]} if path.endswith("/completions") and "chat" not in path else \
        {"messages": [{"role": "user", "content": "hi"}]}
    code, body = _post(env, path, {**base, "max_tokens": 2, **extra})
    assert code == 400, body
    assert body["error"]["param"] == field and field in body["error"]["message"]


def test_chat_without_max_tokens_runs_to_the_end_of_the_context(env):
    resp = env.client.chat.completions.create(model=env.model, messages=[{"role": "user", "content": "hi"}],
                                              extra_body={"ignore_eos": True})
    room = min(env.engine.max_model_len, env.engine.kv.num_tokens) - resp.usage.prompt_tokens
    assert resp.usage.completion_tokens == room > 16


def test_truncate_prompt_tokens_keeps_the_last_tokens(env):
    prompt = _prompt(600, seed=4)  # longer than max_model_len (512): refused without truncation
    resp = env.client.completions.create(model=env.model, prompt=prompt, max_tokens=2,
                                         extra_body={"truncate_prompt_tokens": 20})
    assert resp.choices[0].model_extra["prompt_token_ids"] == prompt[-20:]


def test_echo_returns_the_prompt_text_first(env):
    prompt = "What is 2 + 3?"
    resp = env.client.completions.create(model=env.model, prompt=prompt, max_tokens=3, temperature=0, echo=True)
    plain = env.client.completions.create(model=env.model, prompt=prompt, max_tokens=3, temperature=0)
    ids = resp.choices[0].model_extra["prompt_token_ids"]
    assert resp.choices[0].text == env.engine.tokenizer.decode(ids) + plain.choices[0].text
    only = env.client.completions.create(model=env.model, prompt=prompt, max_tokens=0, echo=True)
    assert only.choices[0].text == env.engine.tokenizer.decode(ids) and only.usage.completion_tokens == 0


def test_logprobs_5_gives_5_alternatives_from_the_same_distribution(env):
    resp = env.client.completions.create(model=env.model, prompt=_prompt(), max_tokens=6, temperature=0, logprobs=5,
                                         extra_body={"return_tokens_as_token_ids": True})
    lp = resp.choices[0].logprobs
    for tok, sampled, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 5 and max(top.values()) == pytest.approx(sampled, abs=1e-5)  # greedy: the top one
        assert top[tok] == pytest.approx(sampled, abs=1e-6)
    chat = env.client.chat.completions.create(model=env.model, messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=4, temperature=0, logprobs=True, top_logprobs=3)
    for entry in chat.choices[0].logprobs.content:
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)


def test_streamed_top_logprobs_equal_the_whole_answer(env):
    """Streams carry the alternatives too (before: a 400, since the engine's deltas had none)."""
    kw = dict(model=env.model, prompt=_prompt(seed=3), max_tokens=8, temperature=0, logprobs=4,
              extra_body={"return_tokens_as_token_ids": True})
    whole = env.client.completions.create(**kw).choices[0].logprobs
    tops = [t for chunk in env.client.completions.create(stream=True, **kw) for c in chunk.choices
            if c.logprobs is not None for t in c.logprobs.top_logprobs]
    assert len(tops) == 8 and all(len(t) == 4 for t in tops)
    assert [sorted(t) for t in tops] == [sorted(t) for t in whole.top_logprobs]
    chat = dict(model=env.model, messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0,
                logprobs=True, top_logprobs=2)
    entries = [e for chunk in env.client.chat.completions.create(stream=True, **chat) for c in chunk.choices
               if c.logprobs is not None for e in c.logprobs.content]
    assert len(entries) == 4 and all(len(e.top_logprobs) == 2 for e in entries)


def test_prompt_logprobs_of_a_generation_give_back_its_logprobs(env):
    prompt = _prompt(8, seed=2)
    gen = env.client.completions.create(model=env.model, prompt=prompt, max_tokens=6, logprobs=0, seed=1,
                                        extra_body={"ignore_eos": True})
    c = gen.choices[0]
    seq = prompt + c.model_extra["token_ids"]
    code, body = _post(env, "/v1/completions", {"prompt": seq, "max_tokens": 1, "prompt_logprobs": 0})
    assert code == 200, body
    plp = body["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(seq)
    got = [plp[len(prompt) + i][str(t)]["logprob"] for i, t in enumerate(c.model_extra["token_ids"])]
    assert torch.allclose(torch.tensor(got), torch.tensor(c.logprobs.token_logprobs), atol=1e-4)


@pytest.mark.parametrize("extra", [{"repetition_penalty": 1.3}, {"presence_penalty": 0.5},
                                   {"frequency_penalty": 0.5}, {"skip_special_tokens": False},
                                   {"include_stop_str_in_output": True, "stop": ["a"]}, {"priority": 3}])
def test_vllm_extras_away_from_their_defaults_are_honoured(env, extra):
    code, body = _post(env, "/v1/completions", {"prompt": _prompt(), "max_tokens": 4, **extra})
    assert code == 200, body


def test_tools_with_tool_choice_auto_are_accepted(env):
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {
        "a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
    for choice in ("auto", "required", {"type": "function", "function": {"name": "add"}}):
        resp = env.client.chat.completions.create(model=env.model, messages=[{"role": "user", "content": "2+3?"}],
                                                  tools=tools, tool_choice=choice, max_tokens=4)
        assert resp.choices[0].message.role == "assistant"  # a random model calls no tool: plain content


# ---- SGLang native ------------------------------------------------------------------------------------------
def test_generate_with_input_ids_equals_completions(env):
    prompt = _prompt(7, seed=5)
    code, sg = _post(env, "/generate", {"input_ids": prompt, "return_logprob": True,
                                        "sampling_params": {"max_new_tokens": 8, "temperature": 0,
                                                            "ignore_eos": True}})
    assert code == 200, sg
    oa = env.client.completions.create(model=env.model, prompt=prompt, max_tokens=8, temperature=0, logprobs=0,
                                       extra_body={"ignore_eos": True})
    assert sg["output_ids"] == oa.choices[0].model_extra["token_ids"]
    lps = [x[0] for x in sg["meta_info"]["output_token_logprobs"]]
    assert torch.allclose(torch.tensor(lps), torch.tensor(oa.choices[0].logprobs.token_logprobs), atol=1e-6)
    assert [x[1] for x in sg["meta_info"]["output_token_logprobs"]] == sg["output_ids"]
    meta = sg["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 8}
    assert meta["prompt_tokens"] == 7 and meta["completion_tokens"] == 8 and meta["weight_version"] == "0"
    assert sg["text"] == oa.choices[0].text and "cached_tokens" in meta and meta["input_token_logprobs"] == []


def test_generate_input_logprobs_and_top_logprobs(env):
    prompt = _prompt(8, seed=6)
    code, sg = _post(env, "/generate", {"input_ids": prompt, "return_logprob": True, "logprob_start_len": 0,
                                        "top_logprobs_num": 3, "sampling_params": {"max_new_tokens": 4,
                                                                                   "temperature": 0}})
    assert code == 200, sg
    meta = sg["meta_info"]
    assert [x[1] for x in meta["input_token_logprobs"]] == prompt and meta["input_token_logprobs"][0][0] is None
    assert all(len(t) == 3 for t in meta["output_top_logprobs"]) and len(meta["input_top_logprobs"]) == 8
    assert meta["output_top_logprobs"][0][0][0] == pytest.approx(meta["output_token_logprobs"][0][0], abs=1e-5)
    code, oa = _post(env, "/v1/completions", {"prompt": prompt, "max_tokens": 1, "prompt_logprobs": 0})
    plp = oa["choices"][0]["prompt_logprobs"]
    want = [None] + [plp[i][str(t)]["logprob"] for i, t in enumerate(prompt) if i > 0]
    assert [x[0] for x in meta["input_token_logprobs"]] == pytest.approx(want, abs=1e-5)


def test_generate_batches_text_and_n(env):
    code, out = _post(env, "/generate", {"text": ["What is 2 + 3?", "Hi"],
                                         "sampling_params": {"max_new_tokens": 3, "n": 2, "temperature": 1.0,
                                                             "sampling_seed": 3}})
    assert code == 200 and isinstance(out, list) and len(out) == 4, out
    assert all(len(o["output_ids"]) <= 3 and set(o["meta_info"]) >= {"id", "finish_reason"} for o in out)
    first = _post(env, "/generate", {"input_ids": _prompt(), "sampling_params": {"max_new_tokens": 1,
                                                                                  "temperature": 0}})[1]
    stop = first["output_ids"][0]
    code, out = _post(env, "/generate", {"input_ids": _prompt(), "sampling_params": {
        "max_new_tokens": 5, "temperature": 0, "stop_token_ids": [stop]}})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


def test_generate_refuses_what_it_cannot_honour(env):
    for body, field in ((({"text": "x", "sampling_params": {"regex": "a+"}}), "sampling_params.regex"),
                        (({"text": "x", "sampling_params": {"bogus": 1}}), "sampling_params.bogus"),
                        (({"text": "x", "lora_path": "a"}), "lora_path"),
                        (({"text": "x", "input_ids": [1]}), "text")):
        code, out = _post(env, "/generate", body)
        assert code == 400 and out["error"]["param"] == field, out


def test_generate_streams_cumulative_chunks(env):
    import urllib.request

    req = urllib.request.Request(env.server.url + "/generate", data=json.dumps({
        "input_ids": _prompt(), "stream": True, "sampling_params": {"max_new_tokens": 5, "temperature": 0,
                                                                    "ignore_eos": True}}).encode(),
        headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        events = [line[6:] for line in r.read().decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks[-1]["output_ids"]) == 5 and chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert all(len(a["output_ids"]) <= len(b["output_ids"]) for a, b in zip(chunks, chunks[1:]))


def test_sglang_info_and_control_routes(env):
    assert env.server.get("/health_generate")[0] == 200
    assert env.server.get("/flush_cache")[0] == 200  # slime GETs it
    info = json.loads(env.server.get("/get_model_info")[1])
    assert info["is_generation"] is True and info["weight_version"] == json.loads(
        env.server.get("/get_weight_version")[1])["weight_version"]
    server = json.loads(env.server.get("/get_server_info")[1])
    assert server["context_length"] == env.engine.max_model_len and "internal_states" in server
    assert _post(env, "/pause_generation", {})[0] == 200
    assert json.loads(env.server.get("/is_paused")[1])["is_paused"] is True
    assert _post(env, "/continue_generation", {})[0] == 200
    assert _post(env, "/abort_request", {"rid": "no-such"})[0] == 200


def _slime_group(port: int, name: str):
    """The trainer's side of slime's group: SGLang/OpenRLHF's init_custom_process_group (gloo on the CPU)."""
    from torch.distributed.distributed_c10d import PrefixStore, rendezvous

    from rollout.weights.torch_group import _new_group

    t = datetime.timedelta(seconds=60)
    store, _, _ = next(rendezvous(f"tcp://127.0.0.1:{port}", 0, 2, timeout=t))
    return _new_group(2, 0, "gloo", PrefixStore(name, store), name, t)


def test_slime_weight_sequence_over_update_weights_from_distributed(env):
    import socket

    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(env.dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    named = [(n, (p.detach() + 0.05 * torch.randn(p.shape, generator=g)).to(torch.bfloat16).float())
             for n, p in hf.named_parameters()]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    name = "slime-pp_0"
    assert _post(env, "/pause_generation", {})[0] == 200
    assert env.server.get("/flush_cache")[0] == 200
    code, out = _post(env, "/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": port,
                                                           "rank_offset": 1, "world_size": 2, "group_name": name,
                                                           "backend": "nccl"})
    assert code == 400 and "CUDA" in out["error"]["message"]  # slime's backend on a CPU engine: refused at once
    answers = {}
    init = threading.Thread(target=lambda: answers.setdefault("init", _post(env, "/init_weights_update_group", {
        "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
        "group_name": name, "backend": "gloo"})))
    init.start()
    group = _slime_group(port, name)
    init.join(60)
    assert answers["init"][0] == 200, answers
    body = {"names": [n for n, _ in named], "dtypes": [str(t.dtype).replace("torch.", "") for _, t in named],
            "shapes": [list(t.shape) for _, t in named], "group_name": name, "flush_cache": False,
            "weight_version": "3"}
    push = threading.Thread(target=lambda: answers.setdefault("push", _post(env, "/update_weights_from_distributed",
                                                                           body)))
    push.start()
    for _, t in named:  # slime: one broadcast per tensor, in the order of the metadata
        dist.broadcast(t, 0, group=group)
    push.join(120)
    assert answers["push"][0] == 200 and answers["push"][1]["policy_version"] == 3, answers
    assert _post(env, "/continue_generation", {})[0] == 200
    prompt = _prompt(9, seed=8)
    code, sg = _post(env, "/generate", {"input_ids": prompt, "sampling_params": {"max_new_tokens": 6,
                                                                                 "temperature": 0}})
    env.engine.update_weights(named, 3)
    want = env.engine.generate([prompt], SamplingParams(max_tokens=6, temperature=0))[0].outputs[0]
    assert sg["output_ids"] == want.token_ids and sg["meta_info"]["weight_version"] == "3"
    assert _post(env, "/destroy_weights_update_group", {"group_name": name})[0] == 200
    dist.destroy_process_group(group)


def test_update_weights_from_disk_takes_sglangs_body(env):
    code, out = _post(env, "/update_weights_from_disk", {"model_path": str(env.dir), "weight_version": "11"})
    assert code == 200 and out["success"] is True and out["policy_version"] == 11, out
    assert json.loads(env.server.get("/get_weight_version")[1])["weight_version"] == "11"
    code, out = _post(env, "/update_weights_from_disk", {"model_path": str(env.dir), "load_format": "dummy"})
    assert code == 400 and out["error"]["param"] == "load_format"


# ---- TRL server mode ----------------------------------------------------------------------------------------
def test_server_info_as_trl_reads_it(env):
    info = json.loads(env.server.get("/server_info?config_format=json")[1])["vllm_config"]
    assert info["weight_transfer_config"] is None  # a CPU engine: vLLM's NCCL handshake cannot land here
    assert json.loads(env.server.get("/get_world_size/")[1]) == {"world_size": 1}


def test_a_vllm_format_init_fails_within_seconds(env):
    """TRL 1.16's init_communicator (vLLM's trainer_init: a TCPStore with the NCCL id under broadcast_from/0/0)
    against a CPU engine: a 400 naming the reason at once. A store that says nothing fails within timeout_s."""
    store = torch.distributed.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False,
                                       timeout=datetime.timedelta(seconds=30))
    store.set("broadcast_from/0/0", vllm_unique_id_pickle(bytes(128)))
    t0 = time.monotonic()
    code, out = _post(env, "/init_weight_transfer_engine", {"init_info": {
        "master_address": "127.0.0.1", "master_port": store.port, "rank_offset": 1, "world_size": 2,
        "packed": True}})
    assert code == 400 and "CUDA" in out["error"]["message"] and time.monotonic() - t0 < 15, out
    silent = torch.distributed.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False,
                                        timeout=datetime.timedelta(seconds=30))
    t0 = time.monotonic()
    code, out = _post(env, "/init_weight_transfer", {"master_address": "127.0.0.1", "master_port": silent.port,
                                                     "timeout_s": 2})
    assert code == 400 and "handshake" in out["error"]["message"] and time.monotonic() - t0 < 10, out


# ---- what users watch ---------------------------------------------------------------------------------------
def test_metrics_under_vllms_names_and_a_stats_line_while_busy(env):
    env.client.completions.create(model=env.model, prompt=_prompt(), max_tokens=40, extra_body={"ignore_eos": True})
    text = env.server.get("/metrics")[1]
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if not line.startswith("#")}
    label = f'{{model_name="{env.model}"}}'
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:gpu_cache_usage_perc", "vllm:prompt_tokens_total"):
        assert name + label in values, name
    assert values["vllm:generation_tokens_total" + label] == values["rollout_generation_tokens_total"] >= 40
    deadline = time.monotonic() + 10
    while not any("tok/s" in line and "KV cache" in line for line in env.server.lines):
        assert time.monotonic() < deadline, "".join(env.server.lines[-5:])
        time.sleep(0.1)
    line = next(x for x in env.server.lines if "tok/s" in x and "KV cache" in x)
    assert "running" in line and "waiting" in line and "policy version" in line
