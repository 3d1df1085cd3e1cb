"""What a run leaves in output_dir: trajectories/round_NNNNN.parquet, metrics.jsonl and config.json.

Each round is its own parquet file, written to a hidden temporary name and renamed into place, so
memory and write time stay flat however long the run, a crash loses at most the round in progress,
and a reader never sees half a file. The directory reads as one table:
``pyarrow.dataset.dataset(out / "trajectories")`` or
``datasets.load_dataset("parquet", data_files=str(out / "trajectories" / "*.parquet"))``
(both skip the hidden temporaries). The round files are the truth about which rounds are complete: a
resume keeps exactly their rounds and the metrics lines that belong to them. A round file's metadata
also carries the round driver's state at the round's end (which prompt comes next, which groups were still
running and the round that admitted each), so a resume regenerates exactly the groups that were in
flight, with their own seeds, and the round's metrics line, so writing a round and its metrics is one
atomic step: a resume rebuilds metrics.jsonl from the round files. Pages carry CRC checksums, and a
resume reads every round file through them, so a damaged one is named rather than resumed from.
"""

from __future__ import annotations

import errno
import json
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from rollout.job.output_dir import prepare_output_dir
from rollout.job.trajectory import Trajectory

TRAJECTORIES = "trajectories"
METRICS = "metrics.jsonl"
CONFIG = "config.json"
STATE_KEY = b"rollout.state"
METRICS_KEY = b"rollout.metrics"
_ROUND_FILE = re.compile(r"^round_(\d+)\.parquet$")


def round_file_name(r: int) -> str:
    return f"round_{r:05d}.parquet"


def trajectory_schema(with_reward: bool, with_env: bool = False) -> pa.Schema:
    fields = [
        ("round", pa.int32()),
        ("group_id", pa.int64()),
        ("sample_index", pa.int32()),
        ("prompt_index", pa.int64()),
        ("prompt", pa.string()),
        ("completion", pa.string()),
        ("prompt_ids", pa.list_(pa.int32())),
        ("completion_ids", pa.list_(pa.int32())),
        ("logprobs", pa.list_(pa.float32())),  # the engine computes them in float32: lossless
        ("finish_reason", pa.string()),
        ("policy_version", pa.int64()),  # the weights that made the last token
        ("policy_versions", pa.list_(pa.int64())),  # the weights that made each token
        ("min_policy_version", pa.int64()),
        ("max_policy_version", pa.int64()),
        ("stop_reason", pa.string()),  # the stop string or stop token id that ended it (null: EOS or length)
    ]
    if with_reward:
        fields.append(("reward", pa.float64()))
    if with_env:  # multi-turn rows (rollout.env): which completion tokens the model made, and the turns' counts
        fields += [("env_mask", pa.list_(pa.int8())), ("num_turns", pa.int32()), ("tool_calls", pa.int32()),
                   ("tool_failures", pa.int32()), ("env_error", pa.string())]
    return pa.schema(fields)


class TrajectoryWriter:
    def __init__(self, output_dir: str | os.PathLike[str], with_reward: bool, with_env: bool = False) -> None:
        self.dir = prepare_output_dir(output_dir)
        self.rounds_dir = self.dir / TRAJECTORIES
        self.schema = trajectory_schema(with_reward, with_env)
        self.base_names = list(self.schema.names)  # then the dataset's columns (``set_data_columns``)
        self.num_rows = 0
        self.state: dict[str, Any] | None = None  # the last complete round's round driver's state (after resume)

    @property
    def has_previous_run(self) -> bool:
        return bool(self._round_files()) or any((self.dir / name).exists() for name in (METRICS, CONFIG))

    def saved_config(self) -> dict[str, Any] | None:
        path = self.dir / CONFIG
        if not path.is_file():
            return None
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"cannot resume: {path} is not valid JSON ({e})") from None

    def save_config(self, config: Mapping[str, Any]) -> None:
        text = json.dumps(config, indent=2, sort_keys=True) + "\n"
        self._write(self.dir / CONFIG, lambda p: _atomic_write_text(p, text))

    def resume(self) -> int:
        """Find and check the complete rounds already written, rebuild metrics.jsonl from them; returns the next
        round to run."""
        if (self.dir / "trajectories.parquet").exists():
            raise ValueError(
                f"cannot resume: {self.dir} holds trajectories.parquet, the single-file layout of an older "
                f"version; this one writes {TRAJECTORIES}/round_NNNNN.parquet (start a new output_dir)"
            )
        files = self._round_files()
        rounds = sorted(files)
        if rounds != list(range(len(rounds))):
            raise ValueError(
                f"cannot resume: {self.rounds_dir} holds rounds {rounds}, expected 0..k without gaps"
            )
        self.num_rows = 0
        done = len(rounds)
        lines = {}  # round files of an older version carry no metrics line: keep the appended one
        for m in self._read_metrics():
            if isinstance(m.get("round"), int) and m["round"] < done:
                lines[m["round"]] = _line(m)  # the last line of a round wins (a retried append)
        for r in rounds:
            f = self._check_round_file(files[r])
            kv = f.schema_arrow.metadata or {}
            self.num_rows += f.metadata.num_rows
            if METRICS_KEY in kv:
                lines[r] = kv[METRICS_KEY].decode()
            if r == rounds[-1]:
                self.state = json.loads(kv[STATE_KEY]) if STATE_KEY in kv else None
        if lines or (self.dir / METRICS).exists():
            self._write(self.dir / METRICS, lambda p: _atomic_write_text(p, "".join(lines[r] for r in sorted(lines))))
        return done

    def _check_round_file(self, path: Path) -> pq.ParquetFile:
        """Read every page of a round file through its checksums (one row group at a time)."""
        try:
            f = pq.ParquetFile(path, page_checksum_verification=True)
            names = f.schema_arrow.names
            for i in range(f.num_row_groups):
                f.read_row_group(i)
        except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid / ArrowIOError are both
            raise ValueError(
                f"{path} is corrupt ({e}); move it and every later round file away to resume from the round "
                "before it, or start a new output_dir"
            ) from None
        fixed = set(trajectory_schema(True, True).names)  # the dataset's columns follow ours, never one of ours
        if names[: len(self.base_names)] != self.base_names or fixed & set(names[len(self.base_names):]):
            raise ValueError(f"cannot resume: {path} has columns {names}, this run writes {self.base_names} "
                             "and the dataset's columns")
        return f

    def write_round(
        self,
        r: int,
        trajectories: Sequence[Trajectory],
        metrics: Mapping[str, Any],
        state: Mapping[str, Any] | None = None,
    ) -> Path:
        """Write round ``r`` as its own file (it decides what a resume keeps, and carries the metrics line
        and the round driver's state), then append the metrics line (a resume rebuilds it from the file)."""
        table = self._to_table(trajectories)
        meta = {METRICS_KEY: _line(metrics).encode()}
        if state is not None:
            meta[STATE_KEY] = json.dumps(dict(state)).encode()
        table = table.replace_schema_metadata(meta)
        path = self.rounds_dir / round_file_name(r)
        tmp = self.rounds_dir / f".{path.name}.tmp"

        def write(_: Path) -> None:
            self.rounds_dir.mkdir(exist_ok=True)
            try:
                pq.write_table(table, tmp, write_page_checksum=True)
                os.replace(tmp, path)
            finally:
                tmp.unlink(missing_ok=True)

        self._write(path, write)
        self.num_rows += table.num_rows

        def append(p: Path) -> None:
            with open(p, "a") as f:  # one line per round: a torn last line is rebuilt on resume
                f.write(_line(metrics))

        self._write(self.dir / METRICS, append)
        return path

    @staticmethod
    def _write(path: Path, write: Any) -> None:
        """``write(path)``; a full disk or another failing write is a user error naming the path."""
        try:
            write(path)
        except OSError as e:
            why = "no space left on device" if e.errno in (errno.ENOSPC, errno.EDQUOT) else (e.strerror or str(e))
            raise ValueError(f"cannot write {path}: {why}") from None

    def _round_files(self) -> dict[int, Path]:
        if not self.rounds_dir.is_dir():
            return {}
        found = (_ROUND_FILE.match(p.name) for p in self.rounds_dir.iterdir())
        return {int(m.group(1)): self.rounds_dir / m.group(0) for m in found if m}

    def set_data_columns(self, types: Mapping[str, pa.DataType]) -> None:
        """Every trajectory also carries its dataset row's columns (``PromptDataset.column_types``)."""
        base = trajectory_schema("reward" in self.base_names, "env_mask" in self.base_names)
        self.schema = pa.schema([*base, *types.items()])

    def _to_table(self, trajectories: Sequence[Trajectory]) -> pa.Table:
        columns = {name: [getattr(t, name) for t in trajectories] for name in self.base_names}
        for name in self.schema.names[len(self.base_names):]:
            columns[name] = [t.columns.get(name) for t in trajectories]
        return pa.Table.from_pydict(columns, schema=self.schema)

    def _read_metrics(self) -> list[dict[str, Any]]:
        path = self.dir / METRICS
        if not path.is_file():
            return []
        out = []
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a torn last line from a crash mid-append: drop it
        return out


def read_trajectories(output_dir: str | os.PathLike[str]) -> pa.Table:
    """Every complete round of a run as one table, in round order."""
    import pyarrow.dataset as ds

    files = sorted(str(p) for p in (Path(output_dir) / TRAJECTORIES).glob("round_*.parquet"))
    return ds.dataset(files, format="parquet").to_table() if files else pa.table({})


def _line(metrics: Mapping[str, Any]) -> str:
    return json.dumps(dict(metrics), sort_keys=True) + "\n"


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
