"""Response bodies in OpenAI / vLLM shape, built from the engine's ``RequestOutput``s.

Every choice carries the RL extras: ``token_ids`` (vLLM's ``return_token_ids``, on unless switched off),
``policy_versions`` (the weight version of each token) and ``stop_reason``; completions also carry
``prompt_token_ids`` per choice, chat carries it at the top level (both as vLLM does). ``logprobs`` are
the engine's per-token numbers (``logprobs_mode``), in the legacy completions shape or chat's ``content``
list, with the sampled token as the only alternative.
"""

from __future__ import annotations

import time
import uuid
from typing import Any


class Render:
    """Token strings for logprobs: ``token_id:<id>`` when asked (TRL does), else the decoded token."""

    def __init__(self, tokenizer: Any, as_ids: bool) -> None:
        self.tokenizer, self.as_ids = tokenizer, as_ids

    def token(self, tid: int) -> str:
        if self.as_ids or self.tokenizer is None:
            return f"token_id:{tid}"
        return self.tokenizer.decode([tid])


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def completion_logprobs(render: Render, ids: list[int], lps: list[float], offset: int = 0) -> dict[str, Any]:
    tokens = [render.token(t) for t in ids]
    offsets, pos = [], offset
    for tok in tokens:
        offsets.append(pos)
        pos += len(tok)
    return {"tokens": tokens, "token_logprobs": list(lps),
            "top_logprobs": [{tok: lp} for tok, lp in zip(tokens, lps)], "text_offset": offsets}


def chat_logprobs(render: Render, ids: list[int], lps: list[float]) -> dict[str, Any]:
    content = []
    for t, lp in zip(ids, lps):
        tok = render.token(t)
        content.append({"token": tok, "logprob": lp, "bytes": list(tok.encode()), "top_logprobs": []})
    return {"content": content}


def usage(outs: list[Any]) -> dict[str, int]:
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    completion = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def completion_body(req: Any, outs: list[Any], model: str, render: Render) -> dict[str, Any]:
    n = len(outs[0].outputs)
    with_ids = req.return_token_ids is not False
    choices = []
    for i, out in enumerate(outs):
        for c in sorted(out.outputs, key=lambda c: c.index):
            choice: dict[str, Any] = {
                "index": i * n + c.index, "text": c.text or "", "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason, "policy_versions": list(c.policy_versions),
                "logprobs": completion_logprobs(render, c.token_ids, c.logprobs) if req.logprobs is not None
                else None,
            }
            if with_ids:
                choice["token_ids"] = list(c.token_ids)
                choice["prompt_token_ids"] = list(out.prompt_token_ids)
            choices.append(choice)
    return {"id": new_id("cmpl"), "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage(outs)}


def chat_body(req: Any, out: Any, model: str, render: Render) -> dict[str, Any]:
    with_ids = req.return_token_ids is not False
    choices = []
    for c in sorted(out.outputs, key=lambda c: c.index):
        choice: dict[str, Any] = {
            "index": c.index, "message": {"role": "assistant", "content": c.text or ""},
            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
            "policy_versions": list(c.policy_versions),
            "logprobs": chat_logprobs(render, c.token_ids, c.logprobs) if req.logprobs else None,
        }
        if with_ids:
            choice["token_ids"] = list(c.token_ids)
        choices.append(choice)
    body = {"id": new_id("chatcmpl"), "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage([out])}
    if with_ids:
        body["prompt_token_ids"] = list(out.prompt_token_ids)
    return body
