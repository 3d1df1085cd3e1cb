"""Weights from a trainer through a directory: ``rollout.weights_from=DIR``.

The trainer writes snapshots into DIR as ``step_<N>/`` subdirectories in Hugging Face safetensors
layout (``model.safetensors`` or shards + index, ``config.json``), each complete once a file named
``COMPLETE`` exists in it (``trainer_hooks.save_snapshot`` writes it last, after an atomic rename).
Before each round the job loads the newest complete snapshot it has not loaded yet, through
``update_weights`` (every name, shape and value validated before anything is copied; read one tensor
at a time by ``rollout.weights.disk.CheckpointWeights``, as the server's ``/update_weights_from_disk``
does), and the round's tokens then carry ``policy_version = N``. Older snapshots that were skipped over
are never loaded.
N must be below 2**63 (versions are int64 in the round files), and a resumed job's versions never go back
below those of the rounds already written: either is refused before a round runs.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from rollout.weights.disk import COMPLETE, CheckpointWeights, step_of

log = logging.getLogger(__name__)
MAX_VERSION = 2**63  # policy versions are ints in [0, 2**63)


def check_weights_dir(path: str | os.PathLike[str]) -> Path:
    """The directory may not exist yet (the trainer creates it); if it exists it must be a directory."""
    p = Path(path).expanduser()
    if p.exists() and not p.is_dir():
        raise ValueError(f"rollout.weights_from={str(path)!r} is not a directory")
    return p


class SnapshotWatcher:
    def __init__(self, root: str | os.PathLike[str], floor: int = 0) -> None:
        """``floor``: the policy version the rounds already written reached (a resume); never go below it."""
        self.root = check_weights_dir(root)
        self.loaded_step: int | None = None
        self.floor = floor

    def newest(self) -> tuple[int, Path] | None:
        """The newest complete snapshot newer than the one loaded last, or None."""
        best: tuple[int, Path] | None = None
        for p in self.root.iterdir() if self.root.is_dir() else ():
            step = step_of(p)
            if step is None or not (p / COMPLETE).is_file():
                continue
            if step >= MAX_VERSION:
                raise ValueError(f"rollout.weights_from: snapshot {str(p)!r} has step {step}; policy versions must "
                                 "be ints in [0, 2**63)")
            if (self.loaded_step is None or step > self.loaded_step) and (best is None or step > best[0]):
                best = (step, p)
        if self.loaded_step is None and self.floor > 0 and (best is None or best[0] < self.floor):
            raise ValueError(
                f"rollout.weights_from={str(self.root)!r}: the rounds already written reach policy_version "
                f"{self.floor}, but the newest complete snapshot is {f'step_{best[0]}' if best else 'none'}; "
                "policy versions never decrease"
            )
        return best

    def load_newest(self, driver: Any) -> int | None:
        """Push the newest unseen snapshot into the driver's backend; returns its step (None: nothing new).

        A snapshot the engine refuses (a missing or misshapen tensor, a non-finite value) stops the job
        with a ValueError naming it, the old weights still in place: silently going on with stale weights
        would train on the wrong policy.
        """
        found = self.newest()
        if found is None:
            return None
        step, path = found
        try:  # the server's disk reader: streamed, one tensor at a time on each pass, never a list
            driver.update_weights(CheckpointWeights(path), version=step)
        except (ValueError, TypeError, KeyError, OSError) as e:
            raise ValueError(f"rollout.weights_from: snapshot {str(path)!r} was refused: {e}") from None
        self.loaded_step = step
        log.info("loaded weights %s (policy_version %d)", path, step)
        return step
