"""What a run leaves in output_dir: trajectories.parquet, metrics.jsonl and config.json.

Both data files are rewritten whole after every round through a temporary file and ``os.replace``, so
a crash loses at most the round in progress and a reader never sees half a file. The parquet file is
the truth about which rounds are complete: a resume keeps exactly its rounds and the metrics lines
that belong to them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from rollout.job.actor import Trajectory

TRAJECTORIES = "trajectories.parquet"
METRICS = "metrics.jsonl"
CONFIG = "config.json"


def trajectory_schema(with_reward: bool) -> pa.Schema:
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
        ("policy_version", pa.int64()),
    ]
    if with_reward:
        fields.append(("reward", pa.float64()))
    return pa.schema(fields)


class TrajectoryWriter:
    def __init__(self, output_dir: str | os.PathLike[str], with_reward: bool) -> None:
        self.dir = prepare_output_dir(output_dir)
        self.schema = trajectory_schema(with_reward)
        self._tables: list[pa.Table] = []
        self._metrics: list[dict[str, Any]] = []

    @property
    def has_previous_run(self) -> bool:
        return any((self.dir / name).exists() for name in (TRAJECTORIES, METRICS, CONFIG))

    def saved_config(self) -> dict[str, Any] | None:
        path = self.dir / CONFIG
        if not path.is_file():
            return None
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"cannot resume: {path} is not valid JSON ({e})") from None

    def save_config(self, config: Mapping[str, Any]) -> None:
        _atomic_write_text(self.dir / CONFIG, json.dumps(config, indent=2, sort_keys=True) + "\n")

    def resume(self) -> int:
        """Load the complete rounds already written; returns the next round to run."""
        path = self.dir / TRAJECTORIES
        if not path.is_file():
            return 0
        table = pq.read_table(path)
        if table.schema.names != self.schema.names:
            raise ValueError(
                f"cannot resume: {path} has columns {table.schema.names}, this run writes {self.schema.names}"
            )
        rounds = sorted(set(table.column("round").to_pylist()))
        if rounds != list(range(len(rounds))):
            raise ValueError(f"cannot resume: {path} holds rounds {rounds}, expected 0..k without gaps")
        self._tables = [table.cast(self.schema)]
        done = len(rounds)
        self._metrics = [
            m for m in self._read_metrics() if isinstance(m.get("round"), int) and m["round"] < done
        ]
        self._write_metrics()  # drop lines of a round whose trajectories never landed
        return done

    def write_round(self, trajectories: Sequence[Trajectory], metrics: Mapping[str, Any]) -> None:
        """Append one complete round to both files (parquet first: it decides what a resume keeps)."""
        self._tables.append(self._to_table(trajectories))
        table = pa.concat_tables(self._tables)
        self._tables = [table]
        tmp = self.dir / f".{TRAJECTORIES}.tmp"
        pq.write_table(table, tmp)
        os.replace(tmp, self.dir / TRAJECTORIES)
        self._metrics.append(dict(metrics))
        self._write_metrics()

    @property
    def num_rows(self) -> int:
        return sum(t.num_rows for t in self._tables)

    def _to_table(self, trajectories: Sequence[Trajectory]) -> pa.Table:
        columns = {name: [getattr(t, name) for t in trajectories] for name in self.schema.names}
        return pa.Table.from_pydict(columns, schema=self.schema)

    def _read_metrics(self) -> list[dict[str, Any]]:
        path = self.dir / METRICS
        if not path.is_file():
            return []
        lines = [line for line in path.read_text().splitlines() if line.strip()]
        out = []
        for line in lines:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a torn last line from a crash outside our atomic write: drop it
        return out

    def _write_metrics(self) -> None:
        text = "".join(json.dumps(m, sort_keys=True) + "\n" for m in self._metrics)
        _atomic_write_text(self.dir / METRICS, text)


def prepare_output_dir(output_dir: str | os.PathLike[str]) -> Path:
    """Create output_dir and prove it is writable now, before any model is loaded."""
    path = Path(output_dir).expanduser()
    probe = path / ".write-test"
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"output_dir={str(output_dir)!r} is not writable: {e.strerror or e}") from None
    return path


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
