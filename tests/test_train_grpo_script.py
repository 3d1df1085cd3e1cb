"""rollout-train-grpo: both trainers end to end (tiny, CPU), its W&B run, the GRPOConfig passthrough, errors."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from rollout.cli import train_grpo
from tests.script_helpers import compose, message_regex
from tests.wandb_offline import read_run

SMALL = ("train.steps=2", "sampling.n=2", "sampling.max_tokens=4", "data.num_prompts=2")


@pytest.mark.parametrize("trainer", ["grpo", "async_grpo"])
def test_train_script_runs_and_logs_rewards(tmp_path, caplog, trainer):
    caplog.set_level(logging.INFO, logger="rollout.train")
    out = train_grpo.run(compose(
        "train_grpo", f"output_dir={tmp_path}", f"model.cache_dir={tmp_path / 'cache'}", f"train.trainer={trainer}",
        "logger.wandb.mode=disabled", *SMALL,
    ))
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2] and all("reward" in x for x in lines)
    assert all("rollout/logprob_gap_max" in x for x in lines), sorted(lines[-1])
    # GRPO generates inside every step; the async worker's window metrics come when a group finishes, and a
    # step served from groups already buffered logs none (tests/test_trl.py says when they must have come).
    with_speed = [x for x in lines if "rollout/tokens_per_s" in x]
    assert with_speed == lines if trainer == "grpo" else with_speed, sorted(lines[-1])
    assert "step    2  reward" in caplog.text and "digit_fraction: mean of the first" in caplog.text


@pytest.mark.parametrize("trainer", ["grpo", "async_grpo"])
def test_train_script_partial_mode(tmp_path, monkeypatch, trainer):
    """rollout.mode=partial: TRLRollout(mode="partial") (rewards wrapped by EngineGRPOTrainer), or the async
    worker with max_staleness; their rollout/* partial metrics reach metrics.jsonl."""
    from trainer_hooks import async_grpo

    staleness = []
    init = async_grpo.EngineRolloutWorker.__init__
    monkeypatch.setattr(async_grpo.EngineRolloutWorker, "__init__",
                        lambda self, *a, **kw: staleness.append(kw.get("max_staleness")) or init(self, *a, **kw))
    out = train_grpo.run(compose(
        "train_grpo", f"output_dir={tmp_path}", f"model.cache_dir={tmp_path / 'cache'}", f"train.trainer={trainer}",
        "logger.wandb.mode=disabled", "rollout.mode=partial", "rollout.max_staleness=1", *SMALL,
    ))
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2] and all("reward" in x for x in lines)
    logged = set().union(*map(set, lines))
    if trainer == "grpo":
        assert {"rollout/carried_over_groups", "rollout/staleness_max", "rollout/dropped_groups"} <= logged
        assert all(x["rollout/staleness_max"] <= 1 for x in lines)
    else:
        assert staleness == [1]
        assert {"rollout/carried_over_groups", "rollout/policy_version_max"} <= logged, sorted(logged)


def test_grpo_run_logs_engine_metrics_to_offline_wandb(tmp_path):
    out = train_grpo.run(compose(
        "train_grpo", f"output_dir={tmp_path}", f"model.cache_dir={tmp_path / 'cache'}", "logger.wandb.mode=offline",
        "train.sleep_level=1", "+train.grpo.vllm_importance_sampling_clip_max=2.0", *SMALL,
    ))
    history, config = read_run(out / "wandb")
    for key in ("rollout/tokens_per_s", "rollout/generation_s", "rollout/weight_push_s", "rollout/kv_cache_usage_mean",
                "rollout/preemptions", "rollout/policy_lag_max", "rollout/logprob_gap_max",
                "sampling/sampling_logp_difference/max", "sampling/importance_sampling_ratio/mean"):
        assert f"train/{key}" in history, (key, sorted(history))
    assert {"engine", "job", "train"} <= config, config
    times = json.loads((out / "step_times.json").read_text())
    assert [s["step"] for s in times["steps"]] == [1, 2]
    assert all(s["generation_s"] > 0 and s["train_s"] > 0 for s in times["steps"])
    assert times["steps"][1]["weight_push_s"] > 0  # the push after step 1 lands in step 2's window


def test_grpo_config_passthrough():
    script = train_grpo
    job, train, _ = script.load_config(_raw("+train.grpo.loss_type=dr_grpo", "+train.grpo.epsilon_high=0.28",
                                         "+train.grpo.gradient_accumulation_steps=4"))

    args = script.trainer_args(job, train, torch.device("cpu"), ["none"])
    assert (args.loss_type, args.epsilon_high, args.gradient_accumulation_steps) == ("dr_grpo", 0.28, 4)
    assert args.per_device_train_batch_size * 4 == job.data.num_prompts * job.sampling.n
    assert args.vllm_importance_sampling_mode == "token_truncate"


def _raw(*overrides: str) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(compose("train_grpo", "output_dir=/tmp/unused", *overrides), resolve=True)


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.trainer=ppo", "train.trainer='ppo'"),
        ("train.steps=0", "train.steps=0"),
        ("+train.bogus=1", "train.bogus"),
        ("sampling.n=1", "sampling.n=1"),
        ("sampling.logprobs_mode=raw", "sampling.logprobs_mode='raw'"),
        ("engine.block_size=12", "block_size"),
        ("train.reward=nope", "train.reward='nope' is invalid: must be one of ['digit_fraction', 'exact_match']"),
        ("train.sleep_level=3", "train.sleep_level=3"),
        ("+train.grpo.loss_typo=dapo", "train.grpo.loss_typo is not a field of trl.GRPOConfig.*did you mean"),
        ("+train.grpo.temperature=0.5", "train.grpo.temperature is set by this script from sampling.temperature"),
        ("+train.grpo.gradient_accumulation_steps=3", "gradient_accumulation_steps=3 must be >= 1 and divide"),
        ("rollout.mode=drain", "rollout.mode='drain' is invalid: must be one of ['engine', 'partial', 'server']"),
        ("rollout.max_staleness=1", "rollout.max_staleness=1 is invalid: must be null with rollout.mode=engine"),
        ("rollout.mode=partial rollout.max_staleness=-1", "rollout.max_staleness=-1 is invalid"),
        ("rollout.mode=partial rollout.stale_groups=keep", "rollout.stale_groups='keep' is invalid"),
        ("rollout.mode=partial train.sleep_level=1", "train.sleep_level must be 0 with rollout.mode=partial"),
        ("rollout.mode=partial train.trainer=async_grpo rollout.max_inflight_groups=4",
         "rollout.max_inflight_groups must be null and rollout.stale_groups drop with train.trainer=async_grpo"),
        ("+rollout.bogus=1", "unknown key"),
    ],
)
def test_train_script_refuses_bad_config(tmp_path, override, message):
    script = train_grpo
    with pytest.raises(ValueError, match=message_regex(message)):
        job, train, _ = script.load_config(_raw(*override.split()))

        script.trainer_args(job, train, torch.device("cpu"), ["none"])


def test_grpo_generates_with_a_pool_of_two_replicas(tmp_path):
    """pool.replicas=2 puts TRLRollout over a RolloutPool of two CPU Ray actors (about 30 s: Ray's start), both
    asleep while the trainer trains (train.sleep_level=1 without co-location: every replica sleeps)."""
    ray = pytest.importorskip("ray", reason="the pool needs Ray")
    try:
        out = train_grpo.run(compose(
            "train_grpo", f"output_dir={tmp_path}", f"model.cache_dir={tmp_path / 'cache'}",
            "logger.wandb.mode=disabled", "pool.replicas=2", "pool.gpus_per_replica=0", "train.steps=1",
            "sampling.n=2", "sampling.max_tokens=4", "data.num_prompts=2", "train.sleep_level=1",
        ))
    finally:
        ray.shutdown()
    (line,) = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert line["step"] == 1 and line["rollout/generated_tokens"] == 2 * 2 * 4 and "rollout/logprob_gap_max" in line
    assert line["rollout/pool/alive"] == 2 and line["rollout/pool/replica_1/alive"] == 1  # per replica, as PPO's


@pytest.mark.parametrize("overrides, err", [
    (("train.trainer=async_grpo",), "needs rollout.mode=engine and train.trainer=grpo"),
    (("rollout.mode=server",), "needs rollout.mode=engine and train.trainer=grpo"),
    (("rollout.mode=partial",), "needs rollout.mode=engine and train.trainer=grpo"),
])
def test_pool_refuses_what_it_cannot_do(overrides, err):
    with pytest.raises(ValueError, match=err):
        train_grpo.load_config(_raw("pool.replicas=2", *overrides))


def test_wandb_env_wins_over_an_earlier_wandb_setup(tmp_path, monkeypatch):
    """wandb reads the environment once per process: after an earlier online attempt (the job's
    ``logger.wandb.mode=online`` without an account, say), the trainer's offline run asked for a login."""
    import wandb

    from rollout.settings.schema import WandbConfig
    from trainer_hooks.train_setup import wandb_env

    for key in ("WANDB_MODE", "WANDB_PROJECT", "WANDB_DIR", "WANDB_DISABLE_GIT", "WANDB_CONSOLE", "WANDB_SILENT"):
        monkeypatch.setenv(key, "")  # restored afterwards, whatever wandb_env sets
        monkeypatch.delenv(key)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    wandb.setup()  # the process's first setup, online by default
    assert wandb_env(WandbConfig(mode="offline"), tmp_path) == ["wandb"]
    run = wandb.init(project="rollout-test")  # what transformers' W&B callback calls
    try:
        assert run.settings.mode == "offline"
    finally:
        wandb.finish()
