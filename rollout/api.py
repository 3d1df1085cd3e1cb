"""The contracts every caller of a rollout engine relies on.

``RolloutBackend`` is what the main job, the trainers (GRPO, async GRPO, PPO, partial mode) and the weight
push take: ``Engine`` (in process), ``RolloutPool`` (Ray replicas) and ``RolloutClient`` (a server over
HTTP) implement it. ``SteppedBackend`` adds the step surface (``add_request`` / ``step`` / ``abort``) the
job's round driver needs (``Engine`` and ``RolloutPool``); ``ContinuousBackend`` adds requests at any step
and a running request's tokens, which partial rollouts need (``Engine``). ``RequestBackend`` adds ``submit``:
one request answered on its own, from any thread, which the environment loop's turns over a server or a pool
need (``RolloutClient``, ``RolloutPool``).
Each entry point calls ``require_backend`` once at its door; nothing past the door asks what a backend is.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:  # pragma: no cover
    from concurrent.futures import Future

    from rollout.engine.stats import EngineStats
    from rollout.outputs import RequestOutput

__all__ = ["BackendLimits", "ContinuousBackend", "RequestBackend", "RolloutBackend", "SteppedBackend",
           "require_backend"]


@dataclass(frozen=True, slots=True)
class BackendLimits:
    """What a prompt and a batch may be: the same numbers for one engine, a pool or a server."""

    max_model_len: int  # prompt + completion tokens of one sequence
    vocab_size: int  # token ids must be in [0, vocab_size)
    max_num_seqs: int  # sequences one engine (replica) runs at once
    kv_cache_tokens: int  # KV capacity of one engine (replica) in tokens: the most one group can hold
    replicas: int = 1  # engines behind the backend


class _StaticProtocolMeta(type(Protocol)):  # type: ignore[misc]
    """``isinstance`` finds members on the type, never evaluating them: on Python 3.11 a runtime protocol
    calls ``hasattr``, which would run a property (a client's ``policy_version`` is an HTTP request)."""

    def __instancecheck__(cls, instance: object) -> bool:
        missing = object()
        return all(inspect.getattr_static(instance, name, missing) is not missing for name in cls.members())

    def members(cls) -> tuple[str, ...]:
        names: list[str] = []
        for base in reversed(cls.__mro__):
            if base is object or base.__name__ in ("Protocol", "Generic"):
                continue
            names += [n for n in (*vars(base), *getattr(base, "__annotations__", {}))
                      if not n.startswith("_") and n not in names and n != "members"]
        return tuple(names)


@runtime_checkable
class RolloutBackend(Protocol, metaclass=_StaticProtocolMeta):
    """Generation with per-token logprobs and policy versions, weight updates, memory and counters."""

    def generate(self, prompts: Any, sampling_params: Any = None, use_tqdm: bool = False) -> list[RequestOutput]:
        """One ``RequestOutput`` per prompt, in prompt order."""

    def update_weights(self, named_tensors: Iterable[tuple[str, Any]] | Any, version: int | None = None,
                       recompute_running: bool = True) -> int:
        """All-or-nothing; returns the new policy version (``version`` or the current one + 1)."""

    @property
    def policy_version(self) -> int:
        """The version of the weights the next token is sampled with."""

    def get_stats(self) -> EngineStats:
        """Cumulative counters (a window's numbers are differences of two snapshots)."""

    @property
    def limits(self) -> BackendLimits:
        """Limits on prompts and batches."""

    def sleep(self, level: int = 1) -> int:
        """Give the KV cache (level 2: the weights too) back for a co-located trainer; bytes released."""

    def wake_up(self) -> None:
        """Take back what ``sleep`` gave."""

    @property
    def is_sleeping(self) -> bool:
        """True between ``sleep`` and ``wake_up``."""

    def close(self) -> None:
        """Release the backend's processes, connections and memory; idempotent."""

    def describe(self) -> dict[str, Any]:
        """The resolved settings (what ``auto`` / ``None`` became), JSON-safe, for a run's config."""


@runtime_checkable
class SteppedBackend(RolloutBackend, Protocol, metaclass=_StaticProtocolMeta):
    """A backend a caller drives one step at a time, adding requests between rounds (the main job)."""

    def add_request(self, prompt: Any, sampling_params: Any = None, request_id: str | None = None) -> str:
        """Queue one prompt (a group of ``n`` samples); returns its request id."""

    def step(self) -> list[RequestOutput]:
        """Advance; returns the requests that finished."""

    def abort(self, request_id: str) -> None:
        """Drop a request (it comes back from a later ``step`` with ``finish_reason="abort"``)."""

    def has_unfinished_requests(self) -> bool:
        """True while any added request has not been returned by ``step``."""


@runtime_checkable
class ContinuousBackend(SteppedBackend, Protocol, metaclass=_StaticProtocolMeta):
    """A stepped backend that takes requests at any step and shows a running request's tokens (partial
    rollouts carry groups across rounds and weight updates): the in-process ``Engine``."""

    def partial_output(self, request_id: str) -> RequestOutput | None:
        """A running request's tokens so far (None when unknown or finished)."""


@runtime_checkable
class RequestBackend(RolloutBackend, Protocol, metaclass=_StaticProtocolMeta):
    """A backend that answers each request on its own, sent from any thread without waiting (a server: the
    environment loop sends each conversation's next turn as soon as it is ready)."""

    def submit(self, prompt: Any, sampling_params: Any = None, routing_key: str | None = None
               ) -> Future[RequestOutput]:
        """One prompt's request, sent now; its ``RequestOutput`` (or the error) when it is answered. Requests with
        the same ``routing_key`` go to the same engine where the backend has several (a pool), so its prefix cache
        serves what they share (a conversation's earlier turns); one engine ignores it."""


_ACCEPTS = {
    RolloutBackend: "an Engine, a RolloutPool or a RolloutClient",
    SteppedBackend: "an Engine or a RolloutPool (it adds requests and steps them)",
    ContinuousBackend: "an in-process Engine (it adds requests while others run and reads their tokens so far)",
    RequestBackend: "a RolloutClient or a RolloutPool (it sends each request on its own, from any thread)",
}


def require_backend(backend: object, who: str, kind: type = RolloutBackend) -> Any:
    """``backend`` if it implements ``kind``, else a TypeError saying what ``who`` accepts. Each entry point
    calls this once at its door; nothing past the door asks what a backend is."""
    if isinstance(backend, kind):
        return backend
    raise TypeError(f"{who} needs {_ACCEPTS[kind]} (a rollout.{kind.__name__}), got {type(backend).__name__}")
