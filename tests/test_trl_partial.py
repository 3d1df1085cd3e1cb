"""Partial rollouts for TRL (issue 14, item 5): TRLRollout(mode="partial") and the async-GRPO worker's staleness.

A scripted engine (tests/job_fakes.FakeEngine: one token per step, lengths chosen per prompt) makes which
groups finish in which call exact, so nothing here depends on timing.
"""

from __future__ import annotations

import os
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from datasets import Dataset
from transformers import AutoTokenizer

from rollout.assets import assets_dir
from tests.engine_helpers import make_engine
from tests.job_fakes import FakeEngine
from tests.tiny_models import make_tiny_hf_model
from trainer_hooks.trl import TRLRollout
from trainer_hooks.trl_partial import GROUP_KEY

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
N = 2
LONG = 12  # a long sample's length; the others stop within 3 tokens


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(str(assets_dir()))


def _dataset(k: int) -> Dataset:
    return Dataset.from_dict({"prompt": [f"What is {i} + {3 * i}?" for i in range(k)],
                              "answer": [str(4 * i) for i in range(k)]})


def _length_fn(tok, dataset):
    """Every third dataset row has one long sample; the rest stop after 1-3 tokens (by prompt length)."""
    long = {tuple(tok(text=p)["input_ids"]) for i, p in enumerate(dataset["prompt"]) if i % 3 == 0}
    return lambda prompt, index: LONG if tuple(prompt) in long and index == 1 else 1 + (len(prompt) + index) % 3


def _trainer(tok, dataset, step=0, reward_funcs=None, training=True):
    args = SimpleNamespace(temperature=1.0, top_p=1.0, top_k=0, min_p=None, max_completion_length=20,
                           generation_kwargs=None, repetition_penalty=1.0, num_generations=N, seed=0)
    return SimpleNamespace(
        model=torch.nn.Linear(1, 1).train(training), processing_class=tok, state=SimpleNamespace(global_step=step),
        accelerator=SimpleNamespace(unwrap_model=lambda m: m), args=args, eos_token_ids=[tok.eos_token_id],
        chat_template_kwargs={}, tools=None, chat_template=None, num_generations=N, train_dataset=dataset,
        reward_funcs=reward_funcs,
    )


def _batch(dataset, rows):
    """TRL's order: each prompt repeated num_generations times in a row."""
    return [dataset[i]["prompt"] for i in rows for _ in range(N)]


def _check_groups(rows, outs, n_groups):
    """Rows come in complete groups of N: one group id, every sample finished, one row per sample."""
    gids = rows[GROUP_KEY]
    assert len(gids) == n_groups * N
    for b in range(n_groups):
        block = gids[b * N:(b + 1) * N]
        assert len(set(block)) == 1
        assert len(outs[b].outputs) == N and all(c.finish_reason in ("stop", "length") for c in outs[b].outputs)
        assert all(rows["prompt_ids"][b * N + i] == list(outs[b].prompt_token_ids) for i in range(N))
    return [gids[b * N] for b in range(n_groups)]


def _snapshot(rollout):
    """Tokens each running sample holds now (group id, sample index) -> count."""
    held = {}
    for rid, group in rollout.partial.tracker.running.items():
        for c in rollout.engine.partial_output(rid).outputs:
            held[(group.group_id, c.index)] = len(c.token_ids)
    return held


# ---- TRLRollout(mode="partial") over a scripted engine --------------------------------------------------
def test_partial_calls_hand_out_each_group_once_with_versions_changing_at_each_push(tok):
    dataset = _dataset(24)
    engine = FakeEngine(length=_length_fn(tok, dataset))
    rollout = TRLRollout(engine, mode="partial", recompute_running=False)
    returned, prompts_of, snaps, carried, crossed = [], {}, [], 0, 0
    for call in range(5):
        trainer = _trainer(tok, dataset, step=call, reward_funcs=rollout.wrap_rewards([lambda **_: [0.0]]))
        rows = rollout(_batch(dataset, range(4 * call, 4 * call + 4)), trainer)
        assert engine.policy_version == call and engine.updates[-1][1] is False  # pushed, recompute_running passed
        gids = _check_groups(rows, rollout.last_outputs, 4)
        prompts_of.update({g: rollout.partial.groups[g].prompt for g in gids})
        carried += sum(g not in rollout.partial.incoming for g in gids)
        returned += gids
        snaps.append(_snapshot(rollout))
        m = rollout.last_metrics
        tracker = rollout.partial.tracker
        assert m["rollout/carried_over_groups"] == len(tracker.running) + len(tracker.ready) == 4
        assert m["rollout/carried_over_tokens"] == sum(snaps[-1].values())
        # The versions of each row: per token, the call (= pushed version) that generated it.
        crossed += sum(len(set(v)) > 1 for v in rows["policy_versions"])
        for j, versions in enumerate(rows["policy_versions"]):
            assert len(versions) == len(rows["completion_ids"][j]) and versions == sorted(versions)
            assert rows["policy_version"][j] == (versions[0] if versions else call)
            key = (rows[GROUP_KEY][j], j % N)
            for k in range(call):  # tokens held at the end of call k were made by versions <= k, later ones after
                if key in snaps[k]:
                    assert sum(v <= k for v in versions) == snaps[k][key], (key, k, versions)
    assert carried > 0 and crossed > 0, "no group crossed a push: the test proves nothing"
    assert len(returned) == len(set(returned)) == 20  # every group handed out once
    assert all(g in prompts_of for g in returned)
    in_flight = set(rollout.partial.groups) - set(returned)
    assert set(returned) | in_flight == set(range(rollout.partial._next_id))  # nothing lost
    rollout.close()
    assert not engine.has_unfinished_requests()


def test_rewards_see_each_rows_own_prompt_and_columns(tok):
    """TRL scores row i against ITS prompts[i] and batch columns; the wrapper swaps in the row's own group's."""
    dataset = _dataset(24)
    length = _length_fn(tok, dataset)
    engine = FakeEngine(length=length)
    rollout = TRLRollout(engine, mode="partial", max_inflight_groups=6)
    seen = []

    def consistent(prompts, completions, completion_ids, answer, **kw):
        for j, (p, a, ids) in enumerate(zip(prompts, answer, completion_ids, strict=True)):
            # the answer column and the completion (its length is scripted by its prompt) match the prompt
            seen.append((a == str(4 * int(p.split()[2])), len(ids) == length(tok(text=p)["input_ids"], j % N)))
        return [1.0] * len(prompts)

    wrapped = rollout.wrap_rewards(consistent)[0]
    assert wrapped.__name__ == "consistent"
    swapped = 0
    for call in range(4):
        batch_rows = list(range(3 * call, 3 * call + 3))
        prompts = _batch(dataset, batch_rows)
        rows = rollout(prompts, _trainer(tok, dataset, step=call, reward_funcs=[wrapped]))
        # What GRPOTrainer does next: its inputs (the batch's dataset rows) get the extra fields merged in,
        # then each reward function gets TRL's prompts and those columns.
        inputs = [dict(dataset[i]) for i in batch_rows for _ in range(N)]
        for i, inp in enumerate(inputs):
            inp.update({k: v[i] for k, v in rows.items() if k not in ("prompt_ids", "completion_ids", "logprobs")})
        kwargs = {k: [x[k] for x in inputs] for k in inputs[0] if k != "prompt"}
        wrapped(prompts=prompts, completions=["x"] * len(prompts), completion_ids=rows["completion_ids"],
                trainer_state=None, log_metric=None, **kwargs)
        own = [rollout.partial.groups[g].prompt for g in rows[GROUP_KEY]]
        swapped += sum(a != b for a, b in zip(own, prompts))
        assert [tok(text=p)["input_ids"] for p in own] == rows["prompt_ids"]
    assert swapped > 0, "no carried-over group: the test proves nothing"
    assert seen and all(a and b for a, b in seen)
    with pytest.raises(ValueError, match="wrap_rewards"):
        rollout(_batch(dataset, [20]), _trainer(tok, dataset, step=9, reward_funcs=[consistent]))


def test_staleness_drops_are_counted_and_regenerate_loses_nothing(tok):
    dataset = _dataset(40)
    for policy in ("drop", "regenerate"):
        engine = FakeEngine(length=_length_fn(tok, dataset))
        rollout = TRLRollout(engine, mode="partial", max_staleness=0, stale_groups=policy)
        returned, dropped, regenerated = [], 0, 0
        for call in range(5):
            rows = rollout(_batch(dataset, range(4 * call, 4 * call + 4)), _trainer(tok, dataset, step=call))
            _check_groups(rows, rollout.last_outputs, 4)
            assert all(set(v) <= {call} for v in rows["policy_versions"])  # staleness 0: only the current version
            m = rollout.last_metrics
            assert m["rollout/staleness_max"] == 0
            dropped += m["rollout/dropped_groups"]
            regenerated += m["rollout/regenerated_groups"]
            returned += rows[GROUP_KEY][::N]
        assert len(returned) == len(set(returned)) == 20
        admitted = set(range(rollout.partial._next_id))
        pending = set(rollout.partial.groups) - set(returned)
        if policy == "drop":
            assert dropped > 0 and regenerated == 0
            assert len(admitted - set(returned) - pending) == dropped  # the dropped ones, and only they, are gone
        else:
            assert regenerated > 0 and dropped == 0
            assert set(returned) | pending == admitted


def test_drain_is_the_default_and_unchanged(tok):
    model = make_tiny_hf_model("llama", vocab_size=len(tok), pad_token_id=0, bos_token_id=1, eos_token_id=2)
    prompts = ["1 + 1 =", "1 + 1 =", "7 * 8 =", "7 * 8 ="]
    trainer = _trainer(tok, None, step=0)
    trainer.model, trainer.args.generation_kwargs = model, {"seed": 3}
    outs = [TRLRollout(make_engine(model, block_size=4), **kw)(prompts, trainer) for kw in ({}, {"mode": "drain"})]
    assert outs[0] == outs[1] and sorted(outs[0]) == ["completion_ids", "logprobs", "policy_version", "prompt_ids"]
    with pytest.raises(ValueError, match="max_staleness=1 is partial mode's"):
        TRLRollout(FakeEngine(), max_staleness=1)
    with pytest.raises(ValueError, match="mode='fast' is invalid"):
        TRLRollout(FakeEngine(), mode="fast")
    with pytest.raises(ValueError, match="sleep_level=1 is invalid with mode='partial'"):
        TRLRollout(FakeEngine(), mode="partial", sleep_level=1)
    with pytest.raises(ValueError, match="max_staleness=-1 is invalid"):
        TRLRollout(FakeEngine(), mode="partial", max_staleness=-1)
    from trainer_hooks.client import RolloutClient

    client = RolloutClient("http://127.0.0.1:9")  # a backend, but one that cannot carry groups across calls
    with pytest.raises(TypeError, match=r"TRLRollout\(mode='partial'\) needs an in-process Engine"):
        TRLRollout(client, mode="partial")
    client.close()


def test_partial_on_the_engine_with_an_eval_call_between(tok):
    """The real engine's add_request / step / partial_output path, and an eval call (TRL's prompts, in order)
    while groups are carried over."""
    model = make_tiny_hf_model("llama", vocab_size=len(tok), pad_token_id=0, bos_token_id=1, eos_token_id=2)
    engine = make_engine(model, block_size=4)
    dataset = _dataset(16)
    rollout = TRLRollout(engine, mode="partial", max_inflight_groups=6)
    stops = list(range(3, len(tok), 8))  # an eighth of the vocabulary stops a sample: lengths vary

    def trainer(step, training=True):
        t = _trainer(tok, dataset, step=step, training=training)
        t.model = model.train(training)  # pushed at each new step
        t.args.max_completion_length, t.args.generation_kwargs = 16, {"stop_token_ids": stops, "seed": 5}
        return t

    returned, crossed = [], 0
    for call in range(3):
        rows = rollout(_batch(dataset, range(3 * call, 3 * call + 3)), trainer(call))
        returned += _check_groups(rows, rollout.last_outputs, 3)
        crossed += sum(len(set(v)) > 1 for v in rows["policy_versions"])
        if call == 0:
            assert rollout.partial.tracker.running, "nothing carried over: the test proves nothing"
            eval_prompts = _batch(dataset, [14, 15])
            ev = rollout(eval_prompts, trainer(call, training=False))
            assert GROUP_KEY not in ev and ev["prompt_ids"] == [tok(text=p)["input_ids"] for p in eval_prompts]
    assert len(returned) == len(set(returned)) == 9 and crossed > 0
    rollout.close()
    assert not engine.has_unfinished_requests()


# ---- GRPOTrainer end to end ------------------------------------------------------------------------------
def test_grpo_trainer_trains_on_partial_groups(tok, tmp_path):
    from trl import GRPOConfig

    from trainer_hooks.grpo import EngineGRPOTrainer

    dataset = _dataset(16)
    length = _length_fn(tok, dataset)
    engine = FakeEngine(length=length)
    rollout = TRLRollout(engine, mode="partial")
    seen, group_ids, carried = [], [], []

    def consistent(prompts, completion_ids, answer, rollout_group_id, **_):
        for j, (p, a, ids) in enumerate(zip(prompts, answer, completion_ids, strict=True)):
            seen.append(a == str(4 * int(p.split()[2])) and len(ids) == length(tok(text=p)["input_ids"], j % N))
        group_ids.append(list(rollout_group_id))
        carried.append(set(rollout_group_id) != set(rollout.partial.incoming))
        return [float(len(ids)) for ids in completion_ids]

    args = GRPOConfig(
        output_dir=str(tmp_path), use_cpu=True, report_to="none", per_device_train_batch_size=8, num_generations=N,
        max_completion_length=LONG, max_steps=4, learning_rate=1e-3, logging_steps=1, save_strategy="no", seed=0,
        bf16=False, disable_tqdm=True,
    )
    model = make_tiny_hf_model("llama", vocab_size=len(tok), pad_token_id=0, bos_token_id=1, eos_token_id=2)
    trainer = EngineGRPOTrainer(model=model, reward_funcs=[consistent], args=args, train_dataset=dataset,
                                processing_class=tok, rollout_func=rollout)
    trainer.train()
    assert len(group_ids) == 4 and all(len(g) == 8 for g in group_ids)
    flat = [g for step in group_ids for g in step[::N]]
    assert len(flat) == len(set(flat)) == 16  # 4 steps x 4 groups, each once
    assert seen and all(seen) and any(carried)  # every row scored against its own prompt, some carried over
    assert engine.policy_version == 3 and Counter(v for v, *_ in engine.updates) == {0: 1, 1: 1, 2: 1, 3: 1}
    rollout.close()


# ---- the async-GRPO worker --------------------------------------------------------------------------------
def _worker(tok, dataset, engine, max_staleness):
    from trainer_hooks.async_grpo import EngineRolloutWorker

    args = SimpleNamespace(num_generations=N, temperature=1.0, top_p=1.0, top_k=0, min_p=None,
                           max_completion_length=20, generation_kwargs=None, repetition_penalty=1.0,
                           per_device_train_batch_size=4, gradient_accumulation_steps=1)
    return EngineRolloutWorker(engine, dataset, [lambda completions, **_: [1.0] * len(completions)], tok, args,
                               max_inflight=4 * N, max_staleness=max_staleness)


def _drain_queue(q):
    items = []
    while not q.empty():
        items.append(q.get_nowait())
    return items


@pytest.mark.parametrize("max_staleness", [None, 0])
def test_async_worker_counts_carry_over_and_drops_stale_groups(tok, max_staleness):
    dataset = _dataset(12)
    engine = FakeEngine(length=_length_fn(tok, dataset))
    worker = _worker(tok, dataset, engine, max_staleness)
    for _ in range(4):
        worker._tick()  # no thread: the loop's body, one engine step at a time
    before = _drain_queue(worker.rollout_buffer)
    assert before and all(s.metrics["rollout/policy_version_max"] == 0 for s in before)
    held = sum(len(c.token_ids) for rid in worker.tracker.running for c in engine.partial_output(rid).outputs)
    running = len(worker.tracker.running)
    assert running and held
    engine.update_weights({}, version=1)  # what EngineWeightTransfer does, between two steps
    for _ in range(30):
        worker._tick()
    metrics = _drain_queue(worker.metrics_queue)
    at_push = [m for m in metrics if "rollout/carried_over_groups" in m]
    samples = _drain_queue(worker.rollout_buffer)
    spans = {(s.metrics["rollout/policy_version_min"], s.metrics["rollout/policy_version_max"]) for s in samples}
    if max_staleness is None:
        assert at_push == [{"rollout/carried_over_groups": running, "rollout/carried_over_tokens": held}]
        assert worker.dropped_groups == 0 and (0.0, 1.0) in spans  # a group generated across the push
    else:
        (push,) = at_push
        assert push["rollout/dropped_groups_total"] == running == worker.dropped_groups  # all held tokens
        assert push["rollout/carried_over_groups"] == 0
        assert spans == {(1.0, 1.0)}  # only the new policy's groups reach the trainer
    assert all(len(s.completion_mask) == len(s.input_ids) for s in samples)
