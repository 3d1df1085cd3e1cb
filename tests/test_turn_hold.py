"""``engine.turn_prefill_hold_steps``: a resumed conversation's environment reply waits a few steps so that
replies landing one step apart are prefilled in one step (a step computing more than one token for a sequence
runs eagerly on the GPU, not from a decode graph), and joins at once any step that is not pure decode anyway.
The tokens are the same either way (greedy)."""

from __future__ import annotations

import pytest

from rollout import Engine, SamplingParams
from rollout.config import EngineConfig
from rollout.engine.turns import Conversations
from tests.tiny_models import make_tiny_hf_model

TURN = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)


@pytest.fixture(scope="module")
def hf():
    return make_tiny_hf_model("llama")


def _run(hf, hold: int) -> tuple[int, list[list[int]]]:
    engine = Engine.from_pretrained(hf, dtype="float32", device="cpu", block_size=4, max_model_len=128,
                                    turn_prefill_hold_steps=hold)
    mixed = []
    schedule = engine.scheduler.schedule

    def watch(*a, **k):
        plan = schedule(*a, **k)
        if plan is not None:
            mixed.append(any(len(s.input_ids) > 1 for s in plan.seqs))
        return plan

    engine.scheduler.schedule = watch
    conv = Conversations(engine)
    rids = [conv.start([3 + i, 7, 11, 13, 17], TURN, f"c{i}") for i in range(4)]
    engine.add_request([5, 9, 2], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), "decoder")
    while len(engine.scheduler.parked) < len(rids):
        engine.step()
    mixed.clear()
    for i, rid in enumerate(rids):  # replies land one step apart, as environments finish at their own pace
        assert conv.resume(rid, [20 + i, 21, 22], TURN, 2)
        engine.step()
    while len(engine.scheduler.parked) < len(rids):
        engine.step()
    return sum(mixed), [engine.scheduler.parked[r].seqs[0].token_ids for r in rids]


def test_replies_landing_apart_are_prefilled_together_with_the_same_tokens(hf):
    eager, tokens = _run(hf, 0)
    held, same = _run(hf, 6)
    assert eager == 4 and held == 1, (eager, held)
    assert same == tokens


def test_a_held_reply_joins_a_step_with_nothing_else_to_run(hf):
    engine = Engine.from_pretrained(hf, dtype="float32", device="cpu", block_size=4, max_model_len=128,
                                    turn_prefill_hold_steps=1000)
    conv = Conversations(engine)
    rid = conv.start([3, 7, 11], TURN, "alone")
    while not engine.scheduler.parked:
        engine.step()
    assert conv.resume(rid, [20, 21], TURN, 2)
    for _ in range(8):  # nothing else runs: it is not held for 1000 steps
        engine.step()
    assert rid in engine.scheduler.parked and len(engine.scheduler.parked[rid].seqs[0].token_ids) == 3 + 2 + 2 + 2


def test_hold_steps_are_checked():
    with pytest.raises(ValueError, match="turn_prefill_hold_steps"):
        EngineConfig(turn_prefill_hold_steps=-1)
