"""output_dir: create it, prove it writable, and hold it for one job at a time.

Two jobs writing one output_dir would interleave their rounds under one config.json, so a job holds an
``fcntl.flock`` on ``output_dir/.rollout.lock`` for its whole life. The kernel drops the lock when the
process dies (even by ``kill -9``), so a crashed job never leaves a stale lock behind; the file itself
stays and only holds the last holder's pid, to name it in the refusal.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
import time
from pathlib import Path

LOCK_FILE = ".rollout.lock"


def prepare_output_dir(output_dir: str | os.PathLike[str]) -> Path:
    """Create output_dir and prove it is writable now, before any model is loaded.

    The probe has a unique name (mkstemp), so jobs starting at the same moment never trip over it.
    """
    path = Path(output_dir).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-test-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ValueError(f"output_dir={str(output_dir)!r} is not writable: {e.strerror or e}") from None
    return path


class OutputDirLock:
    """An exclusive, non-blocking lock on a directory for the lifetime of a job (a context manager)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self.path / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_pid(fd)
            os.close(fd)
            raise ValueError(
                f"output_dir={str(self.path)!r} is in use by another job (pid {holder}); wait for it to end "
                "or choose another output_dir"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> OutputDirLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _read_pid(fd: int) -> str:
    """The holder's pid; it writes it just after locking, so a racing reader retries briefly."""
    for _ in range(20):
        text = os.pread(fd, 32, 0).decode(errors="replace").strip()
        if text:
            return text
        time.sleep(0.05)
    return "unknown"
