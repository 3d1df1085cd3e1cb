"""The drop-in server's pieces without a server: response shapes for the engine's top / prompt logprobs
(OpenAI's and vLLM's, on fake outputs carrying the engine fields), tool-call parsing, SGLang's sampling
mapping, vLLM's packing rule and the guarded NCCL-id unpickler."""

from __future__ import annotations

import json
import pickle
from types import SimpleNamespace

import pytest

from rollout.serve import tools
from rollout.serve.errors import APIError
from rollout.serve.protocol import ChatCompletionRequest, CompletionRequest
from rollout.serve.responses import Render, chat_body, completion_body
from rollout.serve.sglang_protocol import sampling_base, sampling_extras
from rollout.settings.schema import SamplingConfig
from rollout.weights.layout import TensorSpec
from rollout.weights.vllm_nccl import packed_chunks, unique_id


def _out(ids, lps, tops=None, text="", prompt=(1, 2, 3), plps=None, ptops=None):
    c = SimpleNamespace(index=0, token_ids=list(ids), logprobs=list(lps), top_logprobs=tops, finish_reason="stop",
                        stop_reason=None, text=text, policy_versions=[0] * len(ids))
    return SimpleNamespace(request_id="r", prompt_token_ids=list(prompt), outputs=[c], prompt_logprobs=plps,
                           prompt_top_logprobs=ptops)


RENDER = Render(None, True)


def test_completions_logprobs_k_in_openais_shape():
    out = _out([5, 6], [-0.1, -0.2], tops=[[(5, -0.1), (7, -2.0)], [(8, -0.15), (6, -0.2)]])
    req = CompletionRequest(prompt=[1, 2, 3], logprobs=2)
    lp = completion_body(req, [out], "m", RENDER)["choices"][0]["logprobs"]
    assert lp["tokens"] == ["token_id:5", "token_id:6"] and lp["token_logprobs"] == [-0.1, -0.2]
    assert lp["top_logprobs"][0] == {"token_id:5": -0.1, "token_id:7": -2.0}
    assert lp["top_logprobs"][1] == {"token_id:6": -0.2, "token_id:8": -0.15}


def test_echo_with_logprobs_puts_the_prompt_first():
    out = _out([5], [-0.1], tops=[[(5, -0.1)]], plps=[None, -1.0, -2.0], ptops=[None, [(2, -1.0)], [(9, -0.5)]])
    req = CompletionRequest(prompt=[1, 2, 3], logprobs=1, echo=True)
    choice = completion_body(req, [out], "m", RENDER)["choices"][0]
    lp = choice["logprobs"]
    assert lp["token_logprobs"] == [None, -1.0, -2.0, -0.1] and lp["top_logprobs"][0] is None
    assert lp["top_logprobs"][2] == {"token_id:3": -2.0, "token_id:9": -0.5}
    assert choice["prompt_logprobs"][0] is None
    assert choice["prompt_logprobs"][2] == {"9": {"logprob": -0.5, "rank": 1, "decoded_token": "token_id:9"},
                                            "3": {"logprob": -2.0, "rank": 2, "decoded_token": "token_id:3"}}


def test_chat_top_logprobs_in_openais_shape():
    out = _out([5], [-0.1], tops=[[(5, -0.1), (7, -2.0)]])
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], logprobs=True, top_logprobs=2)
    entry = chat_body(req, out, "m", RENDER)["choices"][0]["logprobs"]["content"][0]
    assert entry["token"] == "token_id:5" and [t["logprob"] for t in entry["top_logprobs"]] == [-0.1, -2.0]
    assert set(entry["top_logprobs"][1]) == {"token", "logprob", "bytes"}


def test_hermes_tool_calls_become_openai_tool_calls():
    text = 'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}],
                                tools=[{"type": "function", "function": {"name": "add"}}], tool_choice="auto")
    choice = chat_body(req, _out([5], [-0.1], text=text), "m", RENDER)["choices"][0]
    call = choice["message"]["tool_calls"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Let me add."
    assert call["type"] == "function" and call["function"]["name"] == "add" and call["id"].startswith("call_")
    assert json.loads(call["function"]["arguments"]) == {"a": 2, "b": 3}
    none = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], tools=req.tools, tool_choice="none")
    assert "tool_calls" not in chat_body(none, _out([5], [-0.1], text=text), "m", RENDER)["choices"][0]["message"]
    assert tools.hermes("<tool_call>{not json}</tool_call>")["tool_calls"] == []


def test_the_tokenizers_response_template_comes_first():
    class Tok:
        response_template = {"x": 1}

        def parse_response(self, ids, prefix=None, tools=None):
            assert prefix == [1, 2, 3]
            return {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "mul", "arguments": {"a": 3}}}]}

    content, calls = tools.parse(Tok(), [5], [1, 2, 3], "<tool_call>{\"name\": \"add\"}</tool_call>", None)
    assert content is None and calls[0]["function"] == {"name": "mul", "arguments": '{"a": 3}'}


def test_sglang_sampling_params_map_onto_ours():
    base = sampling_base({"max_new_tokens": 7, "temperature": 0, "top_k": -1, "sampling_seed": 4, "n": 2,
                          "stop_token_ids": [3]}, SamplingConfig())
    assert base["max_tokens"] == 7 and base["temperature"] == 0.0 and base["seed"] == 4 and base["n"] == 2
    extras = sampling_extras({"no_stop_trim": True, "repetition_penalty": 1.1}, 3, None)
    assert extras["include_stop_str_in_output"] is True and extras["logprobs"] == 3
    with pytest.raises(APIError, match="json_schema"):
        sampling_base({"json_schema": "{}"}, SamplingConfig())


def test_vllm_packing_closes_a_chunk_past_the_buffer():
    specs = [TensorSpec(f"t{i}", "float32", (100,)) for i in range(5)]  # 400 bytes each
    assert [len(c) for c in packed_chunks(specs, 1000)] == [3, 2]  # 1200 > 1000 closes the first
    assert [len(c) for c in packed_chunks(specs, 1 << 30)] == [5]


class _Evil:
    def __reduce__(self):
        return (print, ("pwned",))


def test_the_nccl_id_unpickler_admits_only_the_id():
    with pytest.raises(pickle.UnpicklingError, match="refusing"):
        unique_id(pickle.dumps(_Evil()))
    from tests.serve_helpers import vllm_unique_id_pickle

    raw = bytes(range(128))
    assert bytes(unique_id(vllm_unique_id_pickle(raw)).internal) == raw
