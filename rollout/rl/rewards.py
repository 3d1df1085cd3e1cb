"""Rewards: shipped ones by name, a user's by import path (``my_pkg.rewards:score``).

Two shapes, because the main job scores one completion at a time and the trainers score batches:

- a *shipped* reward is ``(completion_text, answer) -> float`` (``REWARDS``);
- a *plug-in* reward has TRL's reward-function signature,
  ``fn(prompts, completions, completion_ids, **dataset_columns) -> list[float | None]``, so the same
  function works in ``GRPOTrainer(reward_funcs=[fn])``, in the training scripts and in the main job.

``load_reward(spec)`` gives the batch (TRL) form of either; ``get_reward_fn(spec)`` gives the per-sample
form the main job's actor calls. A spec is a shipped name or ``module.path:function``; anything else is a
ValueError listing what exists.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

RewardFn = Callable[..., float]  # (completion_text, answer, **optional context) -> float
BatchReward = Callable[..., list[Any]]  # TRL's signature

# An optionally signed integer, allowing thousands separators ("1,234") as people write them.
_INT = re.compile(r"-?\d[\d,]*")
_PATH = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")


def last_integer(text: str) -> int | None:
    """The last integer in ``text``, or None: models usually state the final answer last."""
    matches = _INT.findall(text)
    if not matches:
        return None
    digits = matches[-1].replace(",", "")
    return int(digits) if digits.lstrip("-") else None


def exact_match(completion: str, answer: str | None) -> float:
    """1.0 when the completion's last integer equals the answer's integer, else 0.0.

    A missing answer or one that is not an integer scores 0.0 rather than raising, so one odd row
    never stops a round.
    """
    if answer is None:
        return 0.0
    want = last_integer(str(answer))
    got = last_integer(completion)
    return 1.0 if want is not None and got == want else 0.0


def digit_fraction(completion: str, answer: str | None = None) -> float:
    """Share of non-space characters that are digits: an "answer-shaped output" reward that a random-init
    model learns within minutes (exact match would take far longer), for demos and smoke runs."""
    chars = [ch for ch in completion if not ch.isspace()]
    return sum(ch.isdigit() for ch in chars) / len(chars) if chars else 0.0


REWARDS: Mapping[str, RewardFn] = MappingProxyType({"exact_match": exact_match, "digit_fraction": digit_fraction})
NEEDS_ANSWER = frozenset({"exact_match"})  # shipped rewards that score against the data's answer column


def allowed_rewards() -> str:
    return f"one of {sorted(REWARDS)}, an import path 'package.module:function' (TRL reward signature)"


def check_reward_spec(spec: object, key: str = "rollout.reward") -> None:
    """Validate a spec's form without importing anything (config time); ``load_reward`` imports it."""
    if isinstance(spec, str) and (spec in REWARDS or _PATH.match(spec)):
        return
    raise ValueError(f"{key}={spec!r} is invalid: must be {allowed_rewards()} or null")


def is_import_path(spec: str) -> bool:
    return ":" in spec


def load_reward(spec: str, key: str = "rollout.reward") -> BatchReward:
    """The reward ``spec`` names, in TRL's batch signature (shipped rewards are wrapped)."""
    check_reward_spec(spec, key)
    if spec in REWARDS:
        return trl_reward(REWARDS[spec], spec)
    module_name, attr = spec.split(":", 1)
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{key}={spec!r}: cannot import module {module_name!r} ({e}); "
                         f"must be {allowed_rewards()}") from None
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ValueError(f"{key}={spec!r}: module {module_name!r} has no attribute {attr!r}; "
                             f"must be {allowed_rewards()}")
        target = getattr(target, part)
    if not callable(target):
        raise ValueError(f"{key}={spec!r} is not callable (got {type(target).__name__})")
    return target


def get_reward_fn(spec: str | None) -> RewardFn | None:
    """Per-sample form for the main job: ``fn(completion_text, answer, prompt=None, completion_ids=None)``.

    None means no reward. A plug-in (TRL-signature) reward is called with a batch of one; its None
    (TRL's "unscorable") comes back as None.
    """
    if spec is None:
        return None
    check_reward_spec(spec)
    if spec in REWARDS:
        return REWARDS[spec]
    batch = load_reward(spec)

    def one(completion: str, answer: str | None = None, prompt: Any = None,
            completion_ids: list[int] | None = None) -> float | None:
        out = batch(prompts=[prompt], completions=[completion], completion_ids=[completion_ids or []],
                    answer=[answer])
        value = out[0] if out else None
        return None if value is None else float(value)  # None: unscorable, as in TRL

    one.__name__ = getattr(batch, "__name__", spec)
    return one


# ---- TRL's calling convention --------------------------------------------------------------------------
def completion_text(completion: Any) -> str:
    """A TRL completion as text: a string, or the content of chat messages."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list):
        return "".join(str(m.get("content", "")) for m in completion if isinstance(m, dict))
    return str(completion)


def trl_reward(fn: RewardFn, name: str | None = None) -> BatchReward:
    """Wrap a ``(completion_text, answer) -> float`` reward for TRL; the dataset's ``answer`` column
    arrives as a keyword argument."""

    def reward(prompts: list[Any], completions: list[Any], answer: list[Any] | None = None, **_: Any) -> list[float]:
        answers = answer if answer is not None else [None] * len(completions)
        return [float(fn(completion_text(c), None if a is None else str(a))) for c, a in zip(completions, answers)]

    reward.__name__ = name or getattr(fn, "__name__", "reward")
    return reward
