"""Multi-turn conversations through the engine's environment loop (issue 22), on the embedded model in float32.

The oracle is transformers' teacher-forced logprob over the whole conversation (prompt, model turns and the
environment's replies); the engine must never re-prefill a conversation (prefill == prompt + env tokens).
"""

from __future__ import annotations

import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from rollout import Engine, SamplingParams
from rollout.envs import EnvLimits, EnvLoop, EnvSpec
from tests import env_fixtures
from tests.engine_helpers import hf_logprobs

ROWS = [{"prompt": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(4)]


@pytest.fixture(scope="module")
def hf(default_model):
    return AutoModelForCausalLM.from_pretrained(default_model, dtype=torch.float32).eval()


def make_engine(default_model, **kw) -> Engine:
    kw.setdefault("max_model_len", 512)
    return Engine.from_pretrained(str(default_model), dtype="float32", device="cpu", block_size=8, **kw)


def params(n: int, seed: int = 0) -> list[SamplingParams]:
    return [SamplingParams(temperature=1.0, max_tokens=8, seed=seed + i) for i in range(n)]


def run(engine, tokenizer, factory, rows, limits=None, loop_cls=EnvLoop):
    loop = loop_cls(engine, EnvSpec(factory), tokenizer, limits or EnvLimits(max_turns=4, max_turn_tokens=6))
    try:
        return loop.run(rows, [r["prompt"] for r in rows], params(len(rows)))
    finally:
        loop.close()


@pytest.mark.parametrize("async_mode", [False, True])
def test_step_env_turns_match_hf_and_never_reprefill(default_model, tokenizer, hf, async_mode) -> None:
    engine = make_engine(default_model, async_mode=async_mode)
    eps = run(engine, tokenizer, env_fixtures.ThreeTurns, ROWS)
    env_tokens = 0
    for ep in eps:
        assert ep.error is None and ep.num_turns == 3 and ep.reward == 3.0
        n = len(ep.completion_ids)
        assert len(ep.env_mask) == len(ep.logprobs) == len(ep.policy_versions) == n
        runs = [m for i, m in enumerate(ep.env_mask) if i == 0 or m != ep.env_mask[i - 1]]
        assert runs == [1, 0, 1, 0, 1], runs  # three model turns, two replies
        env = [i for i, m in enumerate(ep.env_mask) if m == 0]
        assert all(ep.logprobs[i] == 0.0 for i in env)
        env_tokens += len(env)
        text = tokenizer.decode([ep.completion_ids[i] for i in env])
        assert "Turn 1 done" in text and "Turn 2 done" in text and "<|assistant|>" in text
        ref = hf_logprobs(hf, ep.prompt_ids, ep.completion_ids)
        want = ref[torch.arange(n), torch.tensor(ep.completion_ids)]
        model = torch.tensor(ep.env_mask, dtype=torch.bool)
        assert torch.allclose(torch.tensor(ep.logprobs)[model], want[model], atol=1e-4)
    stats = engine.get_stats()
    assert stats.num_prefill_tokens == sum(len(ep.prompt_ids) for ep in eps) + env_tokens
    assert engine.scheduler.parked == {} and engine.block_manager.num_free_blocks == engine.num_blocks
    assert not engine.has_unfinished_requests()


class ScriptedLoop(EnvLoop):
    """The scripted policy: the first turn calls the row's tools whatever the model wrote; later turns call none."""

    def parse_calls(self, row, turn, *_):
        return row["calls"] if turn == 1 else []


def _tool_rows() -> list[dict]:
    call = lambda name, **args: [{"name": name, "arguments": args}]  # noqa: E731
    return [
        {"id": "hang", "prompt": "p0", "calls": call("hang")},
        {"id": "ok", "prompt": "p1", "calls": call("add", a=2, b=3)},
        {"id": "boom", "prompt": "p2", "calls": call("boom")},
        {"id": "missing", "prompt": "p3", "calls": call("nope")},
        {"id": "huge", "prompt": "p4", "calls": call("huge")},
        {"id": "async", "prompt": "p5", "calls": call("slow", seconds=0.2) + call("add", a=1, b=1)},
        {"id": "reset", "prompt": "p6", "calls": [], "kind": "reset_raises"},
        {"id": "bad", "prompt": "p7", "calls": [{"name": "add", "error": "the tool call is not valid JSON"}]},
    ]


def test_tool_faults_give_their_documented_rows_and_never_stall_others(default_model, tokenizer) -> None:
    engine = make_engine(default_model, async_mode=True)
    limits = EnvLimits(max_turns=3, max_turn_tokens=4, tool_timeout_s=2.0, max_tool_result_chars=200)
    env_fixtures.ENDED.clear()
    t0 = time.monotonic()
    try:
        eps = run(engine, tokenizer, env_fixtures.ScriptedTools, _tool_rows(), limits, ScriptedLoop)
    finally:
        env_fixtures.HANG.set()
    by = {row["id"]: ep for row, ep in zip(_tool_rows(), eps)}
    env_text = {k: tokenizer.decode([t for t, m in zip(ep.completion_ids, ep.env_mask) if m == 0])
                for k, ep in by.items()}
    for k in ("hang", "ok", "boom", "missing", "huge", "async", "bad"):
        ep = by[k]
        assert ep.error is None and ep.finish_reason == "stop" and ep.num_turns == 2, (k, ep)
        assert ep.reward == 1.0 and ep.tool_calls == (2 if k == "async" else 1)
        assert all(lp == 0.0 for lp, m in zip(ep.logprobs, ep.env_mask) if m == 0)
    assert by["ok"].tool_failures == 0 and "<|tool|>5<|eos|><|assistant|>" in env_text["ok"]
    assert "<|tool|>slept<|eos|><|tool|>2<|eos|>" in env_text["async"] and by["async"].tool_failures == 0
    assert by["boom"].tool_failures == 1 and "{'error': 'boom on purpose'}" in env_text["boom"]
    assert by["missing"].tool_failures == 1 and "Tool nope not found." in env_text["missing"]
    assert by["bad"].tool_failures == 1 and "not valid JSON" in env_text["bad"]
    assert by["hang"].tool_failures == 1 and "timed out after 2 s" in env_text["hang"]
    assert by["huge"].tool_failures == 0 and "[... truncated: 200 of 1048576 characters shown]" in env_text["huge"]
    assert len(by["huge"].completion_ids) < 300  # 200 characters kept, not a megabyte
    reset = by["reset"]
    assert reset.finish_reason == "env_error" and reset.completion_ids == [] and reset.reward is None
    assert reset.error == "reset raised RuntimeError: reset failed on purpose"
    # the hung tool stalled only its own conversation: every other one ended before its timeout did
    ended = env_fixtures.ENDED
    assert ended["hang"] - t0 >= 2.0
    assert max(ended[k] for k in ended if k != "hang") < ended["hang"] - 1.0, ended
    assert engine.scheduler.parked == {} and not engine.has_unfinished_requests()


def test_overflowing_conversation_ends_with_length(default_model, tokenizer) -> None:
    engine = make_engine(default_model, max_model_len=40)
    eps = run(engine, tokenizer, env_fixtures.ThreeTurns, ROWS[:2], EnvLimits(max_turns=5, max_turn_tokens=6))
    for ep in eps:
        assert ep.finish_reason == "length" and ep.error is None and 1 <= ep.num_turns < 3
        assert len(ep.prompt_ids) + len(ep.completion_ids) <= 40
        assert ep.env_mask[-1] == 1  # the reply that would not fit was not appended
    assert engine.scheduler.parked == {} and not engine.has_unfinished_requests()


def test_parked_kv_is_dropped_when_waiting_ones_need_it_and_recomputed(default_model, tokenizer, hf) -> None:
    engine = make_engine(default_model, num_blocks=10, max_num_seqs=2)  # 80 tokens of KV for 6 conversations
    rows = [{"prompt": f"Q{i}"} for i in range(6)]
    eps = run(engine, tokenizer, env_fixtures.ThreeTurns, rows, EnvLimits(max_turns=3, max_turn_tokens=5))
    env_tokens = 0
    for ep in eps:
        assert ep.error is None and ep.num_turns == 3, ep
        env_tokens += ep.env_mask.count(0)
        n = len(ep.completion_ids)
        ref = hf_logprobs(hf, ep.prompt_ids, ep.completion_ids)
        want = ref[torch.arange(n), torch.tensor(ep.completion_ids)]
        model = torch.tensor(ep.env_mask, dtype=torch.bool)
        assert torch.allclose(torch.tensor(ep.logprobs)[model], want[model], atol=1e-4)
    # some conversation's KV was dropped and recomputed (counted), yet every logprob is the oracle's
    assert engine.get_stats().num_prefill_tokens > sum(len(ep.prompt_ids) for ep in eps) + env_tokens
    assert engine.block_manager.num_free_blocks == engine.num_blocks


class PushingLoop(EnvLoop):
    """Pushes the same weights under a new version when the first turn ends (between and during turns)."""

    def _turn_ended(self, out):
        if self.engine.policy_version == 0:
            self.engine.update_weights(self.weights, version=5)
        super()._turn_ended(out)


@pytest.mark.parametrize("async_mode", [False, True])
def test_weight_push_between_turns_tags_tokens_and_recomputes_parked_kv(default_model, tokenizer, hf,
                                                                        async_mode) -> None:
    engine = make_engine(default_model, async_mode=async_mode)
    loop = PushingLoop(engine, EnvSpec(env_fixtures.ThreeTurns), tokenizer, EnvLimits(max_turns=3, max_turn_tokens=5))
    loop.weights = [(n, p.detach().clone()) for n, p in hf.named_parameters()]
    try:
        eps = loop.run(ROWS, [r["prompt"] for r in ROWS], params(len(ROWS)))
    finally:
        loop.close()
    for ep in eps:
        assert ep.error is None and ep.num_turns == 3
        assert ep.policy_versions == sorted(ep.policy_versions) and ep.policy_versions[-1] == 5
        n = len(ep.completion_ids)
        ref = hf_logprobs(hf, ep.prompt_ids, ep.completion_ids)
        want = ref[torch.arange(n), torch.tensor(ep.completion_ids)]
        model = torch.tensor(ep.env_mask, dtype=torch.bool)
        assert torch.allclose(torch.tensor(ep.logprobs)[model], want[model], atol=1e-4)
    assert any(0 in ep.policy_versions for ep in eps)
    given = sum(len(ep.prompt_ids) + ep.env_mask.count(0) for ep in eps)
    assert engine.get_stats().num_prefill_tokens > given  # the parked conversations were recomputed


@pytest.mark.parametrize("factory, error", [
    (env_fixtures.BadReward, "get_reward raised TypeError: it returned 'not a number', not a number"),
    (env_fixtures.StepRaises, "step raised KeyError: 'no such state'"),
])
def test_env_methods_that_fail_give_env_error_rows(default_model, tokenizer, factory, error) -> None:
    engine = make_engine(default_model)
    eps = run(engine, tokenizer, factory, ROWS[:2])
    for ep in eps:
        assert ep.finish_reason == "env_error" and ep.error == error and ep.reward is None and ep.num_turns >= 1
        assert len(ep.completion_ids) == len(ep.env_mask) > 0  # the tokens made so far stay in the row
    assert engine.scheduler.parked == {} and engine.block_manager.num_free_blocks == engine.num_blocks


def test_last_conversation_ending_inside_poll_is_not_a_stall(default_model, tokenizer, monkeypatch) -> None:
    """The final calls' results can be picked up by the loop's own poll (not inside ``wait``): the last
    conversation then ends mid-iteration, with the engine idle and nothing pending. That is the end of the run,
    not a stall (H200, W4-geo: 'the environment loop stalled: 0 conversations ...')."""
    engine = make_engine(default_model)
    loop = EnvLoop(engine, EnvSpec(env_fixtures.ThreeTurns), tokenizer, EnvLimits(max_turns=4, max_turn_tokens=6))
    monkeypatch.setattr(loop.calls, "wait", lambda max_s=0.05: time.sleep(0.01))  # results reach poll() only
    try:
        eps = loop.run(ROWS[:2], [r["prompt"] for r in ROWS[:2]], params(2))
    finally:
        loop.close()
    assert all(ep.error is None and ep.num_turns == 3 for ep in eps)
