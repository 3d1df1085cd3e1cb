"""The engine's handle on its tensor-parallel workers: ranks 1 .. N-1, one process each.

Rank 0 is the engine's own process. Each worker is a spawned process holding its model shard and
KV cache; the engine talks to it through a pipe of pickled ``(command, *args)`` tuples. Commands that
need an answer (start-up, weights, sleep) get one reply each; ``execute`` gets none, so a step costs
the engine one pickle and one pipe write per worker.

A worker that fails sends its traceback and exits; one that dies outright is seen through its process
sentinel. Either way the engine is told which rank, and every later call raises the same error: a
tensor-parallel engine with a rank missing cannot compute, so it stops instead of hanging.
"""

from __future__ import annotations

import pickle
import threading
import weakref
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any, NoReturn

import torch
import torch.multiprocessing as mp

from rollout.engine.tp.rank import WorkerSpec, worker_main


class TPWorkers:
    def __init__(self, spec: WorkerSpec) -> None:
        ctx = worker_context(torch.device(spec.device).type)
        self.procs: list[Any] = []
        self.conns: list[Connection] = []
        for rank in range(1, spec.world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=worker_main, args=(rank, spec, child), daemon=True,
                               name=f"rollout-tp-rank{rank}")
            proc.start()
            child.close()
            self.procs.append(proc)
            self.conns.append(parent)
        self.error: str | None = None  # set once a rank failed: the engine cannot go on
        self.on_death: Callable[[], None] | None = None  # called from the watchdog thread (aborts NCCL)
        self._closing = threading.Event()
        threading.Thread(target=_watchdog, args=(self.procs, weakref.ref(self), self._closing), daemon=True,
                         name="rollout-tp-watchdog").start()
        self._finalizer = weakref.finalize(self, _shutdown, self.procs, self.conns, self._closing)

    # ---- commands ----------------------------------------------------------------------------
    def send(self, *message: object) -> None:
        """The same command to every worker, without waiting."""
        self.check()
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        for rank, conn in enumerate(self.conns, start=1):
            try:
                conn.send_bytes(data)
            except OSError:
                self._fail(rank)

    def call(self, *message: object) -> list[Any]:
        """Send a command and return every worker's reply, in rank order."""
        self.send(*message)
        return self.replies()

    def replies(self) -> list[Any]:
        """One reply per worker; raises naming the rank if a worker fails or dies instead."""
        out = []
        for rank, (conn, proc) in enumerate(zip(self.conns, self.procs), start=1):
            while not conn.poll():
                wait([conn, proc.sentinel])
                if not conn.poll() and not proc.is_alive():
                    self._fail(rank)
            kind, value = self._recv(rank, conn)
            if kind == "error":
                self._fail(rank, value)
            out.append(value)
        return out

    def check(self) -> None:
        """Raise if any worker has failed or died (cheap: a non-blocking look at each process)."""
        if self.error is not None:
            raise RuntimeError(self.error)
        for rank, proc in enumerate(self.procs, start=1):
            if not proc.is_alive():
                self._fail(rank)

    def explain(self, exc: BaseException) -> None:
        """A collective raised on rank 0 (a peer went away): raise naming the rank that died, if one did."""
        if self.error is None:
            wait([p.sentinel for p in self.procs], timeout=1.0)  # a death shows a moment after its socket
            for rank, proc in enumerate(self.procs, start=1):
                if not proc.is_alive():
                    self._fail(rank, cause=exc)
        if self.error is not None:
            raise RuntimeError(self.error) from exc

    def halt(self, reason: str) -> None:
        """Stop every worker and the engine with it (the ranks can no longer agree); later calls raise."""
        if self.error is None:
            self.error = f"tensor-parallel engine stopped: {reason} (build a new Engine)"
            _shutdown(self.procs, self.conns, self._closing, grace=0.5)

    def stop(self, reason: str) -> NoReturn:
        self.halt(reason)
        raise RuntimeError(self.error)

    def shutdown(self) -> None:
        self._finalizer()

    # ---- failures ----------------------------------------------------------------------------
    def _recv(self, rank: int, conn: Connection) -> tuple[str, Any]:
        try:
            return pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            self._fail(rank)
            raise AssertionError("unreachable") from None

    def _fail(self, rank: int, detail: str | None = None, cause: BaseException | None = None) -> None:
        if self.error is None:
            conn, proc = self.conns[rank - 1], self.procs[rank - 1]
            if detail is None and _readable(conn):  # a worker's last words: its traceback
                try:
                    kind, value = pickle.loads(conn.recv_bytes())
                    detail = value if kind == "error" else None
                except (EOFError, OSError):
                    pass
            proc.join(timeout=1.0)
            state = "failed" if proc.exitcode in (None, 1) else f"died (exit code {proc.exitcode})"
            self.error = (f"tensor-parallel worker rank {rank} {state}; the engine stopped (build a new Engine)"
                          + (f"\n{detail}" if detail else ""))
            _shutdown(self.procs, self.conns, self._closing, grace=0.5)
        raise RuntimeError(self.error) from cause


def worker_context(device_type: str = "cpu") -> Any:
    """Workers never fork the engine's process (it may hold CUDA state). GPU workers are spawned
    fresh (a fork server that ever touched the CUDA driver would hand it on broken). CPU workers
    come from a fork server that imports torch and the worker code once: the second engine's workers
    start in well under a second instead of re-importing everything."""
    if device_type == "cuda" or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["rollout.engine.tp.rank"])
    return ctx


def _readable(conn: Connection) -> bool:
    try:
        return conn.poll()
    except (EOFError, OSError):
        return False


def _watchdog(procs: list[Any], ref: weakref.ref, closing: threading.Event) -> None:
    """Wake when any worker exits; unless the engine is closing, let it abort its collectives: a
    peer gone mid-step would otherwise leave rank 0 waiting in NCCL for ever."""
    wait([p.sentinel for p in procs])
    workers = ref()
    if not closing.is_set() and workers is not None and workers.on_death is not None:
        workers.on_death()


def _shutdown(procs: list[Any], conns: list[Connection], closing: threading.Event, grace: float = 5.0) -> None:
    """Ask politely, then make sure: no worker outlives its engine (a failed engine's workers may be
    stuck in a collective, so they get a short ``grace``)."""
    closing.set()
    data = pickle.dumps(("shutdown",))
    for conn in conns:
        try:
            conn.send_bytes(data)
        except OSError:
            pass
    for proc in procs:
        proc.join(timeout=grace)
        if proc.is_alive():
            proc.kill()
            proc.join()
    for conn in conns:
        conn.close()
