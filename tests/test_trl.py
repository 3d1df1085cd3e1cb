"""TRL integration: GRPOTrainer with TRLRollout, and AsyncGRPOTrainer with the engine adapters (CPU, tiny)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
from datasets import Dataset
from transformers import AutoTokenizer, TrainerCallback

from rollout.assets import assets_dir
from rollout.job.rounds import RoundDriver
from rollout.sampling_params import SamplingParams
from tests.engine_helpers import hf_logprobs, make_engine
from tests.tiny_models import make_tiny_hf_model
from trainer_hooks.trl import (
    TRLRollout,
    digit_fraction,
    merged_adapter,
    sampling_params_from_args,
    tokenize_prompts,
    trl_reward,
)

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")



@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(str(assets_dir()))


def _tiny(tok, seed=0):
    return make_tiny_hf_model("llama", seed=seed, vocab_size=len(tok), pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _dataset(k: int) -> Dataset:
    return Dataset.from_dict({
        "prompt": [[{"role": "user", "content": f"What is {i} + {i * 3}?"}] for i in range(k)],
        "answer": [str(4 * i) for i in range(k)],
    })


def even_tokens(completion_ids, **_):
    """A reward with variance inside every group, so every step moves the weights."""
    return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]


@torch.no_grad()
def _max_logprob_gap(model, rows, temperature) -> float:
    """Largest |engine logprob - model's teacher-forced logprob| over every row and token."""
    gap = 0.0
    for p, c, lps in zip(rows["prompt_ids"], rows["completion_ids"], rows["logprobs"]):
        ref = hf_logprobs(model, p, c, temperature)[torch.arange(len(c)), torch.tensor(c)]
        gap = max(gap, (torch.tensor(lps) - ref).abs().max().item())
    return gap


# ---- GRPOTrainer + TRLRollout ---------------------------------------------------------------------------
def test_grpo_trainer_with_engine_rollouts(tok, tmp_path):
    from trl import GRPOConfig, GRPOTrainer

    model = _tiny(tok)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine = make_engine(_tiny(tok, seed=7), block_size=4)  # different weights: the first sync must fix them
    rollout = TRLRollout(engine)
    requests, shared, checks = [], set(), []
    scheduler = engine.scheduler
    add, schedule = scheduler.add, scheduler.schedule

    def spy_add(request):  # every request generate() queues passes through the scheduler
        requests.append((len(request.prompt_token_ids), request.params.n))
        return add(request)

    def spy_schedule(*args):
        by_request = {}
        for seq in scheduler.running:
            by_request.setdefault(seq.request_id, []).append(seq.block_table[:1])
        shared.update(r for r, tables in by_request.items() if len(tables) > 1 and all(tables[0] == t for t in tables))
        return schedule(*args)

    scheduler.add, scheduler.schedule = spy_add, spy_schedule

    def checked_rollout(prompts, trainer):
        rows = rollout(prompts, trainer)
        unwrapped = trainer.accelerator.unwrap_model(trainer.model)
        step_now = trainer.state.global_step
        checks.append((step_now, engine.policy_version, set(rows["policy_version"]),
                       _max_logprob_gap(unwrapped, rows, trainer.args.temperature)))
        return rows

    seen_versions = []

    def versions_reward(completions, policy_version, **_):
        seen_versions.extend(policy_version)
        return [0.0] * len(completions)

    args = GRPOConfig(
        output_dir=str(tmp_path), use_cpu=True, report_to="none", per_device_train_batch_size=8, num_generations=4,
        max_completion_length=6, max_steps=3, learning_rate=5e-3, logging_steps=1, save_strategy="no",
        temperature=0.9, seed=0, bf16=False, disable_tqdm=True,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=[even_tokens, versions_reward], args=args,
                          train_dataset=_dataset(8), processing_class=tok, rollout_func=checked_rollout)
    trainer.train()

    assert [c[0] for c in checks] == [0, 1, 2]
    for step_now, version, row_versions, gap in checks:
        assert version == step_now and row_versions == {step_now}
        assert gap <= 1e-4, (step_now, gap)
    assert sorted(set(seen_versions)) == [0, 1, 2]
    assert requests and all(n == 4 for _, n in requests) and len(requests) == 2 * len(checks)
    assert len(shared) == len(requests)  # every group's samples shared their first prompt block
    moved = [n for n, p in model.named_parameters() if not torch.equal(p.detach(), initial[n])]
    assert len(moved) == len(initial)


# ---- the pieces, with a stand-in trainer ----------------------------------------------------------------
def _fake_trainer(model, tok, step=0, **args):
    defaults = dict(temperature=1.0, top_p=1.0, top_k=0, min_p=None, max_completion_length=5,
                    generation_kwargs=None, repetition_penalty=1.0)
    return SimpleNamespace(
        model=model, processing_class=tok, state=SimpleNamespace(global_step=step),
        accelerator=SimpleNamespace(unwrap_model=lambda m: m), args=SimpleNamespace(**{**defaults, **args}),
        eos_token_ids=[tok.eos_token_id], chat_template_kwargs={}, tools=None, chat_template=None,
    )


def test_runs_of_identical_prompts_become_one_request_each(tok):
    model = _tiny(tok)
    engine = make_engine(model, block_size=4)
    calls = []
    add = engine.scheduler.add
    engine.scheduler.add = lambda request: calls.append(request.params.n) or add(request)
    prompts = ["1 + 1 =", "1 + 1 =", "7 * 8 =", "7 * 8 =", "7 * 8 =", "1 + 1 ="]
    rows = TRLRollout(engine)(prompts, _fake_trainer(model, tok, step=3, temperature=0.7))
    assert calls == [2, 3, 1] and engine.policy_version == 3
    assert len(rows["completion_ids"]) == 6 and rows["policy_version"] == [3] * 6
    plain = tok(text=prompts)["input_ids"]
    assert rows["prompt_ids"] == [list(x) for x in plain]
    assert _max_logprob_gap(model, rows, 0.7) <= 1e-4
    assert all(1 <= len(c) <= 5 for c in rows["completion_ids"])


def test_sync_only_when_the_step_moves(tok):
    model = _tiny(tok)
    engine = make_engine(model, block_size=4)
    rollout = TRLRollout(engine)
    trainer = _fake_trainer(model, tok, step=0)
    assert rollout.maybe_sync(trainer) and not rollout.maybe_sync(trainer)
    trainer.state.global_step = 4
    assert rollout.maybe_sync(trainer) and engine.policy_version == 4


def test_chat_prompts_use_the_chat_template(tok):
    trainer = _fake_trainer(None, tok)
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    ids = tokenize_prompts([messages], trainer)[0]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ids == tok(text, add_special_tokens=False)["input_ids"]
    with pytest.raises(TypeError, match="prompts must be"):
        tokenize_prompts([3], trainer)


def test_sampling_params_from_trainer_args():
    args = SimpleNamespace(temperature=0.7, top_p=0.9, top_k=5, min_p=None, max_completion_length=12,
                           generation_kwargs={"min_tokens": 2, "top_k": 7}, repetition_penalty=1.0)
    p = sampling_params_from_args(args, [2])
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens, p.min_tokens) == (0.7, 0.9, 7, 0.0, 12, 2)
    assert p.stop_token_ids == [2] and p.logprobs_mode == "policy"
    args.generation_kwargs = {"ignore_eos": True}
    assert sampling_params_from_args(args, [2]).stop_token_ids is None
    args.generation_kwargs = {"num_beams": 4}
    with pytest.raises(ValueError, match="num_beams"):
        sampling_params_from_args(args)
    args.generation_kwargs, args.repetition_penalty = None, 1.1
    with pytest.raises(ValueError, match="repetition_penalty"):
        sampling_params_from_args(args)


def test_peft_adapter_is_merged_for_the_push_only():
    calls = []
    model = SimpleNamespace(merge_adapter=lambda: calls.append("merge"),
                            unmerge_adapter=lambda: calls.append("unmerge"))
    with pytest.raises(RuntimeError):
        with merged_adapter(model):
            raise RuntimeError("push failed")
    assert calls == ["merge", "unmerge"]


def test_rewards_in_trl_convention_and_actor_target(tok):
    from rollout.rl.rewards import exact_match

    reward = trl_reward(exact_match)
    assert reward.__name__ == "exact_match"
    completions = ["it is 14", [{"role": "assistant", "content": "15"}]]
    assert reward(prompts=["a", "b"], completions=completions, answer=["14", "14"]) == [1.0, 0.0]
    assert digit_fraction("12 ab") == 0.5 and digit_fraction("") == 0.0
    engine = make_engine(_tiny(tok), block_size=4)
    assert TRLRollout(engine).engine is engine
    actor = RoundDriver(engine, None, SamplingParams(), num_prompts=1)
    for not_a_backend in (object(), actor):  # the job's round driver is not a backend: pass its engine
        with pytest.raises(TypeError, match="TRLRollout needs an Engine, a RolloutPool or a RolloutClient"):
            TRLRollout(not_a_backend)


# ---- AsyncGRPOTrainer with the engine adapters ----------------------------------------------------------
class _Logs(TrainerCallback):
    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "kl" in logs:
            self.logs.append(dict(logs))


def test_async_grpo_trainer_runs_on_the_engine(tok, tmp_path):
    from trl.experimental.async_grpo import AsyncGRPOConfig

    from trainer_hooks.async_trainer import build_async_grpo_trainer

    model_dir = tmp_path / "model"
    _tiny(tok).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    engine = make_engine(_tiny(tok, seed=7), block_size=4)  # stale weights: the cold sync replaces them
    args = AsyncGRPOConfig(
        output_dir=str(tmp_path / "out"), use_cpu=True, report_to="none", per_device_train_batch_size=8,
        num_generations=4, max_completion_length=6, max_steps=3, learning_rate=5e-3, logging_steps=1,
        save_strategy="no", temperature=0.9, seed=0, bf16=False, gradient_checkpointing=False, token_budget=0,
        disable_tqdm=True,
    )
    logs = _Logs()
    trainer = build_async_grpo_trainer(str(model_dir), engine, [even_tokens], args, _dataset(6), tok,
                                       callbacks=[logs])
    trainer.train()

    assert trainer.model_version == engine.policy_version == 4  # cold sync + one per step
    assert len(trainer.weight_transfer.seconds) == 4
    assert len(logs.logs) == 3
    first = logs.logs[0]  # on-policy batch: the trainer's recomputed logprobs equal the engine's
    assert abs(first["kl"]) < 1e-6 and abs(first["ratio"] - 1) < 1e-5, first
    assert first["sampling/sampling_logp_difference/max"] < 1e-4, first  # fp32: the engine's logprobs are exact
    assert abs(first["sampling/importance_sampling_ratio/mean"] - 1) < 1e-4
    for log in logs.logs:  # every optimizer step computes the gap and pushes weights
        assert {"rollout/logprob_gap_max", "rollout/weight_push_s"} <= set(log), sorted(log)
    # The engine's window metrics arrive when a group finishes; a step served from groups already buffered
    # logs none, so they are checked over the run (group 0's are queued before group 1 finishes, i.e. before
    # the first batch is complete).
    logged = set().union(*map(set, logs.logs))
    assert {"rollout/tokens_per_s", "rollout/kv_cache_usage_mean", "rollout/policy_lag_max"} <= logged, sorted(logged)
    assert not engine.has_unfinished_requests() and not trainer.rollout_worker.running
    # After the last sync the engine serves exactly the trained weights.
    trained = _tiny(tok)  # plain attention: the trainer's copy is wired for packed tree batches
    trained.load_state_dict(trainer.accelerator.unwrap_model(trainer.model).state_dict())
    prompt = tok.apply_chat_template(_dataset(1)["prompt"][0], add_generation_prompt=True, tokenize=True,
                                     return_dict=True)["input_ids"]
    out = engine.generate([prompt], SamplingParams(max_tokens=6, temperature=0.9, seed=1))[0].outputs[0]
    rows = {"prompt_ids": [prompt], "completion_ids": [out.token_ids], "logprobs": [out.logprobs]}
    assert _max_logprob_gap(trained, rows, 0.9) <= 1e-4
