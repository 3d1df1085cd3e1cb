"""How stale a group is (partial rollouts), in one place for the actor, ``TRLRollout`` and the async-GRPO worker.

A group's staleness is the number of policy versions between its oldest token and the weights serving now
(0 for a group with no tokens yet): the off-policyness a trainer takes on when it trains on the group.
``max_staleness`` bounds it when a group is handed out; a group over it is dropped (counted) or regenerated.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

STALE_POLICIES = ("drop", "regenerate")


def staleness(out: Any, current_version: int) -> int:
    """Versions between the oldest token of ``out`` (a ``RequestOutput``) and ``current_version``."""
    versions = [v for c in out.outputs for v in c.policy_versions]
    return max(0, current_version - min(versions)) if versions else 0


def too_stale(out: Any, current_version: int, max_staleness: int | None) -> bool:
    return max_staleness is not None and staleness(out, current_version) > max_staleness


def stale_running(engine: Any, request_ids: Iterable[str], max_staleness: int | None) -> list[str]:
    """The running requests already over ``max_staleness`` (after new weights): generating on is wasted work."""
    if max_staleness is None:
        return []
    stale = []
    for rid in request_ids:
        out = engine.partial_output(rid)
        if out is not None and too_stale(out, engine.policy_version, max_staleness):
            stale.append(rid)
    return stale


def carried_tokens(engine: Any, request_ids: Iterable[str]) -> int:
    """Tokens the running requests already hold (what is carried over into the next round or call)."""
    total = 0
    for rid in request_ids:
        out = engine.partial_output(rid)
        total += sum(len(c.token_ids) for c in out.outputs) if out is not None else 0
    return total


def check_max_staleness(value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ValueError(f"max_staleness={value!r} is invalid: must be an int >= 0 or None")


def check_stale_groups(value: Any) -> None:
    if value not in STALE_POLICIES:
        raise ValueError(f"stale_groups={value!r} is invalid: must be one of {list(STALE_POLICIES)}")
