"""RoundDriver, prompt datasets, the trajectory writer: against a scripted fake engine and the real one."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest

from rollout.assets import assets_dir, check_checkpoint_dir, materialize_default_model
from rollout.job.data import PromptDataset, load_prompt_dataset
from rollout.job.output_dir import prepare_output_dir
from rollout.job.rounds import RoundDriver
from rollout.job.trajectory_writer import TrajectoryWriter, read_trajectories
from rollout.rl.rewards import exact_match
from rollout.sampling_params import SamplingParams
from rollout.settings.schema import DataConfig
from tests.job_fakes import FakeEngine


def rows_dataset(tokenizer, prompts, answers=None, **kw) -> PromptDataset:
    rows = {"prompt": prompts} | ({"answer": answers} if answers is not None else {})
    return PromptDataset(datasets.Dataset.from_dict(rows), tokenizer, "prompt", "answer", **kw)


def test_round_groups_ordering_and_wraparound(tokenizer) -> None:
    engine = FakeEngine()
    ds = rows_dataset(tokenizer, ["a", "bb", "ccc"], ["1", "2", "3"])
    actor = RoundDriver(engine, ds, SamplingParams(n=3, max_tokens=4), num_prompts=2)
    r0, r1 = actor.run_round(), actor.run_round()
    assert len(engine.added) == 4 and all(p.n == 3 for _, _, p in engine.added)  # one request per group
    assert [t.group_id for t in r0.trajectories] == [0, 0, 0, 1, 1, 1]
    assert [t.sample_index for t in r0.trajectories] == [0, 1, 2] * 2
    assert [t.group_id for t in r1.trajectories] == [2, 2, 2, 3, 3, 3] and {
        t.round for t in r1.trajectories
    } == {1}
    assert [t.prompt_index for t in r1.trajectories[::3]] == [2, 0]  # wrapped around the 3-row dataset
    t = r0.trajectories[4]
    assert t.prompt_ids == list(ds.get(1).token_ids) and t.prompt == ds.get(1).text
    assert len(t.completion_ids) == len(t.logprobs) == 1 + (1 + len(t.prompt_ids)) % 5
    assert t.finish_reason in ("stop", "length") and t.policy_version == 0 and t.reward is None
    m = r0.metrics
    assert m["num_samples"] == 6 and m["num_prompts"] == 2 and m["round"] == 0
    assert m["finish_stop"] + m["finish_length"] == 6 and m["finish_abort"] == 0
    assert m["completion_len_max"] == max(len(t.completion_ids) for t in r0.trajectories)
    assert m["generated_tokens"] == sum(len(t.completion_ids) for t in r0.trajectories)
    assert m["prompt_tokens"] == sum(len(t.prompt_ids) for t in r0.trajectories[::3])
    assert m["kv_cache_usage_peak"] >= m["kv_cache_usage_mean"] > 0 and m["mean_batch_size"] > 1
    assert "reward_mean" not in m


def test_rewards_and_metrics(tokenizer) -> None:
    ds = rows_dataset(tokenizer, ["What is 1 + 2?"] * 2, ["0", "999"])
    n_tokens = len(ds.get(0).token_ids)
    ds.rows = datasets.Dataset.from_dict({"prompt": ["What is 1 + 2?"] * 2, "answer": [str(n_tokens), "999"]})
    actor = RoundDriver(
        FakeEngine(), ds, SamplingParams(n=2, max_tokens=8), num_prompts=2, reward_fn=exact_match
    )
    res = actor.run_round()
    assert [t.reward for t in res.trajectories] == [1.0, 1.0, 0.0, 0.0]  # fake text is "so <prompt len>"
    assert res.metrics["reward_mean"] == 0.5 and res.metrics["reward_std"] == 0.5


def test_step_callback_and_progress(tokenizer, capsys) -> None:
    seen = []
    actor = RoundDriver(
        FakeEngine(),
        rows_dataset(tokenizer, ["x" * 9]),
        SamplingParams(n=2, max_tokens=5),
        4,
        log_every_steps=2,
        on_step=seen.append,
        progress=True,
    )
    actor.run_round()
    assert seen and {"engine_step", "step/running_seqs", "step/tokens_per_s", "step/kv_cache_usage"} <= set(
        seen[0]
    )
    assert all(s["engine_step"] % 2 == 0 for s in seen[:-1])  # every 2 steps, plus one when the round ends
    assert "round 1" in capsys.readouterr().err  # the tqdm bar (rounds counted from 1 there: "round 1/M")


def test_update_weights_between_rounds(tokenizer) -> None:
    engine = FakeEngine()
    actor = RoundDriver(engine, rows_dataset(tokenizer, ["p"]), SamplingParams(n=1), 1)
    assert {t.policy_version for t in actor.run_round().trajectories} == {0}
    assert actor.update_weights({}, version=5) == 5
    res = actor.run_round()
    assert {t.policy_version for t in res.trajectories} == {5} and res.metrics["policy_version"] == 5
    engine.add_request([1], SamplingParams(), "other")
    with pytest.raises(RuntimeError, match="between rounds"):
        actor.update_weights({})


def test_refused_request_withdraws_the_round(tokenizer) -> None:
    engine = FakeEngine(refuse_after=1)
    actor = RoundDriver(engine, rows_dataset(tokenizer, ["p", "q"]), SamplingParams(n=1), 2)
    with pytest.raises(ValueError, match="too long"):
        actor.run_round()
    assert not engine.has_unfinished_requests() and actor.round == 0


# ---- prompt datasets ----------------------------------------------------------------------------------
def test_chat_template_modes_and_token_prompts(tokenizer) -> None:
    chat = rows_dataset(tokenizer, ["What is 2 + 2?"])
    assert chat.get(0).text == "<|bos|><|user|>What is 2 + 2?<|eos|><|assistant|>"
    plain = rows_dataset(tokenizer, ["What is 2 + 2?"], apply_chat_template=False)
    assert plain.get(0).text == "What is 2 + 2?" and plain.get(0).token_ids == tuple(
        tokenizer("What is 2 + 2?").input_ids
    )
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    ds = PromptDataset(datasets.Dataset.from_dict({"prompt": [msgs]}), tokenizer, "prompt", None)
    assert ds.get(0).text == "<|bos|><|system|>Be brief.<|eos|><|user|>Hi<|eos|><|assistant|>"
    ids = PromptDataset(datasets.Dataset.from_dict({"prompt": [[5, 6, 7]]}), tokenizer, "prompt", None)
    assert ids.get(0).token_ids == (5, 6, 7) and ids.get(0).answer is None


def test_load_local_files_and_bad_fields(tmp_path: Path, tokenizer) -> None:
    rows = [{"question": "What is 3 + 4?", "answer": 7}, {"question": "What is 1 + 1?", "answer": 2}]
    jsonl = tmp_path / "q.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    parquet = tmp_path / "q.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(parquet))
    for path in (jsonl, parquet):
        ds = load_prompt_dataset(
            DataConfig(path=str(path), prompt_field="question"), tokenizer, require_answer=True
        )
        assert len(ds) == 2 and ds.get(3).answer == "2" and "What is 1 + 1?" in ds.get(3).text
    with pytest.raises(
        ValueError, match=r"data.prompt_field='prompt' is not a field .* fields are \['question', 'answer'\]"
    ):
        load_prompt_dataset(DataConfig(path=str(jsonl)), tokenizer)
    with pytest.raises(ValueError, match=r"data.answer_field='label' .* fields are \['question', 'answer'\]"):
        load_prompt_dataset(
            DataConfig(path=str(jsonl), prompt_field="question", answer_field="label"), tokenizer, True
        )
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_prompt_dataset(DataConfig(path=str(tmp_path / "missing.jsonl")), tokenizer)
    folder = tmp_path / "folder"  # a dataset dir goes the dataset-name route through `datasets`
    folder.mkdir()
    (folder / "train.jsonl").write_text(jsonl.read_text())
    assert len(load_prompt_dataset(DataConfig(path=str(folder), prompt_field="question"), tokenizer)) == 2
    (tmp_path / "q.txt").write_text("x")
    with pytest.raises(ValueError, match="unsupported suffix"):
        load_prompt_dataset(DataConfig(path=str(tmp_path / "q.txt")), tokenizer)


def test_embedded_dataset_is_shuffled_deterministically(tokenizer) -> None:
    a = load_prompt_dataset(DataConfig(shuffle=True, seed=3), tokenizer)
    b = load_prompt_dataset(DataConfig(shuffle=True, seed=3), tokenizer)
    assert len(a) == 400 and [a.get(i).index for i in range(5)] == [b.get(i).index for i in range(5)]
    assert [a.get(i).index for i in range(5)] != list(range(5))


# ---- trajectory writer --------------------------------------------------------------------------------
def test_writer_rounds_resume_and_torn_metrics(tmp_path: Path, tokenizer) -> None:
    actor = RoundDriver(
        FakeEngine(),
        rows_dataset(tokenizer, ["a", "b"], ["1", "2"]),
        SamplingParams(n=2),
        2,
        reward_fn=exact_match,
    )
    writer = TrajectoryWriter(tmp_path, with_reward=True)
    assert not writer.has_previous_run
    writer.save_config({"a": 1})
    for _ in range(2):
        res = actor.run_round()
        writer.write_round(res.round, res.trajectories, res.metrics)
    table = read_trajectories(tmp_path)
    assert table.num_rows == 8 and table.column("round").to_pylist() == [0] * 4 + [1] * 4
    assert set(table.column_names) >= {"prompt_ids", "completion_ids", "logprobs", "finish_reason", "reward"}
    with open(tmp_path / "metrics.jsonl", "a") as f:  # a line for a round whose parquet never landed
        f.write(json.dumps({"round": 2}) + "\n{torn")
    again = TrajectoryWriter(tmp_path, with_reward=True)
    assert again.has_previous_run and again.saved_config() == {"a": 1} and again.resume() == 2
    assert again.num_rows == 8
    assert [json.loads(x)["round"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [0, 1]
    with pytest.raises(ValueError, match="columns"):
        TrajectoryWriter(tmp_path, with_reward=False).resume()
    assert not list(tmp_path.glob(".*.tmp"))


def test_wandb_online_without_account_is_a_clear_error(tmp_path: Path, monkeypatch) -> None:
    from rollout.rl.wandb_logger import WandbLogger
    from rollout.settings.schema import WandbConfig

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc credentials
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    with pytest.raises(
        ValueError, match="logger.wandb.mode='online': wandb.init failed .* use logger.wandb.mode=off"
    ):
        WandbLogger(WandbConfig(mode="online"), tmp_path, {})
    assert not WandbLogger(WandbConfig(mode="disabled"), tmp_path, {}).enabled


def test_unwritable_output_dir(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match="output_dir=.* is not writable"):
        prepare_output_dir(blocker / "out")


# ---- the embedded default model and the real engine ---------------------------------------------------
def test_default_model_is_cached_and_a_checkpoint(default_model: Path, tmp_path: Path) -> None:
    assert check_checkpoint_dir(default_model) == default_model
    assert materialize_default_model(default_model.parent) == default_model  # built once
    assert sum(p.stat().st_size for p in assets_dir().iterdir() if p.is_file()) < 1_000_000
    with pytest.raises(FileNotFoundError, match="does not exist"):
        check_checkpoint_dir(tmp_path / "nope")
    with pytest.raises(ValueError, match="no config.json"):
        check_checkpoint_dir(tmp_path)


def test_real_engine_round_and_weight_swap(default_model: Path, tokenizer) -> None:
    from rollout import Engine

    engine = Engine.from_pretrained(str(default_model), dtype="float32", device="cpu", max_num_seqs=16)
    ds = load_prompt_dataset(DataConfig(), engine.tokenizer, require_answer=True)
    actor = RoundDriver(engine, ds, SamplingParams(n=3, max_tokens=6, seed=0), 4, reward_fn=exact_match)
    res = actor.run_round()
    assert len(res.trajectories) == 12 and {t.reward for t in res.trajectories} <= {0.0, 1.0}
    for t in res.trajectories:
        assert len(t.completion_ids) == len(t.logprobs) <= 6 and all(lp <= 0 for lp in t.logprobs)
        assert t.finish_reason in ("stop", "length") and t.policy_version == 0
    assert res.metrics["num_steps"] > 0 and res.metrics["mean_batch_size"] > 1
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(default_model)
    assert actor.update_weights(hf.named_parameters(), version=3) == 3
    assert {t.policy_version for t in actor.run_round().trajectories} == {3}


def test_building_the_default_model_leaves_the_callers_random_state(tmp_path) -> None:
    """A run seeds torch, then builds the default model: with a cold cache the build used to reseed the
    global generator, so the run's later draws (PPO's value head) depended on whether the cache was warm."""
    import torch

    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    materialize_default_model(tmp_path / "cold")
    assert torch.equal(torch.rand(3), expected)
