"""EngineGRPOTrainer: the engine's logprobs in TRL's importance-sampling correction, and rollout/* metrics."""

from __future__ import annotations

import math
import os

import pytest
import torch
from datasets import Dataset
from transformers import AutoTokenizer, TrainerCallback

from rollout.assets import assets_dir
from tests.engine_helpers import make_engine
from tests.tiny_models import make_tiny_hf_model
from trainer_hooks.trl import TRLRollout

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
ROLLOUT_KEYS = {"rollout/generation_s", "rollout/tokens_per_s", "rollout/kv_cache_usage_mean", "rollout/preemptions",
                "rollout/weight_push_s", "rollout/policy_lag_mean", "rollout/policy_lag_max",
                "rollout/logprob_gap_mean", "rollout/logprob_gap_max"}
IS_KEYS = {"sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max",
           "sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/mean",
           "sampling/importance_sampling_ratio/max"}


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(str(assets_dir()))


def _tiny(tok, seed=0):
    return make_tiny_hf_model("llama", seed=seed, vocab_size=len(tok), pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _dataset(k: int) -> Dataset:
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": f"What is {i} + {i * 3}?"}] for i in range(k)]})


def even_tokens(completion_ids, **_):
    return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]


class _Logs(TrainerCallback):
    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "reward" in logs:
            self.logs.append(dict(logs))


class _Shifted(TRLRollout):
    """Reports every engine logprob 0.5 lower: the trainer must see a ratio exp(0.5) on every token."""

    def __call__(self, prompts, trainer):
        rows = super().__call__(prompts, trainer)
        rows["logprobs"] = [[lp - 0.5 for lp in lps] for lps in rows["logprobs"]]
        return rows


def _train(tok, tmp_path, rollout_cls=TRLRollout, steps=3, **config):
    from trl import GRPOConfig

    from trainer_hooks.grpo import EngineGRPOTrainer

    engine = make_engine(_tiny(tok, seed=7), block_size=4)  # stale weights: the first sync replaces them
    rollout = rollout_cls(engine)
    args = GRPOConfig(
        output_dir=str(tmp_path), use_cpu=True, report_to="none", per_device_train_batch_size=8, num_generations=4,
        max_completion_length=6, max_steps=steps, learning_rate=5e-3, logging_steps=1, save_strategy="no",
        temperature=0.9, seed=0, bf16=False, disable_tqdm=True, gradient_checkpointing=False,
        vllm_importance_sampling_mode="token_truncate", **config,
    )
    logs = _Logs()
    trainer = EngineGRPOTrainer(model=_tiny(tok), reward_funcs=[even_tokens], args=args, train_dataset=_dataset(8),
                                processing_class=tok, rollout_func=rollout, callbacks=[logs])
    trainer.train()
    return logs.logs, engine, trainer


def test_engine_logprobs_drive_the_is_correction(tok, tmp_path):
    logs, engine, trainer = _train(tok, tmp_path)
    assert len(logs) == 3 and engine.policy_version == 2
    for log in logs:
        assert IS_KEYS | ROLLOUT_KEYS <= set(log), sorted(set(IS_KEYS | ROLLOUT_KEYS) - set(log))
        assert log["sampling/sampling_logp_difference/max"] < 1e-4, log  # float32: engine == trainer
        assert log["rollout/logprob_gap_max"] == log["sampling/sampling_logp_difference/max"]
        assert abs(log["sampling/importance_sampling_ratio/mean"] - 1) < 1e-4
        assert log["rollout/tokens_per_s"] > 0 and log["rollout/policy_lag_max"] == 0
        assert 0 < log["rollout/kv_cache_usage_mean"] <= 1


def test_is_ratio_follows_the_rollout_logprobs(tok, tmp_path):
    logs, _, _ = _train(tok, tmp_path, rollout_cls=_Shifted, steps=1)
    log = logs[0]
    assert abs(log["sampling/sampling_logp_difference/mean"] - 0.5) < 1e-4
    assert abs(log["sampling/importance_sampling_ratio/mean"] - math.exp(0.5)) < 1e-3
    clipped, _, _ = _train(tok, tmp_path / "clip", rollout_cls=_Shifted, steps=1,
                           vllm_importance_sampling_clip_max=1.2)  # truncated IS: the ratio is capped
    assert abs(clipped[0]["sampling/importance_sampling_ratio/max"] - 1.2) < 1e-6


def test_plain_grpo_trainer_has_no_correction_but_gets_engine_metrics(tok, tmp_path):
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", per_device_train_batch_size=4,
                      num_generations=4, max_completion_length=4, max_steps=1, logging_steps=1, save_strategy="no",
                      bf16=False, disable_tqdm=True, gradient_checkpointing=False)
    logs = _Logs()
    trainer = GRPOTrainer(model=_tiny(tok), reward_funcs=[even_tokens], args=args, train_dataset=_dataset(2),
                          processing_class=tok, rollout_func=TRLRollout(make_engine(_tiny(tok), block_size=4)),
                          callbacks=[logs])
    trainer.train()
    assert not IS_KEYS & set(logs.logs[0]) and "rollout/tokens_per_s" in logs.logs[0]


def test_engine_trainer_refuses_other_rollouts_and_trl_versions(tok, tmp_path, monkeypatch):
    import trl
    from trl import GRPOConfig

    from trainer_hooks.grpo import EngineGRPOTrainer, check_trl_version

    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", per_device_train_batch_size=4,
                      num_generations=4, max_steps=1)
    with pytest.raises(TypeError, match="TRLRollout"):
        EngineGRPOTrainer(model=_tiny(tok), reward_funcs=[even_tokens], args=args, train_dataset=_dataset(2),
                          processing_class=tok, rollout_func=lambda prompts, trainer: {})
    monkeypatch.setattr(trl, "__version__", "1.17.0")
    with pytest.raises(ImportError, match="trl==1.16.0.*found trl==1.17.0"):
        check_trl_version()


def test_sleep_between_generations_and_co_located_push(tok):
    from types import SimpleNamespace

    model = _tiny(tok)
    engine = make_engine(_tiny(tok, seed=3), block_size=4)
    logged = {}
    trainer = SimpleNamespace(
        model=model, processing_class=tok, state=SimpleNamespace(global_step=0), eos_token_ids=[tok.eos_token_id],
        accelerator=SimpleNamespace(unwrap_model=lambda m: m), chat_template_kwargs={}, tools=None,
        chat_template=None, _log_metric=lambda k, v: logged.setdefault(k, []).append(v),
        args=SimpleNamespace(temperature=1.0, top_p=1.0, top_k=0, min_p=None, max_completion_length=4,
                             generation_kwargs=None, repetition_penalty=1.0, report_to=[]),
    )
    rollout = TRLRollout(engine, sleep_level=1)
    rows = rollout(["1 + 1 =", "1 + 1 ="], trainer)
    assert engine.is_sleeping and len(rows["completion_ids"]) == 2
    trainer.state.global_step = 1
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(1.5)  # a training step happened
    rows = rollout(["2 + 2 ="], trainer)  # pushed while asleep, woken to generate, asleep again
    assert engine.is_sleeping and engine.policy_version == 1 and rows["policy_version"] == [1]
    assert len(logged["rollout/weight_push_s"]) == 2 and len(logged["rollout/tokens_per_s"]) == 2
    assert rollout.seconds["generation"] > 0 and rollout.seconds["weight_push"] > 0
    with pytest.raises(ValueError, match="sleep_level=3"):
        TRLRollout(engine, sleep_level=3)
