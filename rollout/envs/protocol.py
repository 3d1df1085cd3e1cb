"""The environment protocol: TRL 1.16's ``environment_factory`` shape, so environments written for TRL run here.

An environment is what a factory (``rollout.env=package.module:factory``, one instance per conversation)
builds:

- ``reset(**row) -> str | None``: called with the dataset row's columns before the first turn; a string is
  appended to the prompt's last user message.
- *tool* environments: every other public method (not ``reset`` / ``get_reward`` / ``step``, no leading
  underscore) is a tool the model may call. Type hints and a Google docstring give its JSON schema (transformers'
  ``get_json_schema``, as ``apply_chat_template(tools=...)`` renders it). Sync or ``async def``.
- *step* environments (free-text answers instead of tool calls) define ``step(completion_text) -> str | None``:
  the next user message, or None to end the conversation. Sync or async.
- optional ``get_reward() -> float`` (sync or async), read when the conversation ends.

Tools are found on the class, as TRL does (``inspect.getmembers(type(env), inspect.isfunction)``), so a
property is never evaluated by the discovery.
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Callable
from typing import Any

RESERVED = ("reset", "step", "get_reward")
_SPEC = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


def load_factory(spec: str, key: str = "rollout.env") -> Callable[[], Any]:
    """``package.module:factory`` -> the factory (a class or a zero-argument callable); errors name ``key``."""
    if not isinstance(spec, str) or not _SPEC.match(spec):
        raise ValueError(f"{key}={spec!r} must be an import path 'package.module:factory' (e.g. "
                         "'rollout.envs.calculator:CalculatorEnv')")
    module, _, attr = spec.partition(":")
    try:
        obj: Any = importlib.import_module(module)
    except ImportError as e:
        raise ValueError(f"{key}={spec!r}: cannot import {module!r}: {e}") from None
    for part in attr.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise ValueError(f"{key}={spec!r}: {module!r} has no attribute {attr!r}")
    if not callable(obj):
        raise ValueError(f"{key}={spec!r} is not callable (a class or a factory function is expected)")
    return obj


def is_async(fn: Callable[..., Any]) -> bool:
    return inspect.iscoroutinefunction(fn)


class EnvSpec:
    """What an environment class offers, read once from a probe instance (as TRL probes its factory)."""

    def __init__(self, factory: Callable[[], Any]) -> None:
        self.factory = factory
        probe = factory()
        cls = type(probe)
        names = {n for n, _ in inspect.getmembers(cls, predicate=inspect.isfunction)}
        if "reset" not in names:
            raise ValueError(f"environment {cls.__name__} must define a callable reset(**row) (TRL's "
                             "environment_factory protocol)")
        self.cls_name = cls.__name__
        self.is_step = "step" in names
        self.has_reward = "get_reward" in names
        self.tool_names = sorted(n for n in names if not n.startswith("_") and n not in RESERVED)
        if not self.is_step and not self.tool_names:
            raise ValueError(f"environment {cls.__name__} has neither tools (public methods) nor step(completion_text)")
        self.schemas = [tool_schema(getattr(probe, n)) for n in self.tool_names] if not self.is_step else []
        self._probe: Any = probe

    def make(self) -> Any:
        """A fresh instance (the probe is handed out first, so it is not wasted)."""
        probe, self._probe = self._probe, None
        return probe if probe is not None else self.factory()


def tool_schema(method: Callable[..., Any]) -> dict[str, Any]:
    """The tool's JSON schema from its type hints and Google docstring (transformers' ``get_json_schema``)."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(method)
    except Exception as e:  # noqa: BLE001 - transformers raises its own DocstringParsingException / TypeHintParsingException
        raise ValueError(f"tool {method.__name__!r}: {e} (a tool needs type hints and a Google docstring with "
                         "an Args: section describing each argument)") from None
