"""One thread that steps an ``Engine``; any other thread submits requests, aborts them, or runs a call between steps.

``submit`` and ``abort`` only append to a queue, which the thread drains between steps into
``Engine.add_request`` / ``abort``, so a caller never waits for the engine's lock while a step runs. Each
request gets a ``concurrent.futures.Future`` (asyncio callers await ``asyncio.wrap_future`` of it) that the
thread resolves with the finished ``RequestOutput``; an ``on_partial`` callback (streaming) gets the
tokens each step landed (a delta without text, so a step costs O(new tokens), not O(output)). Everything
else that must happen at a step boundary (weight updates, pause, sleep, stats) runs in this thread through
``call``. The HTTP server and each pool replica run one, so a caller never blocks a step and a step never
waits on a caller.

Streams cost the stepping thread little per step: their deltas are collected at most every ``stream_interval_s`` (and
skipped while the listeners are still busy with the last batch: the tokens wait in the engine and come in
the next one; a stream's first tokens go out the step they land, so the interval never delays the first
token), then handed in one batch to a second thread that calls the ``on_partial`` listeners and settles the
streams' futures, in order (a stream's last delta before its final output). The listeners'
work (detokenizing, rendering events) never runs in the stepping thread.

A step that raises is rolled back by the engine. The requests it held (``Engine.failed_request_ids``)
fail with its error and are aborted, so a request that breaks every step it is in cannot wedge the loop;
the loop serves everything else on. Should the thread itself die (a bug outside a step), ``alive`` turns
False, ``error`` says why, everything pending fails and later submits are refused: the server's
``/health`` then answers 503, and a pool replica exits so the pool replaces it.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any

from rollout.outputs import RequestOutput
from rollout.sampling_params import SamplingParams

log = logging.getLogger(__name__)

CLOSED = "the engine loop is shut down"
FRESH_PER_STEP = 256  # streams checked each step for their first tokens (between stream_interval_s batches)


@dataclass(slots=True)
class _Waiter:
    """One submitted request: its future, and for streams the callback and what it was last given."""

    future: Future
    on_partial: Callable[[RequestOutput], None] | None = None
    num_seqs: int = 1  # params.n: what ``num_queued_seqs`` counts
    sent: list[int] = field(default_factory=list)  # tokens passed to ``on_partial`` so far, per sample index


@dataclass(slots=True)
class TokenRate:
    """Generated tokens per second over a sliding window of (time, total) samples."""

    window_s: float = 10.0
    samples: deque = field(default_factory=deque)

    def add(self, now: float, total: Callable[[], int]) -> None:
        if self.samples and now - self.samples[-1][0] < 0.25:
            return
        self.samples.append((now, total()))
        while len(self.samples) > 2 and now - self.samples[0][0] > self.window_s:
            self.samples.popleft()

    def rate(self, now: float, total: int) -> float:
        if not self.samples:
            return 0.0
        t0, n0 = self.samples[0]
        return (total - n0) / (now - t0) if now - t0 > 1e-3 else 0.0


class AsyncEngine:
    def __init__(self, engine: Any, name: str = "rollout-engine-loop", stream_interval_s: float = 0.0) -> None:
        if not (isinstance(stream_interval_s, (int, float)) and 0 <= stream_interval_s <= 60):
            raise ValueError(f"stream_interval_s={stream_interval_s!r}; allowed: seconds in [0, 60]")
        self.engine = engine
        self.stream_interval_s = float(stream_interval_s)
        self._cv = threading.Condition()
        self._incoming: deque[tuple[Any, SamplingParams | None, str, int]] = deque()  # (prompt, params, id, priority)
        self._aborts: deque[str] = deque()
        self._commands: deque[tuple[Callable[[], Any], Future]] = deque()
        self._waiters: dict[str, _Waiter] = {}
        self._fresh: dict[str, None] = {}  # streams whose first tokens have not gone out (oldest first)
        self._num_seqs = 0  # summed over _waiters
        self._paused = False
        self._stopping = False
        self.busy_s = 0.0  # wall time spent in steps: tokens/s = generated / busy_s
        self.rate = TokenRate()
        self.error: BaseException | None = None  # what killed the thread, if something did
        self._cuda_index = _cuda_index(engine.device)  # resolved here, in the thread that built the engine
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._last_flush = 0.0
        self._stream_batches: deque[list[tuple[_Waiter, Any, BaseException | None, bool]] | None] = deque()
        self._stream_busy = False  # a batch is queued or being delivered: the next flush waits for it
        self._stream_cv = threading.Condition()
        self._batch_done: list[Callable[[], None]] = []  # run in the stream thread after each batch
        self._streamer = threading.Thread(target=self._deliver_streams, name=name + "-streams", daemon=True)

    # ---- any thread --------------------------------------------------------------------------------
    def start(self) -> AsyncEngine:
        self._streamer.start()
        self._thread.start()
        return self

    def close(self, timeout: float = 10.0) -> None:
        """Stop after the step under way; requests and calls still pending fail with RuntimeError."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread is threading.current_thread():
            return  # called inside ``call``: the thread fails what is pending as it exits
        if self._thread.is_alive():
            self._thread.join(timeout)
        if not self._thread.is_alive():  # never started, or done: nothing else will fail them
            self._fail_pending()
            self._stop_streamer(timeout)

    def submit(self, prompt: Any, params: SamplingParams | None = None, request_id: str | None = None,
               on_partial: Callable[[RequestOutput], None] | None = None, priority: int = 0) -> Future:
        """Queue one request; its future gets the finished output, or the error that refused or failed it.

        ``on_partial`` is called (in the stream thread, one call at a time) with the tokens landed since its
        last call only (per sample: ids, logprobs, policy versions; no text), at most every
        ``stream_interval_s``; the future of such a request is settled after its last ``on_partial`` call.
        Cancelling the future aborts the request. ``priority`` goes to ``add_request`` (lower is scheduled first).
        """
        rid = uuid.uuid4().hex if request_id is None else request_id
        fut: Future = Future()
        with self._cv:
            if self._stopping:
                raise self._closed()
            if rid in self._waiters:
                raise ValueError(f"request_id {rid!r} is already in use")
            n = getattr(params, "n", 1)  # not validated yet: the engine refuses a bad one when it adds it
            n = n if type(n) is int and n > 0 else 1
            self._waiters[rid] = waiter = _Waiter(fut, on_partial, n, [0] * n)
            if on_partial is not None:
                self._fresh[rid] = None
            self._num_seqs += waiter.num_seqs
            self._incoming.append((prompt, params, rid, priority))
            self._cv.notify_all()
        fut.add_done_callback(lambda f: self.abort(rid) if f.cancelled() else None)
        return fut

    def abort(self, request_id: str) -> None:
        """End a pending request now (its future is cancelled); unknown or finished ids are ignored."""
        with self._cv:
            waiter = self._pop(request_id)
            if waiter is None:
                return
            self._aborts.append(request_id)
            self._cv.notify_all()
        waiter.future.cancel()

    def on_stream_batch(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` in the stream thread after each batch of ``on_partial`` calls and settled futures: a
        listener that buffers what a batch produces (the server's event-loop poster) hands it on once per
        batch there, rather than once per stream (each hand-over wakes another thread that wants the GIL)."""
        self._batch_done.append(fn)

    def call(self, fn: Callable[[], Any]) -> Future:
        """Run ``fn`` in the loop thread at the next step boundary (also while paused or asleep)."""
        fut: Future = Future()
        with self._cv:
            if self._stopping:
                fut.set_exception(self._closed())
                return fut
            self._commands.append((fn, fut))
            self._cv.notify_all()
        return fut

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def alive(self) -> bool:
        """The thread runs and takes work (False before ``start``, after ``close``, or once it died)."""
        return self._thread.is_alive() and not self._stopping

    def num_pending(self) -> int:
        return len(self._waiters)

    def num_queued_seqs(self) -> int:
        """Sequences of the pending requests (submitted, not finished): waiting + running in the engine."""
        return self._num_seqs

    def _pop(self, request_id: str) -> _Waiter | None:
        """Forget a pending request (the caller holds ``_cv``)."""
        waiter = self._waiters.pop(request_id, None)
        self._fresh.pop(request_id, None)
        if waiter is not None:
            self._num_seqs -= waiter.num_seqs
        return waiter

    # ---- the loop thread only (inside ``call``) -----------------------------------------------------
    def set_paused(self, paused: bool) -> None:
        """Stop or restart stepping; called inside ``call``, so a pause lands at a step boundary."""
        self._paused = paused

    def abort_all(self) -> int:
        """Abort every pending request; their futures get ``finish_reason="abort"`` outputs."""
        with self._cv:
            ids = list(self._waiters)
        for rid in ids:
            self.engine.abort(rid)
        self._dispatch(self.engine.step() if not self.engine.is_sleeping else [])
        return len(ids)

    # ---- the thread ---------------------------------------------------------------------------------
    def _runnable(self) -> bool:
        return not self._paused and not self.engine.is_sleeping and self.engine.has_unfinished_requests()

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as e:  # noqa: BLE001 - a bug outside a step: refuse work from now on, say why
            log.exception("the engine loop died; its pending requests fail and it takes no more")
            with self._cv:
                self.error, self._stopping = e, True
        self._fail_pending()
        self._stop_streamer(10.0)  # a listener stuck for good must not hang the closing thread

    def _serve(self) -> None:
        if self._cuda_index is not None:
            import torch

            torch.cuda.set_device(self._cuda_index)  # the current device is per thread; kernels launch on it
        while True:
            with self._cv:
                while not (self._stopping or self._commands or self._incoming or self._aborts or self._runnable()):
                    self._cv.wait(timeout=0.5)
                if self._stopping:
                    break
                incoming, self._incoming = self._incoming, deque()
                aborts, self._aborts = self._aborts, deque()
                commands, self._commands = self._commands, deque()
            for rid in aborts:
                self.engine.abort(rid)
            self._add(incoming)
            for fn, fut in commands:
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn())
                    except BaseException as e:  # noqa: BLE001 - handed to the caller
                        fut.set_exception(e)
            if self._runnable():
                self._step()

    def _add(self, incoming: deque[tuple[Any, SamplingParams | None, str, int]]) -> None:
        for prompt, params, rid, priority in incoming:
            if rid not in self._waiters:
                continue  # aborted before it was added
            try:
                self.engine.add_request(prompt, params, rid, **({"priority": priority} if priority else {}))
            except Exception as e:  # noqa: BLE001 - the request's own fault: handed to its future
                self._fail([rid], e)

    def _step(self) -> None:
        t0 = time.perf_counter()
        try:
            outs = self.engine.step()
        except BaseException as e:  # noqa: BLE001 - a bug or a device fault: fail that step's requests
            log.exception("engine step failed; its requests fail, the others go on")
            blamed = self.engine.failed_request_ids
            with self._cv:  # a failure that held none of them blames all, so it cannot repeat forever
                ids = [r for r in self._waiters if r in blamed] if blamed else list(self._waiters)
            for rid in ids:
                self.engine.abort(rid)
            self._fail(ids, e if isinstance(e, Exception) else RuntimeError(f"engine step failed: {e!r}"))
            return
        finally:
            self.busy_s += time.perf_counter() - t0
        self._dispatch(outs)

    def _dispatch(self, outs: list[RequestOutput]) -> None:
        now = time.monotonic()
        with self._cv:
            finished = [w for w in ((self._pop(o.request_id), o) for o in outs) if w[0] is not None]
            due = not self._stream_busy and now - self._last_flush >= self.stream_interval_s
            if due:
                streams = [(rid, w) for rid, w in self._waiters.items() if w.on_partial is not None]
            else:  # a stream's first tokens go out at once (time to first token), the rest batched; the
                # oldest FRESH_PER_STEP only, so thousands of queued streams cost a step nothing
                streams = [(rid, self._waiters[rid]) for rid in itertools.islice(self._fresh, FRESH_PER_STEP)]
        batch, started = [], []
        for waiter, out in finished:
            if waiter.on_partial is None:
                _resolve(waiter.future, out, None)
            else:  # after the deltas already handed over
                batch.append((waiter, out, None, True))
        partial, fresh = self.engine.partial_output, self._fresh
        for rid, waiter in streams:  # ~3 us a stream: the stepping thread's whole share of streaming
            part = partial(rid, since=waiter.sent)
            if part is None:
                continue
            landed = 0
            for c in part.outputs:
                landed += len(c.token_ids)
                waiter.sent[c.index] += len(c.token_ids)
            if landed:
                batch.append((waiter, part, None, False))
                if rid in fresh:  # (a stale answer is harmless: the pop below is under _cv)
                    started.append(rid)
        if started:
            with self._cv:
                for rid in started:
                    fresh.pop(rid, None)
        if due and streams:
            self._last_flush = now
        self._hand_over(batch)
        self.rate.add(now, lambda: self.engine.get_stats().num_generated_tokens)

    # ---- streams: delivered by their own thread ---------------------------------------------------------
    def _hand_over(self, batch: list[tuple[_Waiter, Any, BaseException | None, bool]]) -> None:
        if batch:
            with self._stream_cv:
                self._stream_batches.append(batch)
                self._stream_busy = True
                self._stream_cv.notify()

    def _deliver_streams(self) -> None:
        while True:
            with self._stream_cv:
                while not self._stream_batches:
                    self._stream_busy = False
                    self._stream_cv.wait()
                batch = self._stream_batches.popleft()
            if batch is None:  # closing: everything before it was delivered
                return
            for waiter, out, exc, final in batch:
                if final:
                    _resolve(waiter.future, out, exc)
                    continue
                if waiter.future.done():  # aborted meanwhile
                    continue
                try:
                    waiter.on_partial(out)  # type: ignore[misc]
                except Exception:  # noqa: BLE001 - a listener's bug must not stop the others
                    log.exception("on_partial failed for request %s", out.request_id)
                time.sleep(0)  # hand the GIL back now if the stepping thread waits for it (not after 5 ms)
            self._batch_delivered()

    def _batch_delivered(self) -> None:
        for fn in self._batch_done:
            try:
                fn()
            except Exception:  # noqa: BLE001 - a listener's bug must not stop the stream thread
                log.exception("a stream batch listener failed")

    def _stop_streamer(self, timeout: float | None) -> None:
        """After the last batch: the stream thread delivers everything queued, then exits."""
        with self._stream_cv:
            if self._streamer.is_alive() and None not in self._stream_batches:
                self._stream_batches.append(None)
                self._stream_cv.notify()
        if self._streamer.is_alive() and self._streamer is not threading.current_thread():
            self._streamer.join(timeout)

    def _fail(self, ids: list[str], exc: BaseException) -> None:
        with self._cv:
            waiters = [w for w in (self._pop(r) for r in ids) if w is not None]
        for w in waiters:
            if w.on_partial is None or not self._streamer.is_alive():
                _resolve(w.future, None, exc)
        self._hand_over([(w, None, exc, True) for w in waiters if w.on_partial is not None
                         and self._streamer.is_alive()])

    def _fail_pending(self) -> None:
        """Closing: every pending request is aborted in the engine and its future fails, as do the calls."""
        with self._cv:
            ids = list(self._waiters)
            commands, self._commands = self._commands, deque()
            self._incoming.clear()
        try:  # abort, then collect the aborted outputs (and a step in flight): the engine is left with no request
            for rid in ids:
                self.engine.abort(rid)
            for _ in range(3):
                if not self.engine.has_unfinished_requests():
                    break
                self.engine.step()
        except Exception:  # noqa: BLE001 - closing after a fault: the futures still fail below
            log.exception("collecting aborted requests while closing")
        self._fail(ids, self._closed())
        for _, fut in commands:
            _resolve(fut, None, self._closed())

    def _closed(self) -> RuntimeError:
        return RuntimeError(CLOSED if self.error is None else f"the engine loop died: {self.error!r}")


def _resolve(fut: Future, value: Any, exc: BaseException | None) -> None:
    try:
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(value)
    except InvalidStateError:  # cancelled by its caller meanwhile
        pass


def _cuda_index(device: Any) -> int | None:
    """The CUDA device index an engine on ``device`` runs on (``cuda`` alone means the current one)."""
    if getattr(device, "type", None) != "cuda":
        return None
    if device.index is not None:
        return device.index
    import torch

    return torch.cuda.current_device()
