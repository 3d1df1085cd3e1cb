"""Partial rollouts (issue 14): groups carried across rounds, staleness, exactly-once over crash + resume."""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path

import datasets
import pytest

from rollout.job.data import PromptDataset, load_prompt_dataset
from rollout.job.rounds import RoundDriver
from rollout.job.seeds import request_seed
from rollout.job.trajectory_writer import TrajectoryWriter, read_trajectories
from rollout.rl.metrics import tail_batch_size
from rollout.sampling_params import SamplingParams
from rollout.settings.schema import DataConfig
from tests.job_fakes import FakeEngine

N = 2


def long_tail(prompt: list[int], index: int) -> int:
    """Most samples stop within 4 tokens; every fifth prompt length has one sample running 13."""
    return 13 if len(prompt) % 5 == 0 and index == 1 else 1 + (len(prompt) + index) % 4


def ids_dataset(rows: int = 40) -> PromptDataset:
    prompts = [[1] * (1 + i) for i in range(rows)]  # prompt length = row + 1: lengths vary by row
    return PromptDataset(datasets.Dataset.from_dict({"prompt": prompts}), None, "prompt", None)


def partial_actor(engine, **kw) -> RoundDriver:
    kw.setdefault("max_inflight_groups", 5)
    return RoundDriver(engine, ids_dataset(), SamplingParams(n=N, max_tokens=20), 3, mode="partial", seed=1, **kw)


def test_partial_rounds_hand_out_full_groups_and_carry_the_rest() -> None:
    engine = FakeEngine(length=long_tail)
    actor = partial_actor(engine)
    results = [actor.run_round() for _ in range(4)]
    for res in results:
        assert len(res.trajectories) == 3 * N  # exactly num_prompts groups, each complete
        counts = Counter(t.group_id for t in res.trajectories)
        assert set(counts.values()) == {N}
        assert all(t.finish_reason in ("stop", "length") for t in res.trajectories)
    assert len(engine.requests) == 5  # the engine always holds max_inflight_groups
    assert any(r.metrics["carried_over_tokens"] > 0 for r in results)
    m = results[0].metrics
    for key in ("tail_batch_size", "staleness_hist", "dropped_groups", "carried_over_groups", "round_time_s"):
        assert key in m, key
    assert m["staleness_hist"] == {"0": 3}
    assert results[-1].metrics["carried_over_groups"] == len(actor.state()["inflight_groups"])


def test_per_token_versions_change_exactly_at_the_round_boundary() -> None:
    engine = FakeEngine(length=long_tail)
    actor = partial_actor(engine, recompute_running=False)
    actor.run_round()
    landed = {}  # (group, sample) -> tokens made under version 0
    for rid, group_id in actor.in_flight().items():
        for c in engine.partial_output(rid).outputs:
            landed[(group_id, c.index)] = len(c.token_ids)
    assert any(landed.values()), "the test needs a group carried over with tokens"
    assert actor.update_weights({}, version=1) == 1
    assert engine.updates[-1][1] is False  # recompute_running passed through
    rows = [t for _ in range(4) for t in actor.run_round().trajectories]
    checked = 0
    for t in rows:
        k = landed.get((t.group_id, t.sample_index))
        if k is None:
            continue
        checked += 1
        assert t.policy_versions == [0] * k + [1] * (len(t.completion_ids) - k)
        want_max = 1 if len(t.completion_ids) > k else 0  # a sample may have finished before the push
        assert (t.min_policy_version, t.max_policy_version) == (min(t.policy_versions), want_max)
    assert checked == len(landed)


def test_staleness_drop_is_counted_and_regenerate_resubmits() -> None:
    for policy in ("drop", "regenerate"):
        engine = FakeEngine(length=long_tail)
        actor = partial_actor(engine, max_staleness=0, stale_groups=policy)
        written, dropped, regenerated = [], 0, 0
        for r in range(5):
            res = actor.run_round()
            written += [t.group_id for t in res.trajectories]
            dropped += res.metrics["dropped_groups"]
            regenerated += res.metrics["regenerated_groups"]
            assert all(t.min_policy_version == t.max_policy_version == r for t in res.trajectories)
            assert res.metrics["staleness_max"] == 0
            actor.update_weights({})
        assert len(written) == len(set(written)) * N  # no group twice
        if policy == "drop":
            assert dropped > 0 and regenerated == 0
            lost = set(range(actor.next_group)) - set(written) - set(actor.state()["inflight_groups"])
            assert len(lost) == dropped  # dropped groups are gone, and counted
        else:
            assert regenerated > 0 and dropped == 0
            pending = set(actor.state()["inflight_groups"])
            assert set(written) | pending == set(range(actor.next_group))  # nothing lost


def test_exactly_once_over_5_rounds_with_pushes_and_a_crash(tmp_path: Path) -> None:
    """Rounds 0-2 written, a push after each, a crash mid round 3, a resume: every group written once."""
    writer = TrajectoryWriter(tmp_path, with_reward=False)
    actor = partial_actor(FakeEngine(length=long_tail))
    for r in range(3):
        res = actor.run_round()
        writer.write_round(r, res.trajectories, res.metrics, actor.state())
        actor.update_weights({})
    actor.engine.crash_at_step = actor.engine.stats.num_steps + 2
    with pytest.raises(RuntimeError, match="simulated crash"):
        actor.run_round()
    state_at_crash = actor.state()
    resumed = TrajectoryWriter(tmp_path, with_reward=False)
    start = resumed.resume()
    assert start == 3 and resumed.state["inflight_groups"]  # groups were in flight: regenerated
    engine = FakeEngine(length=long_tail, policy_version=3)
    actor = partial_actor(engine, start_round=start, state=resumed.state)
    for r in range(start, 5):
        res = actor.run_round()
        resumed.write_round(r, res.trajectories, res.metrics, actor.state())
        actor.update_weights({})
    table = read_trajectories(tmp_path).to_pylist()
    per_group = Counter(row["group_id"] for row in table)
    assert set(per_group.values()) == {N}  # never half-written, never twice
    assert sorted(per_group) == sorted(set(per_group))
    pending = set(actor.state()["inflight_groups"])
    assert not pending & set(per_group)
    assert set(per_group) | pending == set(range(actor.state()["next_group"]))  # nothing lost
    assert set(resumed.state["inflight_groups"]) <= set(per_group) | pending
    assert state_at_crash["next_group"] >= resumed.state["next_group"]
    assert {row["round"] for row in table} == set(range(5))
    assert any(row["min_policy_version"] < row["max_policy_version"] for row in table)  # spans a push


def test_resumed_groups_keep_the_seeds_of_the_round_that_admitted_them() -> None:
    first = FakeEngine(length=long_tail)
    actor = partial_actor(first)
    for _ in range(2):
        actor.run_round()
    state = actor.state()
    seeds = {int(rid.split("group")[1]): params.seed for rid, _, params in first.added}
    assert state["inflight_groups"] and set(map(int, state["admitted"])) == set(state["inflight_groups"])
    again = FakeEngine(length=long_tail)
    partial_actor(again, start_round=2, state=state).run_round()
    resubmitted = {int(rid.split("group")[1]): params.seed for rid, _, params in again.added}
    for g in state["inflight_groups"]:
        assert resubmitted[g] == seeds[g] == request_seed(1, state["admitted"][str(g)], g)


def test_tail_batch_size_is_the_last_tenth_of_the_round() -> None:
    steps = [(0.1 * i, 64 if i < 9 else 4) for i in range(1, 11)]  # steps ending at 0.1 .. 1.0 s
    assert tail_batch_size(steps, 0.0, 1.0) == 4  # only the step ending at 1.0 is in [0.9, 1.0]
    assert tail_batch_size(steps, 0.0, 1.5) == 4  # none ended in [1.35, 1.5]: the last step's
    assert tail_batch_size([], 0.0, 1.0) == 0.0


def test_drain_is_unchanged_by_partial_mode_bookkeeping() -> None:
    engine = FakeEngine(length=long_tail)
    actor = RoundDriver(engine, ids_dataset(), SamplingParams(n=N, max_tokens=20), 3, seed=1)
    res = [actor.run_round() for _ in range(3)]
    assert [t.group_id for r in res for t in r.trajectories] == [g for g in range(9) for _ in range(N)]
    assert not engine.requests and actor.state() == {"next_group": 9, "inflight_groups": [], "admitted": {},
                                              "policy_version": 0}
    assert all(r.metrics["carried_over_groups"] == 0 for r in res)
    with pytest.raises(ValueError, match="mode must be one of"):
        RoundDriver(engine, ids_dataset(), SamplingParams(), 1, mode="eager")


# ---- the real engine ----------------------------------------------------------------------------------
def test_drain_output_equals_generate_with_the_same_seeds(default_model: Path) -> None:
    """Drain mode hands out exactly what `generate` makes for the round's prompts with the derived seeds."""
    from rollout import Engine

    engine = Engine.from_pretrained(str(default_model), dtype="float32", device="cpu", max_num_seqs=8)
    ds = load_prompt_dataset(DataConfig(), engine.tokenizer)
    params = SamplingParams(n=2, max_tokens=5)
    res = RoundDriver(engine, ds, params, 3, seed=11, start_round=1).run_round()
    prompts = [list(ds.get(g).token_ids) for g in (3, 4, 5)]
    outs = engine.generate(prompts, [dataclasses.replace(params, seed=request_seed(11, 1, g)) for g in (3, 4, 5)])
    want = [(c.token_ids, c.logprobs) for o in outs for c in o.outputs]
    assert [(t.completion_ids, t.logprobs) for t in res.trajectories] == want


def test_real_engine_versions_switch_at_the_boundary(default_model: Path, tokenizer) -> None:
    """The engine's own per-token versions: a carried-over sample's tokens are version 0 up to the round's
    end and version 1 after the push (recomputed KV), and its group is handed out whole."""
    from transformers import AutoModelForCausalLM

    from rollout import Engine

    engine = Engine.from_pretrained(str(default_model), dtype="float32", device="cpu", max_num_seqs=16)
    ds = load_prompt_dataset(DataConfig(), tokenizer)
    stops = list(range(10, len(tokenizer), 6))  # ~1 in 6 tokens stops a sample: lengths vary a lot
    params = SamplingParams(n=2, max_tokens=24, stop_token_ids=stops)
    actor = RoundDriver(engine, ds, params, 2, seed=3, mode="partial", max_inflight_groups=4)
    actor.run_round()
    landed = {}
    for rid, group_id in actor.in_flight().items():
        for c in engine.partial_output(rid).outputs:
            landed[(group_id, c.index)] = len(c.token_ids)
    assert any(landed.values())
    hf = AutoModelForCausalLM.from_pretrained(default_model)
    actor.update_weights(hf.named_parameters(), version=1)
    seen = 0
    for _ in range(6):
        for t in actor.run_round().trajectories:
            k = landed.get((t.group_id, t.sample_index))
            if k is not None:
                seen += 1
                assert t.policy_versions == [0] * k + [1] * (len(t.completion_ids) - k)
    assert seen == len(landed)
