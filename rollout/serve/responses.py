"""Response bodies in OpenAI / vLLM shape, built from the engine's ``RequestOutput``s.

Every choice carries the RL extras: ``token_ids`` (vLLM's ``return_token_ids``, on unless switched off),
``policy_versions`` (the weight version of each token) and ``stop_reason``; completions also carry
``prompt_token_ids`` per choice, chat carries it at the top level (both as vLLM does). ``logprobs`` are
the engine's per-token numbers (``logprobs_mode``), in the legacy completions shape or chat's ``content``
list; the alternatives (``logprobs=k`` / ``top_logprobs=k``) are the engine's ``top_logprobs``, from the
same distribution as the sampled token's number. ``prompt_logprobs`` is vLLM's per-position dict list.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from rollout.serve import tools as tool_calls

Tops = list[Any] | None  # per token: [(token_id, logprob), ...] most likely first, or None


class Render:
    """Token strings for logprobs: ``token_id:<id>`` when asked (TRL does), else the decoded token."""

    def __init__(self, tokenizer: Any, as_ids: bool | None) -> None:
        self.tokenizer, self.as_ids = tokenizer, bool(as_ids)

    def token(self, tid: int) -> str:
        if self.as_ids or self.tokenizer is None:
            return f"token_id:{tid}"
        return self.tokenizer.decode([tid])

    def text(self, ids: list[int]) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode(ids)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _tops(tops: Tops, i: int) -> list[tuple[int, float]]:
    if tops is None or i >= len(tops) or tops[i] is None:
        return []
    return [(int(t), float(lp)) for t, lp in tops[i]]


def completion_logprobs(render: Render, ids: list[int], lps: list[Any], offset: int = 0, tops: Tops = None
                        ) -> dict[str, Any]:
    tokens = [render.token(t) for t in ids]
    offsets, pos = [], offset
    for tok in tokens:
        offsets.append(pos)
        pos += len(tok)
    top = []
    for i, (tok, lp) in enumerate(zip(tokens, lps)):
        if lp is None:  # the first prompt token (echo): nothing came before it
            top.append(None)
            continue
        alts = {render.token(t): a for t, a in _tops(tops, i)}
        top.append({tok: lp, **{k: v for k, v in alts.items() if k != tok}})
    return {"tokens": tokens, "token_logprobs": list(lps), "top_logprobs": top, "text_offset": offsets}


def chat_logprobs(render: Render, ids: list[int], lps: list[float], tops: Tops = None) -> dict[str, Any]:
    content = []
    for i, (t, lp) in enumerate(zip(ids, lps)):
        tok = render.token(t)
        alts = [{"token": (s := render.token(a)), "logprob": alp, "bytes": list(s.encode())}
                for a, alp in _tops(tops, i)]
        content.append({"token": tok, "logprob": lp, "bytes": list(tok.encode()), "top_logprobs": alts})
    return {"content": content}


def prompt_logprobs(render: Render, out: Any) -> list[Any] | None:
    """vLLM's ``prompt_logprobs``: per prompt position None (the first) or {id: {logprob, rank, decoded_token}},
    the prompt's own token plus the top alternatives."""
    lps = getattr(out, "prompt_logprobs", None)
    if lps is None:
        return None
    tops = getattr(out, "prompt_top_logprobs", None)
    body: list[Any] = []
    for i, (tid, lp) in enumerate(zip(out.prompt_token_ids, lps)):
        if lp is None:
            body.append(None)
            continue
        alts = _tops(tops, i)
        entry = {str(t): {"logprob": a, "rank": r + 1, "decoded_token": render.token(t)} for r, (t, a) in
                 enumerate(alts)}
        if str(tid) not in entry:
            rank = 1 + sum(a > lp for _, a in alts)  # exact when the prompt token is within the top k
            entry[str(tid)] = {"logprob": lp, "rank": rank, "decoded_token": render.token(tid)}
        body.append(entry)
    return body


def usage(outs: list[Any]) -> dict[str, Any]:
    """OpenAI's usage; ``prompt_tokens_details.cached_tokens``: prompt tokens the prefix cache held."""
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    completion = sum(len(c.token_ids) for o in outs for c in o.outputs)
    cached = sum(int(getattr(o, "num_cached_tokens", 0) or 0) for o in outs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def completion_body(req: Any, outs: list[Any], model: str, render: Render, echo_only: bool = False
                    ) -> dict[str, Any]:
    """``echo_only`` (echo with max_tokens=0): the one token generated to score the prompt is dropped."""
    n = len(outs[0].outputs)
    with_ids = req.return_token_ids is not False
    choices = []
    for i, out in enumerate(outs):
        prompt_text = render.text(out.prompt_token_ids) if req.echo else ""
        for c in sorted(out.outputs, key=lambda c: c.index):
            ids, lps, tops, text = list(c.token_ids), list(c.logprobs), getattr(c, "top_logprobs", None), c.text or ""
            if echo_only:
                ids, lps, tops, text = [], [], [], ""
            if req.echo:
                p_lps = getattr(out, "prompt_logprobs", None) or [None] * len(out.prompt_token_ids)
                p_tops = getattr(out, "prompt_top_logprobs", None) or [None] * len(out.prompt_token_ids)
                ids, lps = list(out.prompt_token_ids) + ids, list(p_lps) + lps
                tops, text = list(p_tops) + list(tops or [None] * len(c.token_ids)), prompt_text + text
            choice: dict[str, Any] = {
                "index": i * n + c.index, "text": text, "finish_reason": "length" if echo_only else c.finish_reason,
                "stop_reason": c.stop_reason, "policy_versions": list(c.policy_versions),
                "logprobs": completion_logprobs(render, ids, lps, tops=tops) if req.logprobs is not None else None,
                "prompt_logprobs": prompt_logprobs(render, out),
            }
            if with_ids:
                choice["token_ids"] = [] if echo_only else list(c.token_ids)
                choice["prompt_token_ids"] = list(out.prompt_token_ids)
            choices.append(choice)
    body = {"id": new_id("cmpl"), "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage(outs)}
    if echo_only:
        body["usage"]["completion_tokens"] = 0
        body["usage"]["total_tokens"] = body["usage"]["prompt_tokens"]
    return body


def chat_body(req: Any, out: Any, model: str, render: Render) -> dict[str, Any]:
    with_ids = req.return_token_ids is not False
    echo = ""
    if req.echo and req.messages[-1].role == "assistant":  # vLLM: the continued message comes back whole
        echo = req.messages[-1].as_template_dict().get("content") or ""
    choices = []
    for c in sorted(out.outputs, key=lambda c: c.index):
        message: dict[str, Any] = {"role": "assistant", "content": echo + (c.text or "")}
        finish = c.finish_reason
        if req.tools and req.tool_choice != "none":  # OpenAI's default with tools is 'auto'
            content, calls = tool_calls.parse(render.tokenizer, list(c.token_ids), list(out.prompt_token_ids),
                                              c.text or "", req.tools)
            if calls:
                message = {"role": "assistant", "content": content, "tool_calls": calls}
                finish = "tool_calls" if c.finish_reason == "stop" else c.finish_reason
        choice: dict[str, Any] = {
            "index": c.index, "message": message, "finish_reason": finish, "stop_reason": c.stop_reason,
            "policy_versions": list(c.policy_versions),
            "logprobs": chat_logprobs(render, c.token_ids, c.logprobs, getattr(c, "top_logprobs", None))
            if req.logprobs else None,
        }
        if with_ids:
            choice["token_ids"] = list(c.token_ids)
        choices.append(choice)
    body = {"id": new_id("chatcmpl"), "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage([out])}
    if with_ids:
        body["prompt_token_ids"] = list(out.prompt_token_ids)
    if getattr(out, "prompt_logprobs", None) is not None:
        body["prompt_logprobs"] = prompt_logprobs(render, out)
    return body
