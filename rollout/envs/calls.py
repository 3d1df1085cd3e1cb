"""Environment calls off the engine thread: sync callables in a thread pool, ``async def`` ones on an asyncio loop.

``EnvCalls.submit(fn, args, kwargs, then, timeout_s)`` starts a call; ``then(result, error)`` later runs on the
caller's thread (the engine loop's), from ``poll`` or ``wait``, never from a worker. A call still running at its
deadline gets ``then(None, TimeoutError)`` and is abandoned: an async one is cancelled; a sync one keeps its pool
thread until it returns (its result is dropped), and the pool is replaced once half its threads are held so.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import heapq
import itertools
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from rollout.envs.protocol import is_async

Then = Callable[[Any, BaseException | None], None]


class EnvCalls:
    def __init__(self, workers: int) -> None:
        self.workers = workers
        self._pool = cf.ThreadPoolExecutor(workers, thread_name_prefix="env")
        self._aloop: asyncio.AbstractEventLoop | None = None
        self._done: queue.SimpleQueue[int] = queue.SimpleQueue()  # keys of finished calls, from any thread
        self._pending: dict[int, tuple[Then, bool, float | None]] = {}  # key -> (then, sync, timeout)
        self._futures: dict[int, cf.Future] = {}
        self._deadlines: list[tuple[float, int]] = []
        self._abandoned: set[int] = set()  # sync calls past their deadline, still holding a pool thread
        self._keys = itertools.count()

    def submit(self, fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any], then: Then,
               timeout_s: float | None = None) -> None:
        key = next(self._keys)
        if is_async(fn):
            fut: cf.Future = asyncio.run_coroutine_threadsafe(fn(*args, **kwargs), self._loop())
        else:
            fut = self._pool.submit(fn, *args, **kwargs)
        self._pending[key] = (then, not is_async(fn), timeout_s)
        self._futures[key] = fut
        if timeout_s is not None:
            heapq.heappush(self._deadlines, (time.monotonic() + timeout_s, key))
        fut.add_done_callback(lambda _f, k=key: self._done.put(k))

    def poll(self) -> None:
        """Run the continuations of every finished call and of every call past its deadline."""
        while True:
            try:
                key = self._done.get_nowait()
            except queue.Empty:
                break
            self._finish(key)
        self._expire()

    def wait(self, max_s: float = 0.05) -> None:
        """Block until a call finishes, the next deadline passes or ``max_s`` elapse; then ``poll``."""
        timeout = max_s
        if self._deadlines:
            timeout = max(0.0, min(timeout, self._deadlines[0][0] - time.monotonic()))
        try:
            self._finish(self._done.get(timeout=timeout))
        except queue.Empty:
            pass
        self.poll()

    @property
    def num_pending(self) -> int:
        """Calls whose continuation has not run yet."""
        return len(self._pending)

    def forget(self) -> None:
        """Drop every call in flight (a run that raised): their late results are ignored."""
        self._pending.clear()
        self._deadlines.clear()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._aloop is not None:
            self._aloop.call_soon_threadsafe(self._aloop.stop)

    def _loop(self) -> asyncio.AbstractEventLoop:
        if self._aloop is None:
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="env-async", daemon=True).start()
            self._aloop = loop
        return self._aloop

    def _finish(self, key: int) -> None:
        entry = self._pending.pop(key, None)
        fut = self._futures.pop(key)
        if entry is None:  # timed out earlier (or forgotten): its late result is dropped
            self._abandoned.discard(key)
            return
        then = entry[0]
        error = fut.exception() if not fut.cancelled() else cf.CancelledError()
        then(None if error is not None else fut.result(), error)

    def _expire(self) -> None:
        now = time.monotonic()
        while self._deadlines and self._deadlines[0][0] <= now:
            _, key = heapq.heappop(self._deadlines)
            entry = self._pending.pop(key, None)
            if entry is None:
                continue
            then, sync, timeout_s = entry
            fut = self._futures[key]
            if not fut.cancel() and sync and not fut.done():
                self._abandoned.add(key)
                if len(self._abandoned) * 2 >= self.workers:  # too many stuck threads: a fresh pool
                    self._pool.shutdown(wait=False)
                    self._pool = cf.ThreadPoolExecutor(self.workers, thread_name_prefix="env")
                    self._abandoned.clear()
            then(None, TimeoutError(f"timed out after {timeout_s:g} s"))
