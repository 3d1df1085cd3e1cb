"""The pool's step surface (``SteppedBackend``): queued requests become one round over the replicas.

The job's round driver queues a round with ``add_request`` and calls ``step()`` until every request came
back. Here the queued requests become one ``RolloutPool.generate_iter`` call on the first ``step()``,
and each later ``step()`` returns the next finished group (under the id it was queued with). Requests
are added between rounds only, as the driver does.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

from rollout.outputs import RequestOutput
from rollout.sampling_params import SamplingParams


class RoundQueue:
    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self._queued: dict[str, tuple[Any, SamplingParams | None]] = {}
        self._ids: list[str] = []
        self._iter: Iterator[tuple[int, RequestOutput]] | None = None
        self._left = 0

    def add_request(self, prompt: Any, sampling_params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        if self._iter is not None:
            raise RuntimeError("the pool is running a round; add requests before its first step()")
        request_id = request_id if request_id is not None else uuid.uuid4().hex
        if request_id in self._queued:
            raise ValueError(f"request_id {request_id!r} is already in use")
        self._queued[request_id] = (prompt, sampling_params)
        return request_id

    def abort(self, request_id: str) -> None:
        """Withdraw a request not yet handed to the pool (a started round runs to its end)."""
        if self._iter is None:
            self._queued.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self._queued) or self._iter is not None

    def step(self) -> list[RequestOutput]:
        """The next finished group (blocks until one finishes); [] once the round is done."""
        if self._iter is None:
            if not self._queued:
                return []
            self._ids = list(self._queued)
            self._left = len(self._ids)
            prompts = [p for p, _ in self._queued.values()]
            params = [sp or SamplingParams() for _, sp in self._queued.values()]
            self._queued = {}
            self._iter = self.pool.generate_iter(prompts, params)
        try:
            i, out = next(self._iter)
        except StopIteration:
            self._iter = None
            return []
        except BaseException:
            self._iter = None
            raise
        out.request_id = self._ids[i]
        self._left -= 1
        if self._left == 0:  # the round's last group: let the pool close the round (its metrics) now
            for _ in self._iter:
                pass
            self._iter = None
        return [out]
