"""Weights through a directory: the ``step_<N>/`` + ``COMPLETE`` hand-over, written whole and read lazily.

A snapshot is a Hugging Face safetensors checkpoint directory (config.json + model*.safetensors, an index
when sharded). ``write_snapshot`` (the trainer's side; ``trainer_hooks.save_snapshot`` adds the config and
tokenizer) writes it into a hidden temporary directory beside the target with an empty ``COMPLETE`` file
as its last file, then renames it into place in one step: a reader never sees a half-written ``step_<N>``.

``CheckpointWeights`` is the one reader: ``/update_weights_from_disk`` and the job's
``rollout.weights_from`` both hand it to ``Engine.update_weights``, which walks it twice (validate, then
copy), each pass reading one tensor at a time from the memory-mapped files (``safe_open``): host memory
holds about one tensor, never the model.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from rollout.models.loader import INDEX_FILE, iter_checkpoint, safetensors_files

COMPLETE = "COMPLETE"
STEP_DIR = re.compile(r"^step_(\d+)$")


def snapshot_dir(root: str | os.PathLike[str], step: int) -> Path:
    return Path(root) / f"step_{step}"


def step_of(path: str | os.PathLike[str]) -> int | None:
    """N for a directory named ``step_<N>`` (the version its weights carry), else None."""
    m = STEP_DIR.match(Path(path).name)
    return int(m.group(1)) if m else None


class CheckpointWeights:
    """Re-iterable ``(name, tensor)`` pairs of a safetensors directory: each pass reads one tensor at a time.

    Checked when it is made, so a bad directory fails before anything is read: the files are found (a
    directory without safetensors refused), each must be a regular file (a FIFO would block the reader
    forever) with a readable safetensors header. With ``root`` every path, symlinks resolved, must lie
    under it (PermissionError otherwise). Errors are ValueError; a path that is missing, not a directory
    or unreadable gets one message, so it does not tell which.
    """

    def __init__(self, path: str | os.PathLike[str], root: str | os.PathLike[str] | None = None) -> None:
        self.path = _directory(path, root)
        try:
            self.files = safetensors_files(self.path)
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            if isinstance(e, ValueError) and not (self.path / INDEX_FILE).is_file():
                raise
            raise ValueError(f"{INDEX_FILE} in {_short(self.path)} is not a valid index "
                             f"({{'weight_map': {{name: file}}}}): {type(e).__name__}") from None
        for file in self.files:
            _check_file(file, root)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter_checkpoint(self.path)  # a generator: safe_open, one get_tensor at a time


def _short(path: str | os.PathLike[str]) -> str:
    text = repr(str(path))
    return text if len(text) <= 200 else text[:197] + "..."


def _under(path: str | os.PathLike[str], root: str | os.PathLike[str] | None, what: str) -> Path:
    real = Path(os.path.realpath(os.path.expanduser(path)))
    if root is not None and not real.is_relative_to(os.path.realpath(os.path.expanduser(root))):
        raise PermissionError(f"{what} {_short(path)} is outside the weights root (server.weights_root)")
    return real


def _directory(path: str | os.PathLike[str], root: str | os.PathLike[str] | None) -> Path:
    try:
        real = _under(path, root, "path")
        if stat.S_ISDIR(os.stat(real).st_mode) and os.access(real, os.R_OK | os.X_OK):
            return real
    except PermissionError:
        raise
    except (OSError, ValueError):
        pass
    raise ValueError(f"path {_short(path)} is not a readable checkpoint directory (config.json + *.safetensors)")


def _check_file(file: Path, root: str | os.PathLike[str] | None) -> None:
    _under(file, root, "weight file")
    try:
        regular = stat.S_ISREG(os.stat(file).st_mode)
    except OSError:
        regular = False
    if not regular:
        raise ValueError(f"weight file {_short(file.name)} is not a regular file")
    try:
        with safe_open(str(file), framework="pt", device="cpu"):
            pass
    except Exception as e:  # noqa: BLE001 - safetensors' own error type: random bytes, truncated, empty
        raise ValueError(f"weight file {_short(file.name)} is not a readable safetensors file: {e}") from None


def write_snapshot(weights: Iterable[tuple[str, torch.Tensor]], root: str | os.PathLike[str], step: int,
                   extras: Callable[[Path], None] = lambda tmp: None, max_shard_bytes: int = 5 << 30) -> Path:
    """``weights`` (plain HF names) as ``root/step_<step>/`` with ``COMPLETE``, atomically; returns that path.

    ``extras(tmp)`` writes the rest (config, tokenizer) into the temporary directory first. Refuses to
    overwrite an existing snapshot (a reader may be loading it).
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = snapshot_dir(root, step)
    if final.exists():
        raise FileExistsError(f"snapshot {str(final)!r} already exists; snapshots are never overwritten")
    tmp = Path(tempfile.mkdtemp(prefix=f".step_{step}.tmp-", dir=root))
    try:
        _write_weights(weights, tmp, max_shard_bytes)
        extras(tmp)
        (tmp / COMPLETE).touch()  # the last file written
        _fsync_tree(tmp)
        os.rename(tmp, final)  # atomic on one filesystem; fails rather than replace a concurrent writer's
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _write_weights(weights: Iterable[tuple[str, torch.Tensor]], out: Path, max_shard_bytes: int) -> None:
    """model.safetensors, or model-0000k-of-0000n.safetensors shards plus an index past ``max_shard_bytes``."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = total = 0
    for name, tensor in weights:
        t = tensor.detach().to("cpu", copy=True).contiguous()  # own storage: tied or viewed weights save apart
        nbytes = t.numel() * t.element_size()
        if size and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
        total += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2))


def _fsync_tree(path: Path) -> None:
    for p in path.iterdir():
        with open(p, "rb") as f:
            os.fsync(f.fileno())
    _fsync_dir(path)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
