"""GroupTracker (rollout.rl.groups): the partial-rollout group bookkeeping the job's actor, TRLRollout's partial
mode and the async-GRPO worker share, on the scripted engine."""

from __future__ import annotations

import pytest

from rollout.rl.groups import Group, GroupTracker
from rollout.rl.metrics import RoundTrace
from rollout.sampling_params import SamplingParams
from tests.job_fakes import FakeEngine

PARAMS = SamplingParams(n=2, max_tokens=8)


def _admit(tracker: GroupTracker, ids: list[int]) -> None:
    for g in ids:
        tracker.admit(Group(g, f"prompt {g}", [1] * (g + 1)), PARAMS, f"group{g}")


def _step_until_ready(tracker: GroupTracker, count: int) -> None:
    while len(tracker.ready) < count:
        tracker.collect(tracker.engine.step())


def test_hands_out_oldest_first_and_carries_the_rest_over() -> None:
    engine = FakeEngine(length=lambda prompt, i: 6 - len(prompt))  # later groups (longer prompts) finish first
    tracker = GroupTracker(engine)
    _admit(tracker, [0, 1, 2, 3])
    _step_until_ready(tracker, 2)
    trace = RoundTrace(0.0)
    handed = tracker.take(1, trace)
    assert [g.group_id for g in handed] == [min(g.group_id for g in [*handed, *tracker.ready])]
    assert handed[0].output is not None and trace.staleness == [0]
    tracker.carry_over(trace)
    assert trace.carried_over_groups == 3 == len(tracker.groups)
    assert trace.carried_over_tokens == sum(len(c.token_ids) for rid in tracker.running
                                            for c in engine.partial_output(rid).outputs)
    assert handed[0].group_id not in tracker.groups


@pytest.mark.parametrize("policy", ["drop", "regenerate"])
def test_stale_groups_are_dropped_or_queued_to_regenerate(policy: str) -> None:
    engine = FakeEngine(length=lambda prompt, i: 1 if len(prompt) == 1 else 50)
    tracker = GroupTracker(engine, max_staleness=0, stale_groups=policy)
    _admit(tracker, [0, 1])
    tracker.collect(engine.step())  # group 0 finishes under version 0, group 1 keeps running
    engine.update_weights({}, version=1)
    trace = RoundTrace(0.0)
    assert tracker.stop_stale(trace) == ["group1"] and not tracker.running
    assert tracker.take(2, trace) == []  # group 0 is a version behind too
    regenerated = policy == "regenerate"
    assert (trace.dropped_groups, trace.regenerated_groups) == ((0, 2) if regenerated else (2, 0))
    assert sorted(tracker.groups) == ([0, 1] if regenerated else [])
    assert [g.group_id for g in tracker.regenerate] == ([1, 0] if regenerated else [])
    tracker.collect(engine.step())  # the aborted request's output is ignored
    assert not tracker.ready


def test_withdraw_aborts_and_forgets_the_running_groups() -> None:
    engine = FakeEngine(length=lambda prompt, i: 50)
    tracker = GroupTracker(engine)
    _admit(tracker, [0, 1])
    tracker.queue(Group(2))
    tracker.withdraw()
    assert not engine.has_unfinished_requests() and not tracker.running
    assert list(tracker.groups) == [2]  # a queued group was never in the engine


def test_a_refused_request_records_nothing() -> None:
    tracker = GroupTracker(FakeEngine(refuse_after=1))
    _admit(tracker, [0])
    with pytest.raises(ValueError, match="too long"):
        _admit(tracker, [1])
    assert list(tracker.groups) == [0] and list(tracker.running) == ["group0"]


def test_bad_settings_name_the_value() -> None:
    with pytest.raises(ValueError, match="max_staleness=-1 is invalid"):
        GroupTracker(FakeEngine(), max_staleness=-1)
    with pytest.raises(ValueError, match="stale_groups='keep' is invalid"):
        GroupTracker(FakeEngine(), stale_groups="keep")
