"""Server-sent events for ``stream: true``: one chunk per choice whenever new tokens landed.

Each chunk carries the new tokens' text, ``token_ids``, ``logprobs`` and ``policy_versions``; a choice's
last chunk carries its ``finish_reason``. Text is sent as the difference between successive decodes of
the tokens so far, holding back a trailing partial character (U+FFFD) and, when stop strings are set,
the last few characters that could still turn into one, so the streamed text always equals the final
text. A client that goes away aborts its requests.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from rollout.serve.responses import Render, chat_logprobs, completion_logprobs, new_id, usage


@dataclass(slots=True)
class _Sent:
    tokens: int = 0
    text: int = 0
    started: bool = False
    finished: bool = False


def _sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body)}\n\n"


def _safe_text(text: str, final: bool, hold: int) -> str:
    if final:
        return text
    text = text.rstrip("\ufffd")
    return text[: max(0, len(text) - hold)] if hold else text


async def stream_events(req: Any, queue: asyncio.Queue, num_prompts: int, n: int, model: str, render: Render,
                        chat: bool, abort: Callable[[], None]) -> AsyncIterator[str]:
    """Chunks until every choice finished, then usage (if asked) and ``[DONE]``."""
    rid, created = new_id("chatcmpl" if chat else "cmpl"), int(time.time())
    obj = "chat.completion.chunk" if chat else "text_completion"
    hold = max((len(s) for s in ([req.stop] if isinstance(req.stop, str) else req.stop or [])), default=1) - 1
    sent = [[_Sent() for _ in range(n)] for _ in range(num_prompts)]
    finals: dict[int, Any] = {}
    with_ids = req.return_token_ids is not False
    want_lp = bool(req.logprobs) if chat else req.logprobs is not None
    try:
        while len(finals) < num_prompts:
            tag, out, final = await queue.get()
            if isinstance(out, BaseException):
                yield _sse({"error": {"message": f"generation failed: {out}", "type": "server_error", "code": 500}})
                return
            if final:
                finals[tag] = out
            choices = []
            for c in sorted(out.outputs, key=lambda c: c.index):
                s = sent[tag][c.index]
                if s.finished:
                    continue
                done = final or c.finish_reason is not None
                text = _safe_text(c.text or "", done, hold)
                ids, lps = c.token_ids[s.tokens :], c.logprobs[s.tokens :]
                delta_text = text[s.text :] if len(text) > s.text else ""
                if not ids and not delta_text and not done and s.started:
                    continue
                choice: dict[str, Any] = {"index": tag * n + c.index if not chat else c.index,
                                          "finish_reason": c.finish_reason if done else None,
                                          "stop_reason": c.stop_reason if done else None,
                                          "policy_versions": list(c.policy_versions[s.tokens :])}
                if chat:
                    delta: dict[str, Any] = {"content": delta_text}
                    if not s.started:
                        delta["role"] = "assistant"
                    choice["delta"] = delta
                    choice["logprobs"] = chat_logprobs(render, ids, lps) if want_lp else None
                else:
                    choice["text"] = delta_text
                    choice["logprobs"] = completion_logprobs(render, ids, lps, s.text) if want_lp else None
                if with_ids:
                    choice["token_ids"] = list(ids)
                    if not s.started and not chat:
                        choice["prompt_token_ids"] = list(out.prompt_token_ids)
                s.tokens, s.text, s.finished = len(c.token_ids), max(s.text, len(text)), done
                first = not s.started
                s.started = True
                chunk = {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}
                if chat and first and with_ids and tag == 0 and c.index == 0:
                    chunk["prompt_token_ids"] = list(out.prompt_token_ids)
                choices.append(chunk)
            for chunk in choices:
                yield _sse(chunk)
        if req.stream_options is not None and req.stream_options.include_usage:
            outs = [finals[i] for i in range(num_prompts)]
            yield _sse({"id": rid, "object": obj, "created": created, "model": model, "choices": [],
                        "usage": usage(outs)})
        yield "data: [DONE]\n\n"
    finally:
        if len(finals) < num_prompts:
            abort()
