"""SSE chunks rendered from engine outputs (no server): a chat stream with tools carries its parsed
``tool_calls`` as a delta of its last chunk (OpenAI's shape, ``finish_reason="tool_calls"``), streamed
text honours the request's ``skip_special_tokens``, and the per-stream work of a batch stays cheap (no
json.dumps per partial chunk, no transformers decode per call, one event-loop wake-up per batch)."""

import json
from concurrent.futures import Future

import pytest
import torch
from transformers import AutoTokenizer

from rollout.assets import materialize_default_model
from rollout.outputs import CompletionOutput, RequestOutput
from rollout.serve import streaming
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


def _partials(tok, text: str, prompts: int, n: int, step: int = 3) -> list[tuple[int, RequestOutput, bool]]:
    """A stream's partial outputs, ``step`` new tokens of ``text`` at a time for every prompt and sample."""
    ids = tok.encode(text, add_special_tokens=False)
    return [(tag, RequestOutput("r", [5, 6, 7], [CompletionOutput(i, ids[k:k + step], [-0.5] * len(ids[k:k + step]),
                                                                  None, None, [tag + i] * len(ids[k:k + step]))
                                                 for i in range(n)]), False)
            for k in range(0, len(ids), step) for tag in range(prompts)]


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("ids", [None, False])
def test_partial_chunks_are_the_dict_chunks_json(tok, monkeypatch, chat, ids):
    """Partial chunks are formatted without a dict or json.dumps, byte for byte what the dict path writes."""
    text = 'Stream "quoted" \\ naïve café, 🎉 and\nnew lines.'
    req = (ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], stream=True, n=2,
                                 return_token_ids=ids) if chat
           else CompletionRequest(prompt=[[5, 6, 7], [5, 6, 7]], stream=True, n=2, return_token_ids=ids))
    items = _partials(tok, text, 2, 2)
    fast = StreamChunks(req, 2, 2, 'm "x"', Render(tok, False), chat=chat)
    dumps = []
    monkeypatch.setattr(streaming, "_sse", lambda body: dumps.append(body) or "")
    got = fast.render_items(items)
    assert not dumps and len(got) == len(items) * 2  # no json.dumps per partial chunk
    monkeypatch.undo()
    ref = StreamChunks(req, 2, 2, 'm "x"', Render(tok, False), chat=chat)
    ref.id, ref.created = fast.id, fast.created
    monkeypatch.setattr(StreamChunks, "_partial_event", StreamChunks._dict_event)
    assert got == ref.render_items(items)
    firsts = [json.loads(e[len("data: "):])["choices"][0] for e in got[::4]]  # prompt 0, sample 0
    streamed = "".join(c["delta"]["content"] if chat else c["text"] for c in firsts)
    assert text.startswith(streamed) and len(streamed) >= len(text) - 8


def test_the_default_tokenizer_decodes_through_its_rust_backend_as_decode_does(tok, monkeypatch):
    """Streams decode twice per stream per batch: the fast path skips transformers' per-call overhead, and
    gives what ``tokenizer.decode`` gives (special tokens kept or skipped); other tokenizers use ``decode``."""
    g = torch.Generator().manual_seed(0)
    special = sorted(tok.all_special_ids)
    seqs = [torch.randint(0, tok.vocab_size, (k,), generator=g).tolist() + special[: k % 3] for k in range(1, 40)]
    calls = []
    for kwargs in ({}, {"skip_special_tokens": False}, {"skip_special_tokens": True},
                   {"skip_special_tokens": False, "spaces_between_special_tokens": False},
                   {"spaces_between_special_tokens": False}):  # skip_special_tokens not given: skipped, as finals
        expected = [tok.decode(s, **{"skip_special_tokens": True, **kwargs}) for s in seqs]
        monkeypatch.setattr(tok, "decode", lambda *a, **k: calls.append(a) or "")
        assert [streaming.decoder(tok, **kwargs)(s) for s in seqs] == expected and not calls
        monkeypatch.undo()

    class Counting:
        def __init__(self) -> None:
            self.calls = 0

        def decode(self, ids, **kwargs):
            self.calls += 1
            return tok.decode(ids, **kwargs)

    counting = Counting()
    chunks = StreamChunks(CompletionRequest(prompt="x", stream=True), 1, 1, "m", Render(counting, False), chat=False)
    flushes = _partials(tok, "a few words that stream, a few tokens at a time " * 8, 1, 1)
    for item in flushes:
        chunks.render_items([item])
    assert counting.calls <= 2 * len(flushes)  # two short decodes per flush, never the whole output


def test_a_batch_of_stream_events_wakes_the_event_loop_once(tok):
    """Partial events are held until the stream thread's batch ends (``AsyncEngine.on_stream_batch``): one
    wake-up of the event loop per batch, not one per stream; a final output wakes it at once."""

    class Loop:
        def __init__(self) -> None:
            self.calls = []

        def call_soon_threadsafe(self, fn):
            self.calls.append(fn)

    aloop = Loop()
    poster = streaming.LoopPoster(aloop)
    req = CompletionRequest(prompt="x", stream=True)
    feeds = [streaming.StreamFeed(poster, 1000, StreamChunks(req, 1, 1, "m", Render(tok, False), chat=False))
             for _ in range(5)]
    for feed in feeds:
        feed.partial(0)(_outputs(tok, "some words", False))
    assert aloop.calls == []
    poster.flush()
    poster.flush()
    assert len(aloop.calls) == 1
    aloop.calls.pop()()
    assert all(feed.events for feed in feeds)
    done = Future()
    done.set_result(_outputs(tok, "some words", True))
    feeds[0].final(0)(done)
    assert len(aloop.calls) == 1
