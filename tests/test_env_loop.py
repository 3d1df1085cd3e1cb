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


def run(engine, tokenizer, factory, rows, limits=EnvLimits(max_turns=4, max_turn_tokens=6), loop_cls=EnvLoop):
    loop = loop_cls(engine, EnvSpec(factory), tokenizer, limits)
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
