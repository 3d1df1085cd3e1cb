"""Weights from a trainer through a directory: ``rollout.weights_from=DIR``.

The trainer writes snapshots into DIR as ``step_<N>/`` subdirectories in Hugging Face safetensors
layout (``model.safetensors`` or shards + index, ``config.json``), each complete once a file named
``COMPLETE`` exists in it (``trainer_hooks.save_snapshot`` writes it last, after an atomic rename).
Before each round the job loads the newest complete snapshot it has not loaded yet, through
``update_weights`` (every name, shape and value validated before anything is copied; read one tensor
at a time by ``rollout.weights.disk.CheckpointWeights``, as the server's ``/update_weights_from_disk``
does), and the round's tokens then carry ``policy_version = N``. Older snapshots that were skipped over
are never loaded.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from rollout.weights.disk import COMPLETE, CheckpointWeights, step_of

log = logging.getLogger(__name__)


def check_weights_dir(path: str | os.PathLike[str]) -> Path:
    """The directory may not exist yet (the trainer creates it); if it exists it must be a directory."""
    p = Path(path).expanduser()
    if p.exists() and not p.is_dir():
        raise ValueError(f"rollout.weights_from={str(path)!r} is not a directory")
    return p


class SnapshotWatcher:
    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = check_weights_dir(root)
        self.loaded_step: int | None = None

    def newest(self) -> tuple[int, Path] | None:
        """The newest complete snapshot newer than the one loaded last, or None."""
        if not self.root.is_dir():
            return None
        best: tuple[int, Path] | None = None
        for p in self.root.iterdir():
            step = step_of(p)
            if step is None or not (p / COMPLETE).is_file():
                continue
            if (self.loaded_step is None or step > self.loaded_step) and (best is None or step > best[0]):
                best = (step, p)
        return best

    def load_newest(self, actor: Any) -> int | None:
        """Push the newest unseen snapshot into the actor's engine; returns its step (None: nothing new).

        A snapshot the engine refuses (a missing or misshapen tensor, a non-finite value) stops the job
        with a ValueError naming it, the old weights still in place: silently going on with stale weights
        would train on the wrong policy.
        """
        found = self.newest()
        if found is None:
            return None
        step, path = found
        try:  # the server's disk reader: streamed, one tensor at a time on each pass, never a list
            actor.update_weights(CheckpointWeights(path), version=step)
        except (ValueError, TypeError, KeyError, OSError) as e:
            raise ValueError(f"rollout.weights_from: snapshot {str(path)!r} was refused: {e}") from None
        self.loaded_step = step
        log.info("loaded weights %s (policy_version %d)", path, step)
        return step
