"""Tool calls parsed out of a chat completion, returned in OpenAI's shape.

The tokenizer's own response template comes first (transformers' ``parse_response``, as TRL parses its
rollouts); a tokenizer without one falls back to the Hermes convention most open models were trained on,
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``. Text that parses as no call stays content.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse(tokenizer: Any, token_ids: list[int], prompt_ids: list[int], text: str,
          tools: list[dict[str, Any]] | None) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls in OpenAI's shape); no calls found -> (text, [])."""
    message = _with_template(tokenizer, token_ids, prompt_ids, tools)
    if message is None:
        message = hermes(text)
    calls = [_openai_call(c) for c in message.get("tool_calls") or ()]
    calls = [c for c in calls if c is not None]
    if not calls:
        return text, []
    content = message.get("content")
    return (content if isinstance(content, str) and content.strip() else None), calls


def _with_template(tokenizer: Any, token_ids: list[int], prompt_ids: list[int], tools: Any) -> dict | None:
    if tokenizer is None or not (getattr(tokenizer, "response_template", None)
                                 or getattr(tokenizer, "response_schema", None)):
        return None
    try:
        try:
            parsed = tokenizer.parse_response(token_ids, prefix=prompt_ids, tools=tools)
        except TypeError:  # transformers before ``prefix=`` (response_schema)
            parsed = tokenizer.parse_response(token_ids)
    except Exception:  # noqa: BLE001 - a malformed call is plain text, as TRL treats it
        return None
    return parsed if isinstance(parsed, dict) else None


def hermes(text: str) -> dict[str, Any]:
    """``{"content", "tool_calls"}`` from Hermes-style ``<tool_call>`` blocks (unparsable blocks stay text)."""
    calls, kept, pos = [], [], 0
    for m in HERMES.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except ValueError:
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            continue
        kept.append(text[pos:m.start()])
        pos = m.end()
        calls.append({"type": "function", "function": {"name": obj["name"],
                                                       "arguments": obj.get("arguments", obj.get("parameters", {}))}})
    kept.append(text[pos:])
    return {"role": "assistant", "content": "".join(kept).strip(), "tool_calls": calls}


def _openai_call(call: Any) -> dict[str, Any] | None:
    if not isinstance(call, dict):
        return None
    fn = call.get("function", call)
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        return None
    args = fn.get("arguments", {})
    if not isinstance(args, str):
        args = json.dumps(args, ensure_ascii=False)
    return {"id": call.get("id") or f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": args}}
