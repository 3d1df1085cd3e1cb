"""Tool calls out of a model turn: the tokenizer's response schema when it has one (transformers'
``parse_response``, as TRL does), else the Hermes / Qwen form ``<tool_call>{"name": ..., "arguments": {...}}
</tool_call>`` that most tool-calling chat templates share.

A call is ``{"name": str, "arguments": dict}``; a malformed one is ``{"name": ..., "error": str}`` so the
environment loop reports it to the model as the tool's error message (a failure, as TRL counts it).
"""

from __future__ import annotations

import json
import re
from typing import Any

_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_tool_calls(tokenizer: Any, text: str, ids: list[int] | None = None, prefix: list[int] | None = None,
                     tools: list[Any] | None = None) -> list[dict[str, Any]]:
    """The turn's tool calls, in order (empty: the turn calls no tool, which ends a tool conversation).

    ``ids``: the turn's tokens (the schema needs its special tokens, which ``text`` may have lost); ``prefix``: the
    tokens before the turn (its template-written opening, e.g. the assistant header), as transformers asks."""
    if tokenizer is not None and (getattr(tokenizer, "response_schema", None) is not None
                                  or getattr(tokenizer, "response_template", None) is not None):
        try:
            parsed = tokenizer.parse_response(ids if ids is not None else text, prefix=prefix or [], tools=tools)
            return [_from_schema(c) for c in (parsed.get("tool_calls") or [])]
        except Exception:  # noqa: BLE001 - a malformed response: fall back to the plain form, as TRL falls back to text
            pass
    return [_from_json(m) for m in _CALL.findall(text)]


def _from_schema(call: dict[str, Any]) -> dict[str, Any]:
    fn = call.get("function", call)
    return _checked(fn.get("name"), fn.get("arguments"))


def _from_json(body: str) -> dict[str, Any]:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return {"name": "unknown", "error": f"the tool call is not valid JSON: {e}"}
    if not isinstance(obj, dict):
        return {"name": "unknown", "error": "the tool call must be a JSON object with name and arguments"}
    return _checked(obj.get("name"), obj.get("arguments", obj.get("parameters", {})))


def _checked(name: Any, arguments: Any) -> dict[str, Any]:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if not isinstance(name, str) or not name:
        return {"name": "unknown", "error": "the tool call has no function name"}
    if not isinstance(arguments, dict):
        return {"name": name, "error": f"the arguments of {name} must be a JSON object, got {arguments!r:.100}"}
    return {"name": name, "arguments": arguments}
