"""Server-sent events for ``stream: true``: one chunk per choice whenever new tokens landed.

The engine loop hands each stream only the tokens landed since its last batch (``server.stream_interval_s``
apart at least), in its stream thread, which renders them into events (``StreamFeed``); one wake-up of the
event loop per batch writes every stream's events. A reader that falls
more than ``server.stream_buffer_tokens`` behind has its requests aborted and gets a final error event,
so a slow or stalled client holds a bounded amount of memory. Each chunk carries the new tokens' text,
``token_ids``, ``logprobs`` and ``policy_versions``; a choice's last chunk carries its ``finish_reason``.
Text is detokenized incrementally (vLLM's prefix / read offsets: only a few tokens
before the new ones are decoded again), holding back a trailing partial character and, when stop strings
are set, the last few characters that could still turn into one, so the streamed text always equals the
final text. A client that goes away aborts its requests.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from rollout.serve import tools as tool_calls
from rollout.serve.responses import Render, chat_logprobs, completion_logprobs, new_id, usage


class LoopPoster:
    """Runs functions on an asyncio event loop from other threads with one wake-up per burst: the stream
    thread posts every stream's events of a batch (``hold``), then wakes the loop once at the batch's end
    (``flush``: ``AsyncEngine.on_stream_batch``). Waking it at the first post instead let the loop run (and
    take the GIL) between streams, as the stream thread yields after each: ~0.7 wake-ups per stream."""

    def __init__(self, aloop: asyncio.AbstractEventLoop) -> None:
        self.aloop = aloop
        self._lock = threading.Lock()
        self._calls: list[Callable[[], None]] = []
        self._scheduled = False

    def hold(self, fn: Callable[[], None]) -> None:
        """Queue ``fn`` for the next ``flush`` (the stream thread, inside a batch)."""
        with self._lock:
            self._calls.append(fn)

    def post(self, fn: Callable[[], None]) -> None:
        """Queue ``fn`` and wake the loop (from any thread)."""
        self.hold(fn)
        self.flush()

    def flush(self) -> None:
        """Wake the loop to run what is queued, unless a wake-up is already on its way."""
        with self._lock:
            if self._scheduled or not self._calls:
                return
            self._scheduled = True
        try:
            self.aloop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the event loop is closed: the server is shutting down
            pass

    def _drain(self) -> None:
        with self._lock:
            calls, self._calls, self._scheduled = self._calls, [], False
        for fn in calls:
            fn()


class StreamFeed:
    """One stream's SSE events. The engine's stream thread renders each batch of new tokens into events
    (``partial`` / ``final`` callbacks: detokenizing and JSON never run in the stepping thread nor on the
    event loop) and posts them; at most ``max_tokens`` unread tokens are held, else the stream is cut off
    (``on_overflow`` aborts its requests) rather than buffered without limit."""

    def __init__(self, poster: LoopPoster, max_tokens: int, chunks: StreamChunks) -> None:
        self.poster, self.max_tokens, self.chunks = poster, max_tokens, chunks
        self.events: list[str] = []
        self.finals = 0
        self.failed: BaseException | None = None
        self.unread = 0
        self.overflowed = False
        self.on_overflow: Callable[[], None] = lambda: None
        self._ready = asyncio.Event()

    def partial(self, tag: int) -> Callable[[Any], None]:
        def landed(out: Any) -> None:  # the stream thread
            if self.overflowed or self.failed is not None:
                return
            events = self.chunks.render_items([(tag, out, False)])
            tokens = sum(len(c.token_ids) for c in out.outputs)
            self.poster.hold(lambda: self._put(events, tokens, False, None))  # flushed at the batch's end

        return landed

    def final(self, tag: int) -> Callable[[Future], None]:
        def done(fut: Future) -> None:  # the stream thread (or the closing one)
            if fut.cancelled():  # the client went away
                return
            exc = fut.exception()
            events = [] if exc is not None or self.overflowed else self.chunks.render_items([(tag, fut.result(), True)])
            self.poster.post(lambda: self._put(events, 0, True, exc))  # also outside a batch (closing): wakes now

        return done

    def _put(self, events: list[str], tokens: int, final: bool, exc: BaseException | None) -> None:
        if self.overflowed:
            return
        self.unread += tokens
        if self.unread > self.max_tokens:
            self.overflowed = True
            self.events.clear()
            self.on_overflow()
        elif exc is not None:
            self.failed = exc
        else:
            self.events += events
            self.finals += final
        self._ready.set()

    async def take(self) -> str:
        """The events posted since the last call, as one string (waits for one, a failure or the overflow)."""
        while not self.events and not self.overflowed and self.failed is None:
            self._ready.clear()
            await self._ready.wait()
        events, self.events, self.unread = self.events, [], 0
        return "".join(events)


@dataclass(slots=True)
class _Choice:
    """What one choice has sent, and the incremental detokenizer's window (ids from the prefix offset on)."""

    tokens: int = 0
    text: int = 0
    started: bool = False
    finished: bool = False
    window: list[int] = field(default_factory=list)
    read: int = 0  # window[:read] was decoded already (it is the context that makes the next piece right)
    pending: str = ""  # decoded, not yet sent (held back: could still become a stop string)


MAX_UNREAD = 8  # tokens held back waiting for a character to complete (UTF-8: at most 4 bytes) before giving up


def _decode_new(decode: Callable[[list[int]], str], s: _Choice, ids: list[int]) -> str:
    """The text ``ids`` add after what ``s`` decoded so far. When they end inside a character, the text the
    longest prefix of them completes (the rest waits for the next batch: several characters can be split over
    byte tokens landing together); "" while none does, for at most ``MAX_UNREAD`` tokens (then the bytes are
    not UTF-8 and go out as the final text has them), so the window, and each step's decode, stays a few tokens
    long. ``decode``: the stream's ``decoder``."""
    s.window += ids
    prefix = decode(s.window[: s.read])
    full, end = decode(s.window), len(s.window)
    if len(full) <= len(prefix) or full.endswith("\ufffd"):
        for k in range(len(s.window) - 1, s.read, -1):
            text = decode(s.window[:k])
            if len(text) > len(prefix) and not text.endswith("\ufffd"):
                full, end = text, k
                break
        else:
            if len(s.window) - s.read < MAX_UNREAD:
                return ""
    s.window, s.read = s.window[s.read :], end - s.read
    return full[len(prefix) :]


def decoder(tokenizer: Any, **decode: Any) -> Callable[[list[int]], str]:
    """``tokenizer.decode(ids, **decode)`` (``decode``: the request's ``skip_special_tokens`` /
    ``spaces_between_special_tokens``; ``skip_special_tokens`` not given: skip, as the final text does), as a
    function of ``ids``.

    Straight through the Rust tokenizer when that is all ``decode`` would run: a fast tokenizer whose
    ``decode`` and ``_decode`` are the library's own and that cleans up no spaces (it ignores
    ``spaces_between_special_tokens``). That costs ~1 us a call instead of ~3 (transformers converts and
    type-checks every id first), and the stream thread decodes twice per stream per batch, holding the GIL
    the stepping thread needs. Any other tokenizer goes through its ``decode``."""
    decode = {"skip_special_tokens": True, **decode}  # the final text's default (SamplingParams) when not given
    if _plain_fast(tokenizer):
        rust, skip = tokenizer.backend_tokenizer, bool(decode.get("skip_special_tokens", False))
        return lambda ids: rust.decode(ids, skip_special_tokens=skip)
    return lambda ids: tokenizer.decode(ids, **decode)


def _plain_fast(tokenizer: Any) -> bool:
    """A transformers fast tokenizer whose ``decode`` is exactly its Rust backend's (see ``decoder``)."""
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        return False
    kind = type(tokenizer)
    return (isinstance(tokenizer, PreTrainedTokenizerFast) and kind.decode is PreTrainedTokenizerFast.decode
            and kind._decode is PreTrainedTokenizerFast._decode
            and not getattr(tokenizer, "clean_up_tokenization_spaces", True))


def _sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body)}\n\n"


_json_str = json.encoder.encode_basestring_ascii  # what json.dumps writes for a str (ensure_ascii)


def _ints(xs: list[int]) -> str:
    """``json.dumps`` of a list of ints (token ids, policy versions)."""
    return "[" + ", ".join(map(str, xs)) + "]"


class StreamChunks:
    """Turns a stream's outputs into SSE chunks; runs in the engine's stream thread (one call at a time)."""

    def __init__(self, req: Any, num_prompts: int, n: int, model: str, render: Render, chat: bool) -> None:
        self.req, self.n, self.model, self.render, self.chat = req, n, model, render, chat
        self.id, self.created = new_id("chatcmpl" if chat else "cmpl"), int(time.time())
        self.obj = "chat.completion.chunk" if chat else "text_completion"
        self.head = (f"data: {{\"id\": {_json_str(self.id)}, \"object\": {_json_str(self.obj)}, "
                     f"\"created\": {self.created}, \"model\": {_json_str(model)}, \"choices\": [")
        stops = [req.stop] if isinstance(req.stop, str) else req.stop or []
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.sent = [[_Choice() for _ in range(n)] for _ in range(num_prompts)]
        self.finals: dict[int, Any] = {}
        self.with_ids = req.return_token_ids is not False
        self.want_lp = bool(req.logprobs) if chat else req.logprobs is not None
        # With tools a call can only be parsed from the whole output: content waits for the last chunk, which
        # carries it and the parsed ``tool_calls`` (ids, logprobs and versions still stream as they land).
        self.tools = chat and bool(getattr(req, "tools", None)) and getattr(req, "tool_choice", None) != "none"
        tok = render.tokenizer
        self.decode = None if tok is None else decoder(tok, **{
            k: v for k in ("skip_special_tokens", "spaces_between_special_tokens")
            if (v := getattr(req, k, None)) is not None})

    def render_items(self, items: list[tuple[int, Any, bool]]) -> list[str]:
        out = []
        for tag, output, final in items:
            if final:
                self.finals[tag] = output
            outs = output.outputs if len(output.outputs) == 1 else sorted(output.outputs, key=lambda c: c.index)
            for c in outs:
                event = self._chunk(tag, output, c, final)
                if event is not None:
                    out.append(event)
        return out

    def _chunk(self, tag: int, output: Any, c: Any, final: bool) -> str | None:
        s = self.sent[tag][c.index]
        if s.finished:
            return None
        skip = s.tokens if final else 0  # a final output is whole; a partial one holds only the new tokens
        ids = c.token_ids[skip:] if skip else c.token_ids
        tok = self.render.tokenizer
        calls: list[dict[str, Any]] = []
        finish = c.finish_reason if final else None
        if final:
            text = (c.text or "")[s.text :]
            if self.tools:
                content, calls = tool_calls.parse(tok, list(c.token_ids), list(output.prompt_token_ids), text,
                                                  self.req.tools)
                text = text if not calls else content or ""
                finish = "tool_calls" if calls and finish == "stop" else finish
        elif self.tools:
            text = ""
        else:
            s.pending += _decode_new(self.decode, s, ids) if self.decode is not None and ids else ""
            text = s.pending[: max(0, len(s.pending) - self.hold)]
            s.pending = s.pending[len(text) :]
        if not ids and not text and not final and s.started:
            return None
        render = self._dict_event if final or self.want_lp else self._partial_event
        event = render(tag, output, c, s, skip, text, finish, calls, final)
        s.tokens, s.text, s.finished, s.started = s.tokens + len(ids), s.text + len(text), final, True
        return event

    def _dict_event(self, tag: int, output: Any, c: Any, s: _Choice, skip: int, text: str, finish: str | None,
                    calls: list[dict[str, Any]], final: bool) -> str:
        """The event of a chunk built as a dict: final chunks and chunks with logprobs (``_partial_event``
        renders the others). ``s``: what the choice sent before this chunk; ``skip``: the output's tokens
        sent before (a final output is whole)."""
        ids, lps, versions = c.token_ids[skip:], c.logprobs[skip:], c.policy_versions[skip:]
        tops = getattr(c, "top_logprobs", None)
        tops = tops[skip:] if tops is not None else None
        choice: dict[str, Any] = {"index": c.index if self.chat else tag * self.n + c.index,
                                  "finish_reason": finish, "stop_reason": c.stop_reason if final else None,
                                  "policy_versions": list(versions)}
        if self.chat:
            choice["delta"] = {"content": text} if s.started else {"content": text, "role": "assistant"}
            if calls:
                choice["delta"]["tool_calls"] = [dict(call, index=i) for i, call in enumerate(calls)]
            choice["logprobs"] = chat_logprobs(self.render, ids, lps, tops) if self.want_lp else None
        else:
            choice["text"] = text
            choice["logprobs"] = (completion_logprobs(self.render, ids, lps, s.text, tops) if self.want_lp
                                  else None)
        chunk = {"id": self.id, "object": self.obj, "created": self.created, "model": self.model,
                 "choices": [choice]}
        if self.with_ids:
            choice["token_ids"] = list(ids)
            if not s.started and not self.chat:
                choice["prompt_token_ids"] = list(output.prompt_token_ids)
            if not s.started and self.chat and tag == 0 and c.index == 0:
                chunk["prompt_token_ids"] = list(output.prompt_token_ids)
        return _sse(chunk)

    def _partial_event(self, tag: int, output: Any, c: Any, s: _Choice, skip: int, text: str, finish: None,
                       calls: list[dict[str, Any]], final: bool) -> str:
        """The event ``_dict_event`` gives for a partial chunk without logprobs (the same keys in the same
        order, json's separators; ``skip`` is 0, ``finish`` None, ``calls`` empty), formatted directly: a
        dict and ``json.dumps`` per chunk were ~1/5 of the stream thread's time, and every stream gets one
        per batch."""
        first, index, quoted = not s.started, c.index, _json_str(text)
        if self.chat:
            body = (f'"delta": {{"content": {quoted}, "role": "assistant"}}' if first
                    else f'"delta": {{"content": {quoted}}}')
        else:
            body = f'"text": {quoted}'
        choice = (f'{{"index": {index if self.chat else tag * self.n + index}, "finish_reason": null, '
                  f'"stop_reason": null, "policy_versions": {_ints(c.policy_versions)}, {body}, "logprobs": null')
        tail = ""
        if self.with_ids:
            choice += f', "token_ids": {_ints(c.token_ids)}'
            if first and not self.chat:
                choice += f', "prompt_token_ids": {_ints(output.prompt_token_ids)}'
            if first and self.chat and tag == 0 and index == 0:
                tail = f', "prompt_token_ids": {_ints(output.prompt_token_ids)}'
        return f"{self.head}{choice}}}]{tail}}}\n\n"

    def usage_chunk(self) -> str:
        outs = [self.finals[i] for i in range(len(self.sent))]
        return _sse({"id": self.id, "object": self.obj, "created": self.created, "model": self.model,
                     "choices": [], "usage": usage(outs)})


def _error(message: str, code: str | int) -> str:
    return _sse({"error": {"message": message, "type": "server_error", "param": None, "code": code}})


async def stream_events(req: Any, feed: StreamFeed, num_prompts: int) -> AsyncIterator[str]:
    """Chunks until every choice finished, then usage (if asked) and ``[DONE]``."""
    try:
        while feed.finals < num_prompts:
            events = await feed.take()
            if feed.overflowed:
                yield _error(f"stream aborted: the client read too slowly (more than {feed.max_tokens} tokens "
                             "unread; server.stream_buffer_tokens)", "slow_reader")
                return
            if feed.failed is not None:
                yield events + _error(f"generation failed: {feed.failed}", 500)
                return
            yield events
        if req.stream_options is not None and req.stream_options.include_usage:
            yield feed.chunks.usage_chunk()
        yield "data: [DONE]\n\n"
    finally:
        if feed.finals < num_prompts:
            feed.on_overflow()
