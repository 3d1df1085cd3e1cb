"""An ``Engine``-shaped step surface over a ``RolloutPool``, so the main job's actor drives a pool unchanged.

``RolloutActor`` queues a round with ``add_request`` and calls ``step()`` until every request came
back. Here the queued requests become one ``RolloutPool.generate_iter`` call on the first ``step()``,
and each later ``step()`` returns the next finished group (under the id it was queued with).
``get_stats`` sums the replicas' counters (KV usage and GPU busy are averaged), so the round's
metrics keep their meaning. Requests are added between rounds only, as the actor does.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

from rollout.engine.stats import EngineStats
from rollout.outputs import RequestOutput
from rollout.sampling_params import SamplingParams


class PoolEngine:
    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.tokenizer = None  # outputs carry their text when the replicas' engines have a tokenizer
        self._queued: dict[str, tuple[Any, SamplingParams | None]] = {}
        self._ids: list[str] = []
        self._iter: Iterator[tuple[int, RequestOutput]] | None = None
        self._left = 0

    @property
    def policy_version(self) -> int:
        return self.pool.policy_version

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

    def generate(self, prompts: Any, sampling_params: Any = None, use_tqdm: bool = False) -> list[RequestOutput]:
        return self.pool.generate(prompts, sampling_params)

    def update_weights(self, named_tensors: Any, version: int | None = None, recompute_running: bool = True) -> int:
        return self.pool.update_weights(named_tensors, version=version, recompute_running=recompute_running)

    def get_stats(self) -> EngineStats:
        return self.pool.get_stats()
