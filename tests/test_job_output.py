"""What the job leaves in output_dir and what it refuses up front: per-round files, the lock, the row check."""

from __future__ import annotations

import json
import os
from pathlib import Path

import datasets
import pyarrow.dataset as pads
import pytest

from rollout.job.data import PromptDataset, PromptLimits, load_prompt_dataset
from rollout.job.output_dir import LOCK_FILE, OutputDirLock
from rollout.job.seeds import request_seed
from rollout.job.trajectory import Trajectory
from rollout.job.trajectory_writer import TrajectoryWriter, read_trajectories
from rollout.sampling_params import SamplingParams
from rollout.settings.schema import DataConfig

LIMITS = PromptLimits(vocab_size=100, max_model_len=64, max_kv_tokens=48)


def traj(r: int, g: int, i: int) -> Trajectory:
    return Trajectory(r, g, i, g, "p", "c", [1, 2], [3, 4, 5], [-0.1, -0.2, -0.3], "stop", 0, [0, 0, 0], 0, 0, 1.0)


def test_rounds_are_separate_files_read_as_one_table(tmp_path: Path) -> None:
    writer = TrajectoryWriter(tmp_path, with_reward=True)
    for r in range(3):
        path = writer.write_round(r, [traj(r, 2 * r + g, i) for g in range(2) for i in range(2)], {"round": r})
        assert path == tmp_path / "trajectories" / f"round_{r:05d}.parquet"
    (tmp_path / "trajectories" / ".round_00003.parquet.tmp").write_bytes(b"torn")  # a crash mid-write
    table = pads.dataset(tmp_path / "trajectories", format="parquet").to_table()  # hidden files skipped
    assert table.num_rows == 12 and sorted(set(table.column("round").to_pylist())) == [0, 1, 2]
    hf = datasets.load_dataset(
        "parquet", data_files=str(tmp_path / "trajectories" / "*.parquet"), split="train"
    )
    assert len(hf) == 12 and hf[0]["completion_ids"] == [3, 4, 5]
    assert read_trajectories(tmp_path).column("group_id").to_pylist() == [g for g in range(6) for _ in (0, 1)]
    again = TrajectoryWriter(tmp_path, with_reward=True)
    assert again.resume() == 3 and again.num_rows == 12
    (tmp_path / "trajectories" / "round_00001.parquet").unlink()
    with pytest.raises(ValueError, match=r"holds rounds \[0, 2\], expected 0..k without gaps"):
        TrajectoryWriter(tmp_path, with_reward=True).resume()


def test_old_single_file_layout_is_not_resumed(tmp_path: Path) -> None:
    (tmp_path / "trajectories.parquet").write_bytes(b"x")
    with pytest.raises(ValueError, match="single-file layout of an older version"):
        TrajectoryWriter(tmp_path, with_reward=False).resume()


def test_lock_refuses_a_second_holder_naming_the_pid(tmp_path: Path) -> None:
    with OutputDirLock(tmp_path):
        assert (tmp_path / LOCK_FILE).read_text().strip() == str(os.getpid())
        with pytest.raises(ValueError, match=rf"is in use by another job \(pid {os.getpid()}\)"):
            OutputDirLock(tmp_path).acquire()
    with OutputDirLock(tmp_path):  # released: the next job may take it
        pass
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".write-test")]


def rows_dataset(tokenizer, prompts, **kw) -> PromptDataset:
    return PromptDataset(datasets.Dataset.from_dict({"prompt": prompts}), tokenizer, "prompt", None, **kw)


@pytest.mark.parametrize(
    ("bad", "needle"),
    [
        (None, "row 20: field 'prompt' is null"),
        ([5, -3, 7], "row 20: token id -3 is negative"),
        ([5, 100, 7], r"row 20: token id 100 is outside the vocabulary \[0, 100\)"),
        (list(range(1, 65)), "row 20: prompt has 64 tokens; max_model_len is 64"),
        (list(range(1, 41)), r"row 20: prompt \+ max_tokens = 56 tokens cannot fit the KV cache \(48 tokens\)"),
    ],
)
def test_dataset_check_names_the_bad_row(tokenizer, bad, needle) -> None:
    """A bad row late in the dataset is found before the first round, by its index."""
    prompts = [[1, 2, 3]] * 20 + [bad] + [[4, 5]] * 3
    ds = PromptDataset(
        datasets.Dataset.from_list([{"prompt": p} for p in prompts]), tokenizer, "prompt", None
    )
    with pytest.raises(ValueError, match=f"data.path='x.jsonl', {needle}"):
        ds.check(LIMITS, SamplingParams(max_tokens=16), where="data.path='x.jsonl'")
    good = rows_dataset(tokenizer, [[1, 2, 3], [4, 5, 6, 7]])
    assert good.check(LIMITS, SamplingParams(max_tokens=16)) == 4


def test_dataset_check_names_a_malformed_message_row(tokenizer) -> None:
    ok = [{"role": "user", "content": "hi"}]
    ds = rows_dataset(tokenizer, [ok, ok, [{"role": "user", "content": None}]])
    with pytest.raises(ValueError, match="row 2: field 'prompt' must be a string, a list of token ids or a list"):
        ds.check(PromptLimits(1000, 64, 64), SamplingParams(max_tokens=4))


def test_empty_data_file_is_a_clear_error(tmp_path: Path, tokenizer) -> None:
    empty = tmp_path / "e.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="data.path=.*e.jsonl' is an empty file"):
        load_prompt_dataset(DataConfig(path=str(empty)), tokenizer)
    broken = tmp_path / "b.jsonl"
    broken.write_text('{"prompt": "a"}\n{not json\n')
    with pytest.raises(ValueError, match="could not load data.path="):
        load_prompt_dataset(DataConfig(path=str(broken)), tokenizer)


def test_request_seeds_depend_on_job_round_and_group() -> None:
    seeds = {request_seed(s, r, g) for s in (0, 1) for r in range(3) for g in range(4)}
    assert len(seeds) == 24 and all(0 <= x < 2**63 for x in seeds)
    assert request_seed(5, 1, 2) == request_seed(5, 1, 2)  # a pure function: a resume gets the same
    assert json.loads(json.dumps(request_seed(5, 1, 2))) == request_seed(5, 1, 2)
    assert request_seed(2**64 - 1, 0, 0) != request_seed(2**63 - 1, 0, 0)
    for bad in (2**64 + 5, -1):  # never reduced to a seed in range (2**64 + 5 would repeat 5's requests)
        with pytest.raises(ValueError, match=rf"job seed {bad} is invalid: must be an int in \[0, 2\*\*64\)"):
            request_seed(bad, 0, 0)


def _rounds(writer: TrajectoryWriter, n: int) -> None:
    for r in range(n):
        writer.write_round(r, [traj(r, r, i) for i in range(2)], {"round": r, "x": r * 10}, {"next_group": r + 1})


def test_metrics_line_lost_in_a_crash_after_the_rename_is_rebuilt(tmp_path: Path) -> None:
    """The round file carries its metrics line: a crash between the rename and the append loses nothing."""
    writer = TrajectoryWriter(tmp_path, with_reward=True)
    _rounds(writer, 2)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    (tmp_path / "metrics.jsonl").write_text(lines[0] + "\n" + lines[1][:7])  # round 1's line torn by a crash
    again = TrajectoryWriter(tmp_path, with_reward=True)
    assert again.resume() == 2 and again.state == {"next_group": 2}
    assert [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [
        {"round": 0, "x": 0}, {"round": 1, "x": 10}]


def test_disk_full_is_a_value_error_naming_the_file(tmp_path: Path, monkeypatch) -> None:
    import errno

    import pyarrow.parquet as pq

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    writer = TrajectoryWriter(tmp_path, with_reward=True)
    monkeypatch.setattr(pq, "write_table", full)
    with pytest.raises(ValueError, match=r"cannot write .*round_00000.parquet: no space left on device"):
        _rounds(writer, 1)
    assert not list((tmp_path / "trajectories").iterdir())  # no temporary left behind


@pytest.mark.parametrize("where", ["middle", "footer"])
def test_a_damaged_round_file_is_named_on_resume(tmp_path: Path, where: str) -> None:
    _rounds(TrajectoryWriter(tmp_path, with_reward=True), 3)
    path = tmp_path / "trajectories" / "round_00001.parquet"
    data = bytearray(path.read_bytes())
    at = len(data) // 4 if where == "middle" else len(data) - 12  # middle: inside a data page (checksummed)
    for i in range(at, at + 4):
        data[i] ^= 0x5A
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=rf"{path} is corrupt"):
        TrajectoryWriter(tmp_path, with_reward=True).resume()
