"""The environment loop's turns over a ``rollout.RequestBackend``: a rollout server (``RolloutClient``) or a Ray
pool (``RolloutPool``).

Each turn is one request of the whole conversation so far (the prompt, every model turn and every environment
reply, as token ids) with ``max_tokens`` = the turn's budget, sent with ``backend.submit`` as soon as the
conversation is ready: every conversation proceeds on its own, and a slow tool stalls only its own. The backend
keeps no conversation state; its prefix cache serves the earlier turns' KV (every full block of the previous
request's prompt and completion; the partial last block is recomputed), so a turn computes little more than the
environment's reply. Each turn is sent with the conversation's id as ``routing_key``: a pool sends every turn of
a conversation to the same replica, whose prefix cache holds the earlier ones. ``RequestOutput.num_cached_tokens``
of each turn says how much the cache served.

What ``step`` returns is shaped as the in-process path's outputs: a conversation's completion holds every token
after its prompt (model and environment), logprob 0.0 and the last model token's policy version at environment
tokens. A request that fails (``RequestRejected``, ``ServerError``, a broken connection, a dead pool replica)
becomes a ``TurnFailed`` for its conversation alone. ``abort`` and ``end`` forget a conversation: a turn still in
flight runs to its end on the backend (there is no per-request abort) and its result is dropped.

Sampling: each turn's request starts its sampler at output position 0, so a seeded conversation's turn seed is
derived from the seed and the tokens before the turn (deterministic, different per turn); at temperature > 0 the
draws therefore differ from the in-process loop's, whose one sequence continues its positions across turns.
"""

from __future__ import annotations

import dataclasses
import queue
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from rollout.envs.turns import TurnFailed
from rollout.outputs import CompletionOutput, RequestOutput
from rollout.sampling_params import MAX_SEED, SamplingParams

_SEED_STEP = 0x9E3779B97F4A7C15


@dataclass(slots=True, eq=False)
class _Remote:
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)  # after the prompt: model and environment tokens
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    future: Future | None = None  # the turn in flight


class RemoteTurns:
    def __init__(self, client: Any, wait_s: float = 0.01) -> None:
        """``wait_s``: how long ``step`` waits for a turn to end when none has (the loop polls the environments
        between steps)."""
        self.client, self.wait_s = client, wait_s
        limits = client.limits
        self._capacity = min(limits.max_model_len, limits.kv_cache_tokens)
        self._convs: dict[str, _Remote] = {}
        self._running: set[str] = set()
        self._done: queue.SimpleQueue[tuple[str, Future]] = queue.SimpleQueue()  # from the client's threads

    @property
    def capacity(self) -> int:
        return self._capacity

    def start(self, prompt_ids: list[int], params: SamplingParams, request_id: str) -> str:
        if params.n != 1:
            raise ValueError(f"a conversation has one sample (n=1), got n={params.n}; start n conversations")
        if request_id in self._convs:
            raise ValueError(f"conversation id {request_id!r} is already running")
        conv = self._convs[request_id] = _Remote(list(prompt_ids))
        self._send(request_id, conv, params)
        return request_id

    def room(self, request_id: str) -> int:
        conv = self._convs[request_id]
        return self._capacity - len(conv.prompt_ids) - len(conv.token_ids)

    def resume(self, request_id: str, given_ids: list[int], params: SamplingParams, max_new_tokens: int) -> bool:
        conv = self._convs[request_id]
        room = self.room(request_id) - len(given_ids)
        if conv.future is not None or not given_ids or max_new_tokens < 1 or room < 1:
            raise ValueError(f"conversation {request_id!r}: {len(given_ids)} given tokens and {max_new_tokens} new "
                             f"ones need >= 1 each, room for both ({room + len(given_ids)} tokens left) and no turn "
                             "running")
        conv.token_ids += given_ids
        conv.logprobs += [0.0] * len(given_ids)
        conv.versions += [conv.versions[-1] if conv.versions else 0] * len(given_ids)
        budget = min(max_new_tokens, room)
        self._send(request_id, conv, dataclasses.replace(params, max_tokens=budget,
                                                         min_tokens=min(params.min_tokens, budget)))
        return True

    def end(self, request_id: str) -> None:
        self._convs.pop(request_id, None)
        self._running.discard(request_id)

    def abort(self, request_id: str) -> None:
        self.end(request_id)  # a turn in flight finishes on the server; its result is dropped

    def busy(self) -> bool:
        return bool(self._running)

    def step(self) -> list[RequestOutput | TurnFailed]:
        """The turns answered since the last call, waiting up to ``wait_s`` for the first."""
        ended: list[RequestOutput | TurnFailed] = []
        wait: float | None = self.wait_s
        while True:
            try:
                rid, fut = self._done.get(timeout=wait) if wait else self._done.get_nowait()
            except queue.Empty:
                return ended
            wait = None
            conv = self._convs.get(rid)
            if conv is None or conv.future is not fut:  # ended or aborted meanwhile: dropped
                continue
            conv.future = None
            self._running.discard(rid)
            try:
                out = fut.result()
            except Exception as e:  # noqa: BLE001 - whatever failed the request fails this conversation only
                ended.append(TurnFailed(rid, f"the rollout backend did not generate the turn: {type(e).__name__}: "
                                             f"{e}"))
                continue
            comp = out.outputs[0]
            conv.token_ids += comp.token_ids
            conv.logprobs += comp.logprobs
            conv.versions += comp.policy_versions
            ended.append(RequestOutput(
                rid, list(conv.prompt_ids),
                [CompletionOutput(0, list(conv.token_ids), list(conv.logprobs), comp.finish_reason, None,
                                  list(conv.versions), comp.stop_reason)],
                None, True, num_cached_tokens=out.num_cached_tokens))

    def _send(self, rid: str, conv: _Remote, params: SamplingParams) -> None:
        if params.seed is not None and conv.token_ids:  # each request samples from position 0: a new turn seed
            params = dataclasses.replace(params, seed=(params.seed + _SEED_STEP * len(conv.token_ids)) % MAX_SEED)
        fut = conv.future = self.client.submit(conv.prompt_ids + conv.token_ids, params, routing_key=rid)
        self._running.add(rid)
        fut.add_done_callback(lambda f, rid=rid: self._done.put((rid, f)))
