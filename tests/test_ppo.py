"""PPO: the math against hand-worked numbers, token logprobs against the oracle, rollout-train-ppo end to end."""

from __future__ import annotations

import json
import math

import pytest
import torch

from rollout.cli import train_ppo
from rollout.sampling_params import SamplingParams
from tests.engine_helpers import hf_logprobs
from tests.script_helpers import compose, message_regex
from tests.tiny_models import make_tiny_hf_model
from tests.wandb_offline import read_run
from trainer_hooks.ppo import PPOConfig, Sequences, gae, policy_loss, token_logprobs, token_rewards, value_loss


def short_completions(prompts, completions, completion_ids, **_):
    """A plug-in reward in TRL's signature (used by name: tests.test_ppo:short_completions)."""
    return [1.0 / (1 + len(ids)) for ids in completion_ids]


def test_gae_matches_the_recursion_by_hand():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.5, 2.0, 0.0]])
    values = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])  # the second sequence has 2 tokens
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    d2 = 1.0 - 0.3
    d1 = 0.0 + 0.9 * 0.3 - 0.2
    d0 = 0.0 + 0.9 * 0.2 - 0.1
    a2, a1 = d2, d1 + 0.72 * d2
    assert torch.allclose(adv[0], torch.tensor([d0 + 0.72 * a1, a1, a2]))
    e1 = 2.0 - 0.5  # V after the last token is 0, whatever sits in the padding
    e0 = 0.5 + 0.9 * 0.5 - 0.4
    assert torch.allclose(adv[1], torch.tensor([e0 + 0.72 * e1, e1, 0.0]))
    assert torch.allclose(ret, (adv + values) * mask)


def test_token_rewards_put_the_score_on_the_last_token():
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    old, ref = torch.full((2, 3), -1.0) * mask, torch.full((2, 3), -1.5) * mask
    rewards, kl = token_rewards(torch.tensor([2.0, 3.0]), old, ref, mask, kl_coef=0.1)
    assert torch.allclose(kl, 0.5 * mask)
    assert torch.allclose(rewards, torch.tensor([[-0.05, -0.05, 1.95], [2.95, 0.0, 0.0]]))


def test_clipped_losses():
    mask = torch.ones(1, 2)
    behaviour = torch.zeros(1, 2)
    logp = torch.tensor([[math.log(1.5), math.log(0.5)]], requires_grad=True)
    loss, stats = policy_loss(logp, behaviour, torch.tensor([[1.0, 1.0]]), mask, clip=0.2)
    loss.backward()
    # token 0: ratio 1.5 > 1.2 with A > 0 -> clipped, no gradient; token 1: ratio 0.5 -> -A * r counts
    assert abs(loss.item() - (-(1.2 + 0.5) / 2)) < 1e-6 and stats["ppo/clip_frac"] == 0.5
    assert logp.grad[0, 0] == 0 and abs(logp.grad[0, 1].item() + 0.25) < 1e-6
    values = torch.tensor([[1.0, 0.0]])
    v_loss, v_stats = value_loss(values, torch.zeros(1, 2), torch.tensor([[0.0, 0.0]]), mask, clip=0.2)
    assert abs(v_loss.item() - 0.5 * (1.0 + 0.0) / 2) < 1e-6  # max(plain 1.0, clipped 0.04) = 1.0
    with pytest.raises(ValueError, match="train.ppo.clip_range"):
        PPOConfig(clip_range=0)


def test_token_logprobs_match_the_oracle_with_ragged_prompts():
    model = make_tiny_hf_model("qwen3", seed=1)
    prompts, completions = [[5, 6, 7, 8, 9], [11, 12]], [[20, 21, 22], [30, 31, 32, 33]]
    seqs = Sequences.build(prompts, completions, pad_id=0)
    with torch.no_grad():
        got = token_logprobs(model, seqs, temperature=0.7)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        want = hf_logprobs(model, p, c, 0.7)[torch.arange(len(c)), torch.tensor(c)]
        assert torch.allclose(got[i, : len(c)], want, atol=1e-5), (got[i], want)
        assert (got[i, len(c):] == 0).all()


def test_train_ppo_script(tmp_path):
    checks = []

    def after_push(ppo):
        """After every push the engine serves exactly the policy: its logprobs equal the policy's."""
        prompt = [1, 4, 40, 41, 42]
        asleep = ppo.engine.is_sleeping  # train.sleep_level=1: the update runs with the engine asleep
        ppo.engine.wake_up()
        out = ppo.engine.generate([prompt], SamplingParams(max_tokens=4, temperature=1.0, seed=len(checks)))[0]
        if asleep:
            ppo.engine.sleep(1)
        c = out.outputs[0]
        seqs = Sequences.build([prompt], [list(c.token_ids)], ppo.pad_id)
        with torch.no_grad():
            policy = token_logprobs(ppo.policy, seqs, 1.0)[0, : len(c.token_ids)]
        checks.append((ppo.version, ppo.engine.policy_version, (policy - torch.tensor(c.logprobs)).abs().max().item()))

    out = train_ppo.run(compose(
        "train_ppo", f"output_dir={tmp_path}", f"model.cache_dir={tmp_path / 'cache'}", "train.steps=3",
        "sampling.n=2", "sampling.max_tokens=4", "data.num_prompts=2", "train.ppo.ppo_epochs=1",
        "train.ppo.num_minibatches=2", "train.reward=tests.test_ppo:short_completions", "train.sleep_level=1",
        "logger.wandb.mode=offline",
    ), on_push=after_push)
    assert [v for v, _, _ in checks] == list(range(7))  # the first sync, then one push per optimizer step
    assert all(version == engine_version and gap <= 1e-4 for version, engine_version, gap in checks), checks
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3]
    for x in lines:
        for key in ("ppo/policy_loss", "ppo/value_loss", "ppo/approx_kl", "reward", "rollout/logprob_gap_max"):
            assert math.isfinite(x[key]), (key, x)
        assert x["ppo/optimizer_steps"] == 2 and x["rollout/logprob_gap_max"] <= 1e-4
        assert 0 < x["reward"] <= 1 / 2  # short_completions: 1 / (1 + length), length >= 1
    history, config = read_run(out / "wandb")
    for key in ("ppo/policy_loss", "ppo/value_loss", "rollout/tokens_per_s", "rollout/weight_push_s",
                "rollout/kv_cache_usage_mean", "rollout/policy_lag_mean", "rollout/logprob_gap_mean", "time/train_s"):
        assert key in history, (key, sorted(history))
    assert {"engine", "job", "train"} <= config
    times = json.loads((out / "step_times.json").read_text())["steps"]
    assert len(times) == 3 and all(t["weight_push_s"] > 0 and t["generation_s"] > 0 for t in times)


@pytest.mark.parametrize("override, message", [
    ("+train.ppo.clip=0.1", "unknown key train.ppo.clip; allowed: "),
    ("+train.ppo.learning_rate=0.1", "train.ppo.learning_rate: set train.learning_rate instead"),
    ("train.ppo.lam=2", "train.ppo.lam is invalid: must be a number in [0, 1]"),
    ("sampling.temperature=0", "sampling.temperature=0 is invalid for PPO"),
    ("train.reward=tests.nowhere:score", "cannot import module 'tests.nowhere'"),
])
def test_train_ppo_refuses_bad_config(tmp_path, override, message):
    script = train_ppo
    with pytest.raises(ValueError, match=message_regex(message)):
        script.run(compose("train_ppo", f"output_dir={tmp_path}", override))


def test_ppo_refuses_what_is_not_a_backend():
    """EnginePPO takes a RolloutBackend (Engine, RolloutPool, RolloutClient), checked once at its door."""
    from types import SimpleNamespace

    from trainer_hooks.ppo_loop import EnginePPO

    other = SimpleNamespace(update_weights=None, policy_version=0, generate=None)  # engine-like, no contract
    with pytest.raises(TypeError, match="EnginePPO needs an Engine, a RolloutPool or a RolloutClient"):
        EnginePPO(other, torch.nn.Linear(1, 1), None, torch.nn.Linear(1, 1), None, None, PPOConfig(),
                  SamplingParams(temperature=1.0), sleep_level=1)
