"""Reward functions: ``(completion_text, answer) -> float``, looked up by the name in ``rollout.reward``."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from types import MappingProxyType

RewardFn = Callable[[str, "str | None"], float]

# An optionally signed integer, allowing thousands separators ("1,234") as people write them.
_INT = re.compile(r"-?\d[\d,]*")


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


REWARDS: Mapping[str, RewardFn] = MappingProxyType({"exact_match": exact_match})


def get_reward_fn(name: str | None) -> RewardFn | None:
    """None means no reward; an unknown name is a ValueError listing the known ones."""
    if name is None:
        return None
    if name not in REWARDS:
        raise ValueError(f"rollout.reward={name!r} is invalid: must be one of {sorted(REWARDS)} or null")
    return REWARDS[name]
