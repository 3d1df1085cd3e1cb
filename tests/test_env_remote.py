"""The environment loop over a rollout server (``RolloutClient``): each turn one request of the conversation so
far, from the client's pool, the earlier turns' KV served by the server's prefix cache (``RemoteTurns``).

One live loopback server on the embedded model (float32) for the module; the oracle is the same loop on an
in-process engine with the same weights. Parity is greedy (temperature 0): over a server each turn's request
samples from output position 0 with a per-turn seed, so seeded draws at temperature > 0 differ from the in-process
sequence's, whose positions continue across turns.
"""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

import pytest
import torch

from rollout import Engine, SamplingParams
from rollout.assets import materialize_default_model
from rollout.envs import EnvLimits, EnvLoop, EnvSpec
from tests import env_fixtures
from tests.serve_helpers import Server
from tests.test_env_loop import ROWS, ScriptedLoop
from trainer_hooks.client import RolloutClient

OPTIONS = dict(max_model_len=512, num_blocks=96, block_size=16, max_num_seqs=16)
LIMITS = EnvLimits(max_turns=4, max_turn_tokens=6)
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    cache = tmp_path_factory.mktemp("remote-env-cache")
    model_dir = materialize_default_model(cache)
    server = Server(f"model.cache_dir={cache}", "model.dtype=float32", *(f"engine.{k}={v}" for k, v in OPTIONS.items()))
    try:
        engine = Engine.from_pretrained(str(model_dir), dtype="float32", device="cpu", **OPTIONS)
        client = RolloutClient(server.wait_ready().url, timeout_s=60)
        yield SimpleNamespace(server=server, engine=engine, client=client, model_dir=model_dir)
        client.close()
    finally:
        server.stop()


def greedy(n: int) -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=8, seed=i) for i in range(n)]


class CacheLoop(EnvLoop):
    """Records each turn's prefix-cache hits (``RequestOutput.num_cached_tokens``) and the conversation's length
    at the turn's end, by conversation."""

    def _turn_ended(self, out):
        self.turn_log = getattr(self, "turn_log", {})
        length = len(out.prompt_token_ids) + len(out.outputs[0].token_ids)
        self.turn_log.setdefault(out.request_id, []).append((out.num_cached_tokens, length))
        super()._turn_ended(out)


def _run(backend, tokenizer, factory, rows, limits=LIMITS, loop_cls=EnvLoop):
    loop = loop_cls(backend, EnvSpec(factory), tokenizer, limits)
    try:
        return loop.run(rows, [r["prompt"] for r in rows], greedy(len(rows))), loop
    finally:
        loop.close()


def test_step_env_over_the_server_equals_the_in_process_loop_and_hits_the_prefix_cache(env, tokenizer) -> None:
    remote, loop = _run(env.client, tokenizer, env_fixtures.ThreeTurns, ROWS, loop_cls=CacheLoop)
    local, _ = _run(env.engine, tokenizer, env_fixtures.ThreeTurns, ROWS)
    for r, w in zip(remote, local):
        assert r.error is None and r.num_turns == 3 and r.reward == 3.0 and r.finish_reason == w.finish_reason
        runs = [m for i, m in enumerate(r.env_mask) if i == 0 or m != r.env_mask[i - 1]]
        assert runs == [1, 0, 1, 0, 1], runs
        assert len(r.completion_ids) == len(r.logprobs) == len(r.policy_versions) == len(r.env_mask)
        assert all(lp == 0.0 for lp, m in zip(r.logprobs, r.env_mask) if m == 0)
        assert r.prompt_ids == w.prompt_ids and r.completion_ids == w.completion_ids and r.env_mask == w.env_mask
        assert torch.allclose(torch.tensor(r.logprobs), torch.tensor(w.logprobs), atol=1e-4)
        assert r.policy_versions == w.policy_versions == [0] * len(r.env_mask)
        assert [m["role"] for m in r.messages] == [m["role"] for m in w.messages]
    # every turn after the first re-sends the conversation: the server's prefix cache serves every full block of
    # the previous turn's sequence (its last token's KV was never computed); only the rest is recomputed
    block = OPTIONS["block_size"]
    for i in range(len(remote)):
        log = loop.turn_log[f"conv-{i}"]
        assert len(log) == 3, log
        for (_, before), (hits, _) in zip(log, log[1:]):
            assert (before - 1) // block * block <= hits < before and hits >= block, log


def test_tool_faults_and_server_errors_stay_in_their_conversation(env, tokenizer) -> None:
    call = lambda name, **args: [{"name": name, "arguments": args}]  # noqa: E731
    rows = [{"id": "hang", "prompt": "p0", "calls": call("hang")},
            {"id": "ok", "prompt": "p1", "calls": call("add", a=2, b=3)},
            {"id": "boom", "prompt": "p2", "calls": call("boom")}]
    limits = EnvLimits(max_turns=3, max_turn_tokens=4, tool_timeout_s=2.0)
    env_fixtures.ENDED.clear()
    env_fixtures.HANG.clear()  # an earlier module's test may have released it
    t0 = time.monotonic()
    try:
        eps, _ = _run(env.client, tokenizer, env_fixtures.ScriptedTools, rows, limits, ScriptedLoop)
    finally:
        env_fixtures.HANG.set()
    by = {row["id"]: ep for row, ep in zip(rows, eps)}
    text = {k: tokenizer.decode([t for t, m in zip(ep.completion_ids, ep.env_mask) if m == 0]) for k, ep in by.items()}
    for ep in eps:
        assert ep.error is None and ep.finish_reason == "stop" and ep.num_turns == 2 and ep.reward == 1.0, ep
        assert all(lp == 0.0 for lp, m in zip(ep.logprobs, ep.env_mask) if m == 0)
    assert by["ok"].tool_failures == 0 and "<|tool|>5<|eos|><|assistant|>" in text["ok"]
    assert by["boom"].tool_failures == 1 and "{'error': 'boom on purpose'}" in text["boom"]
    assert by["hang"].tool_failures == 1 and "timed out after 2 s" in text["hang"]
    # the hung tool stalled only its own conversation
    assert env_fixtures.ENDED["ok"] - t0 < 2.0 and env_fixtures.ENDED["boom"] - t0 < 2.0
    assert env_fixtures.ENDED["hang"] - t0 >= 2.0

    # a turn the server refuses (a token outside the vocabulary) ends its own row; the other one finishes
    loop = EnvLoop(env.client, None, tokenizer, LIMITS)
    try:
        good = tokenizer.encode("Hello there")
        bad, fine = loop.run_prepared([[env.client.limits.vocab_size + 5], good], [{}, {}], greedy(2))
    finally:
        loop.close()
    assert bad.finish_reason == "env_error" and bad.completion_ids == []
    assert bad.error.startswith("the rollout backend did not generate the turn: RequestRejected: 400"), bad.error
    assert fine.error is None and fine.finish_reason == "stop" and fine.num_turns == 1 and fine.completion_ids


def test_trl_environment_factory_runs_over_the_server(env, tmp_path, monkeypatch) -> None:
    """GRPOTrainer(environment_factory=..., rollout_func=TRLRollout(client)): every turn generated by the server."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig

    from rollout.assets import assets_dir
    from tests.test_trl_tools import RESPONSE_TEMPLATE, SEEN, TOOL_TEMPLATE, AdderEnv, _Capture, shape_of_completions
    from trainer_hooks.grpo import EngineGRPOTrainer
    from trainer_hooks.trl import TRLRollout

    monkeypatch.setattr(EnvLoop, "parse_calls",
                        lambda self, row, turn, *_: [{"name": "add", "arguments": {"a": 2, "b": 3}}] if turn == 1
                        else [])
    tok = AutoTokenizer.from_pretrained(str(assets_dir()))
    tok.chat_template, tok.response_template = TOOL_TEMPLATE, RESPONSE_TEMPLATE
    rollout = TRLRollout(env.client)
    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", per_device_train_batch_size=4,
                      num_generations=2, max_completion_length=48, max_steps=1, learning_rate=1e-3, logging_steps=1,
                      save_strategy="no", temperature=1.0, seed=0, bf16=False, disable_tqdm=True,
                      max_tool_calling_iterations=2, generation_kwargs={"max_tokens": 8})
    logs = _Capture()
    data = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"Q{i}"}] for i in range(4)]})
    model = AutoModelForCausalLM.from_pretrained(str(env.model_dir), dtype=torch.float32)
    SEEN.clear()
    trainer = EngineGRPOTrainer(model=model, reward_funcs=[shape_of_completions], args=args, train_dataset=data,
                                processing_class=tok, rollout_func=rollout, environment_factory=AdderEnv,
                                callbacks=[logs])
    trainer.train()
    rollout.close()
    episodes = rollout.last_outputs
    assert len(episodes) == 4
    for ep in episodes:
        assert ep.tool_calls == 1 and ep.tool_failures == 0 and ep.num_turns == 2 and 0 in ep.env_mask
        assert "<|tool|>5<|eos|><|assistant|>" in tok.decode([t for t, m in zip(ep.completion_ids, ep.env_mask)
                                                              if m == 0])
        assert all(lp == 0.0 for lp, m in zip(ep.logprobs, ep.env_mask) if m == 0)
    log = logs.logs[0]
    assert log["tools/call_frequency"] == 1.0 and log["tools/failure_frequency"] == 0.0
    assert log["reward"] == 1.0  # AdderEnv.get_reward through TRL's reward path
    assert log["sampling/sampling_logp_difference/max"] <= 1e-4  # the server's logprobs == the trainer's
    assert [[m["role"] for m in messages] for messages in SEEN] == [["assistant", "tool", "assistant"]] * 4


def test_train_grpo_script_with_train_env_over_the_server(env, tmp_path, monkeypatch) -> None:
    """rollout-train-grpo rollout.mode=server train.env=...: TRL's environment_factory, every turn on the server
    (last here: its pushes move the server's policy version past the earlier tests')."""
    from tests.test_trl_tools import train_grpo_adding

    lines = train_grpo_adding(tmp_path, monkeypatch, env.model_dir.parent, "train.env=tests.test_trl_tools:AdderEnv",
                              "train.reward=env", "rollout.mode=server", f"rollout.url={env.server.url}")
    assert all(x["reward"] == 1.0 for x in lines)


def test_the_loop_takes_an_engine_a_client_or_a_pool_and_refuses_the_rest(env, tokenizer) -> None:
    from rollout import ContinuousBackend, RequestBackend
    from rollout.pool.pool import RolloutPool

    assert isinstance(env.client, RequestBackend) and not isinstance(env.client, ContinuousBackend)
    assert not isinstance(env.engine, RequestBackend)
    pool = RolloutPool.__new__(RolloutPool)  # its class is what the door looks at
    assert isinstance(pool, RequestBackend) and not isinstance(pool, ContinuousBackend)
    with pytest.raises(TypeError, match=r"the environment loop needs an in-process Engine .* or a RolloutClient or "
                                        "RolloutPool .*got object"):
        EnvLoop(object(), None, tokenizer)
