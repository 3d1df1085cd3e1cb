"""The groups of partial rollouts, kept across rounds (the job's actor) or calls (TRL, the async-GRPO worker).

A group is one engine request with ``n`` samples of one prompt. It is admitted with its own sampling params
(its seed), runs, finishes and is handed out oldest first, or, when its oldest token is more than
``max_staleness`` policy versions behind the weights, discarded: dropped (counted) or queued to regenerate
(``stale_groups``). What is neither handed out nor dropped is carried over. One tracker per owner; the owner
steps the engine and decides how many groups to admit and to hand out.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from rollout.rl.metrics import RoundTrace
from rollout.rl.staleness import (
    carried_tokens,
    check_max_staleness,
    check_stale_groups,
    stale_running,
    staleness,
    too_stale,
)

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Group:
    group_id: int  # the owner's position of the group in its prompt stream
    prompt: Any = None  # the owner's prompt (a job Prompt, TRL's prompt, a dataset row's "prompt")
    prompt_ids: tuple[int, ...] | list[int] = ()
    columns: dict[str, Any] | None = None  # the row's other dataset columns, where the owner keeps them
    request_id: str = ""
    output: Any = None  # the finished RequestOutput
    round: int | None = None  # the round (or call) that admitted it: its seed derives from it


class GroupTracker:
    """Groups admitted and not yet handed out or dropped (``groups``): running in the engine (``running``, by
    request id), finished (``ready``) or waiting to be admitted again (``regenerate``, oldest discard first)."""

    def __init__(self, engine: Any, max_staleness: int | None = None, stale_groups: str = "drop") -> None:
        check_max_staleness(max_staleness)
        check_stale_groups(stale_groups)
        self.engine, self.max_staleness, self.stale_groups = engine, max_staleness, stale_groups
        self.groups: dict[int, Group] = {}
        self.running: dict[str, Group] = {}
        self.ready: list[Group] = []
        self.regenerate: list[Group] = []

    def admit(self, group: Group, params: Any, request_id: str) -> Group:
        """Submit ``group`` as one request; an engine refusal (e.g. a prompt too long) raises, recording nothing."""
        self.engine.add_request(list(group.prompt_ids), params, request_id)
        group.request_id, group.output = request_id, None
        self.groups[group.group_id] = group
        self.running[request_id] = group
        return group

    def queue(self, group: Group) -> None:
        """Hold ``group`` for admission later (a resumed run's groups that were in flight)."""
        self.groups[group.group_id] = group
        self.regenerate.append(group)

    def collect(self, outputs: list[Any]) -> list[Group]:
        """The groups a step finished, now ready; outputs of requests no longer tracked (stopped) are ignored."""
        done = []
        for out in outputs:
            group = self.running.pop(out.request_id, None)
            if group is not None:
                group.output = out
                done.append(group)
        self.ready.extend(done)
        return done

    def take(self, wanted: int, trace: RoundTrace) -> list[Group]:
        """Up to ``wanted`` finished groups, oldest first, each one's staleness in ``trace``; the too stale are
        discarded on the way, the rest wait."""
        handed: list[Group] = []
        self.ready.sort(key=lambda g: g.group_id)
        while self.ready and len(handed) < wanted:
            group = self.ready.pop(0)
            if too_stale(group.output, self.engine.policy_version, self.max_staleness):
                self.discard(group, trace)
                continue
            trace.staleness.append(staleness(group.output, self.engine.policy_version))
            del self.groups[group.group_id]
            handed.append(group)
        return handed

    def stop_stale(self, trace: RoundTrace) -> list[str]:
        """After new weights: abort the running groups already over ``max_staleness`` (finishing them is wasted
        work) and discard them; returns their request ids."""
        stale = stale_running(self.engine, self.running, self.max_staleness)
        for request_id in stale:
            self.engine.abort(request_id)  # its "abort" output comes back from a later step and is ignored
            self.discard(self.running.pop(request_id), trace)
        return stale

    def discard(self, group: Group, trace: RoundTrace) -> None:
        log.info("group %d is over max_staleness=%s: %s", group.group_id, self.max_staleness,
                 "regenerated" if self.stale_groups == "regenerate" else "dropped")
        if self.stale_groups == "regenerate":
            trace.regenerated_groups += 1
            self.regenerate.append(group)
        else:
            trace.dropped_groups += 1
            del self.groups[group.group_id]

    def carry_over(self, trace: RoundTrace) -> None:
        """Count in ``trace`` the groups not handed out (they continue) and the tokens the running ones hold."""
        trace.carried_over_groups = len(self.groups)
        trace.carried_over_tokens = carried_tokens(self.engine, self.running)

    def withdraw(self) -> None:
        """Abort every running group (forgotten, never handed out) and collect the aborted outputs."""
        for request_id, group in self.running.items():
            self.engine.abort(request_id)
            self.groups.pop(group.group_id, None)
        self.running.clear()
        while self.engine.has_unfinished_requests():
            self.engine.step()
