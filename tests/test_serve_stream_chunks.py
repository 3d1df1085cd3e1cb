"""SSE chunks rendered from engine outputs (no server): a chat stream with tools carries its parsed
``tool_calls`` as a delta of its last chunk (OpenAI's shape, ``finish_reason="tool_calls"``), and streamed
text honours the request's ``skip_special_tokens``."""

import json

import pytest
from transformers import AutoTokenizer

from rollout.assets import materialize_default_model
from rollout.outputs import CompletionOutput, RequestOutput
from rollout.serve.protocol import ChatCompletionRequest, CompletionRequest
from rollout.serve.responses import Render
from rollout.serve.streaming import StreamChunks

TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two numbers.",
                                           "parameters": {"type": "object", "properties": {
                                               "a": {"type": "integer"}, "b": {"type": "integer"}}}}}]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return AutoTokenizer.from_pretrained(materialize_default_model(tmp_path_factory.mktemp("m")))


def _events(chunks, items):
    return [json.loads(e[len("data: "):]) for e in chunks.render_items(items)]


def _outputs(tok, text: str, final: bool, skip: int = 0) -> RequestOutput:
    ids = tok.encode(text, add_special_tokens=False)
    c = CompletionOutput(0, ids[skip:], [-0.5] * len(ids[skip:]), "stop" if final else None,
                         text if final else None, [0] * len(ids[skip:]))
    return RequestOutput("r", [1, 2], [c], None, final)


def test_a_streamed_tool_call_arrives_as_a_tool_calls_delta(tok):
    text = 'Let me add. <tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "2+3?"}], tools=TOOLS, stream=True)
    chunks = StreamChunks(req, 1, 1, "m", Render(tok, False), chat=True)
    n = len(tok.encode(text, add_special_tokens=False))
    first = _events(chunks, [(0, _outputs(tok, text, False), False)])
    assert first[0]["choices"][0]["delta"]["content"] == ""  # held: a call is parsed from the whole output
    last = _events(chunks, [(0, _outputs(tok, text, True), True)])
    choice = last[0]["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["token_ids"] == []  # every id was sent already
    (call,) = choice["delta"]["tool_calls"]
    assert call["index"] == 0 and call["type"] == "function" and call["function"]["name"] == "add"
    assert json.loads(call["function"]["arguments"]) == {"a": 2, "b": 3}
    assert choice["delta"]["content"] == "Let me add." and n > 0


def test_a_stream_without_a_call_streams_its_text(tok):
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], stream=True)
    chunks = StreamChunks(req, 1, 1, "m", Render(tok, False), chat=True)
    got = _events(chunks, [(0, _outputs(tok, "plain words here", False), False)])
    assert got[0]["choices"][0]["delta"]["content"].startswith("plain words")


def test_streamed_text_keeps_special_tokens_when_asked(tok):
    special = tok.eos_token or tok.all_special_tokens[0]
    text = f"a {special} b"
    for skip, present in ((True, False), (False, True)):
        req = CompletionRequest(prompt="x", stream=True, skip_special_tokens=skip)
        chunks = StreamChunks(req, 1, 1, "m", Render(tok, False), chat=False)
        got = _events(chunks, [(0, _outputs(tok, text, False), False)])
        assert (special in "".join(e["choices"][0]["text"] for e in got)) is present
