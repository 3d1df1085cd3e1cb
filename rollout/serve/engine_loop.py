"""The engine loop in its own thread: HTTP handlers enqueue, the loop steps and hands results back.

Handlers ``submit`` requests (already validated with the engine's own checks) and ``abort`` them; both
only append to a queue, which the loop drains between steps into ``Engine.add_request`` / ``abort``, so
a handler never waits for the engine's lock while a step runs. Handlers await an asyncio future (or
queue) that the loop fills: finished ``RequestOutput``s from ``step()``, and for streams a
``partial_output`` after every step that landed new tokens. Everything else that must happen at a step
boundary (weight updates, pause, sleep, stats) runs in this thread through ``call``. HTTP handling
therefore never blocks a step, and a step never waits on a client.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("rollout.serve")


@dataclass(slots=True)
class Waiter:
    """Where one request's results go: a future (final output) and, when streaming, a queue of partials."""

    loop: asyncio.AbstractEventLoop
    done: asyncio.Future
    stream: asyncio.Queue | None = None  # gets (tag, output, final) items
    tag: int = 0  # which prompt of the HTTP request this is
    sent_tokens: int = -1  # landed tokens already pushed to ``stream`` (summed over the request's samples)

    def _post(self, fn: Callable[..., Any], *args: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed: the server is shutting down
            pass

    def finish(self, out: Any) -> None:
        self._post(_set, self.done, out, None)
        if self.stream is not None:
            self._post(self.stream.put_nowait, (self.tag, out, True))

    def fail(self, exc: BaseException) -> None:
        self._post(_set, self.done, None, exc)
        if self.stream is not None:
            self._post(self.stream.put_nowait, (self.tag, exc, True))

    def partial(self, out: Any) -> None:
        if self.stream is not None:
            self._post(self.stream.put_nowait, (self.tag, out, False))


def _cuda_index(device: Any) -> int | None:
    """The CUDA device index an engine on ``device`` runs on (``cuda`` alone means the current one)."""
    if getattr(device, "type", None) != "cuda":
        return None
    if device.index is not None:
        return device.index
    import torch

    return torch.cuda.current_device()


def _set(fut: asyncio.Future, value: Any, exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(value)


@dataclass(slots=True)
class _Rate:
    """Generated tokens per second over a sliding window of (time, total) samples."""

    window_s: float = 10.0
    samples: deque = field(default_factory=deque)

    def add(self, now: float, total: int) -> None:
        if self.samples and now - self.samples[-1][0] < 0.25:
            return
        self.samples.append((now, total))
        while len(self.samples) > 2 and now - self.samples[0][0] > self.window_s:
            self.samples.popleft()

    def rate(self, now: float, total: int) -> float:
        if not self.samples:
            return 0.0
        t0, n0 = self.samples[0]
        return (total - n0) / (now - t0) if now - t0 > 1e-3 else 0.0


class EngineLoop:
    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._cv = threading.Condition()
        self._commands: deque[tuple[Callable[[], Any], Future]] = deque()
        self._incoming: deque[tuple[Any, Any, str]] = deque()  # (prompt, params, request_id) to add
        self._aborts: deque[str] = deque()
        self._waiters: dict[str, Waiter] = {}
        self._paused = False
        self._stopping = False
        self.error: BaseException | None = None  # set when a step raised: the server is unhealthy
        self.rate = _Rate()
        self._cuda_index = _cuda_index(engine.device)  # resolved here, in the thread that built the engine
        self._thread = threading.Thread(target=self._run, name="rollout-engine-loop", daemon=True)

    # ---- control (any thread) ------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        self._thread.join(timeout)

    @property
    def paused(self) -> bool:
        return self._paused

    def submit(self, prompt: Any, params: Any, request_id: str, waiter: Waiter) -> None:
        """Queue one request for the loop to add; should the engine still refuse it, the waiter fails."""
        if self.error is not None:
            raise RuntimeError(f"the engine loop has failed: {self.error!r}")
        with self._cv:
            if self._stopping:
                raise RuntimeError("the server is shutting down")
            self._waiters[request_id] = waiter
            self._incoming.append((prompt, params, request_id))
            self._cv.notify_all()

    def abort(self, request_id: str) -> None:
        """Abort a request whose client went away; its waiter is dropped."""
        with self._cv:
            self._waiters.pop(request_id, None)
            self._aborts.append(request_id)
            self._cv.notify_all()

    def call(self, fn: Callable[[], Any]) -> Future:
        """Run ``fn`` in the loop thread at the next step boundary (also while paused)."""
        fut: Future = Future()
        with self._cv:
            if self._stopping:
                fut.set_exception(RuntimeError("the server is shutting down"))
                return fut
            self._commands.append((fn, fut))
            self._cv.notify_all()
        return fut

    def set_paused(self, paused: bool) -> None:
        """Only from the loop thread (inside ``call``), so a pause lands at a step boundary."""
        self._paused = paused

    def abort_all(self) -> int:
        """Loop thread only: abort every request; their clients get ``finish_reason="abort"``."""
        with self._cv:
            ids = list(self._waiters)
        for rid in ids:
            self.engine.abort(rid)
        self._dispatch(self.engine.step() if not self.engine.is_sleeping else [])
        return len(ids)

    def num_waiters(self) -> int:
        return len(self._waiters)

    def wake(self) -> None:
        with self._cv:
            self._cv.notify_all()

    # ---- the thread ----------------------------------------------------------------------------------
    def _runnable(self) -> bool:
        return (not self._paused and self.error is None and not self.engine.is_sleeping
                and self.engine.has_unfinished_requests())

    def _run(self) -> None:
        if self._cuda_index is not None:
            import torch

            torch.cuda.set_device(self._cuda_index)  # the current device is per thread; kernels launch on it
        while True:
            with self._cv:
                while not (self._stopping or self._commands or self._incoming or self._aborts or self._runnable()):
                    self._cv.wait(timeout=0.5)
                if self._stopping:
                    break
                commands, self._commands = list(self._commands), deque()
                incoming, self._incoming = list(self._incoming), deque()
                aborts, self._aborts = list(self._aborts), deque()
            for prompt, params, rid in incoming:
                try:
                    self.engine.add_request(prompt, params, rid)
                except Exception as e:  # noqa: BLE001 - handed to the request's handler (a 400)
                    with self._cv:
                        waiter = self._waiters.pop(rid, None)
                    if waiter is not None:
                        waiter.fail(e)
            for rid in aborts:
                self.engine.abort(rid)
            for fn, fut in commands:
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn())
                    except BaseException as e:  # noqa: BLE001 - handed to the caller
                        fut.set_exception(e)
            if self._runnable():
                try:
                    outs = self.engine.step()
                except BaseException as e:  # noqa: BLE001 - a bug or a device fault: fail loudly, stop stepping
                    log.exception("engine step failed; the server stops generating")
                    self._fail_all(e)
                    continue
                self._dispatch(outs)
        self._fail_all(RuntimeError("the server is shutting down"), keep_error=True)

    def _dispatch(self, outs: list[Any]) -> None:
        now = time.monotonic()
        with self._cv:
            finished = [(self._waiters.pop(o.request_id, None), o) for o in outs]
            streams = [(rid, w) for rid, w in self._waiters.items() if w.stream is not None]
        for waiter, out in finished:
            if waiter is not None:
                waiter.finish(out)
        for rid, waiter in streams:
            part = self.engine.partial_output(rid)
            if part is None:
                continue
            landed = sum(len(c.token_ids) for c in part.outputs)
            if landed != waiter.sent_tokens:
                waiter.sent_tokens = landed
                waiter.partial(part)
        self.rate.add(now, self.engine.get_stats().num_generated_tokens)

    def _fail_all(self, exc: BaseException, keep_error: bool = False) -> None:
        if not keep_error:
            self.error = exc
        with self._cv:
            waiters, self._waiters = list(self._waiters.values()), {}
            commands, self._commands = list(self._commands), deque()
            self._incoming.clear()
        for w in waiters:
            w.fail(exc)
        for _, fut in commands:
            if not fut.done():
                fut.set_exception(exc)
