"""What the environment loop drives: conversations' turns on a backend (``Turns``), and which one a backend gets.

- an in-process ``Engine`` (``rollout.ContinuousBackend``): ``rollout.engine.turns.Conversations``; each turn
  continues the same engine sequence, its KV resident between turns, and ``step`` is the engine's step;
- a rollout server or a Ray pool (``rollout.RequestBackend``: ``RolloutClient``, ``RolloutPool``):
  ``rollout.envs.remote_turns.RemoteTurns``; each turn is one request of the whole conversation so far, and the
  prefix cache of the server (of the pool replica every turn of the conversation is routed to) serves the
  earlier turns' KV.

Either way a finished turn comes back from ``step`` as a ``RequestOutput`` whose completion holds every token after
the prompt (model and environment), with logprob 0.0 and the last model token's policy version at environment
tokens, so the loop assembles its rows the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from rollout.api import ContinuousBackend, RequestBackend

if TYPE_CHECKING:  # pragma: no cover
    from rollout.outputs import RequestOutput
    from rollout.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class TurnFailed:
    """A turn the backend could not generate (the server refused or failed the request): the conversation's row
    ends ``finish_reason="env_error"`` with ``message`` as its ``error``."""

    request_id: str
    message: str


class Turns(Protocol):
    @property
    def capacity(self) -> int:
        """Tokens one conversation may hold, prompt included."""

    def start(self, prompt_ids: list[int], params: SamplingParams, request_id: str) -> str:
        """The first turn (``params.max_tokens``: its budget); a ValueError if the backend refuses it now."""

    def room(self, request_id: str) -> int:
        """Tokens a conversation between turns may still grow by."""

    def resume(self, request_id: str, given_ids: list[int], params: SamplingParams, max_new_tokens: int) -> bool:
        """Append the environment's tokens and start the next turn; False: not yet, call again after a step."""

    def end(self, request_id: str) -> None:
        """Forget a conversation between turns (its KV freed)."""

    def abort(self, request_id: str) -> None:
        """End a conversation whatever its state (a running turn is aborted, or its result dropped)."""

    def busy(self) -> bool:
        """True while turns are running (``step`` has work)."""

    def step(self) -> list[RequestOutput | TurnFailed]:
        """Advance; the turns that ended (an in-process engine's step may also return other callers' requests)."""


def turns_for(backend: Any) -> Turns:
    """The environment loop's turns on ``backend``: this is the loop's door (a TypeError names what it takes)."""
    if isinstance(backend, ContinuousBackend):
        from rollout.engine.turns import Conversations

        return Conversations(backend)
    if isinstance(backend, RequestBackend):
        from rollout.envs.remote_turns import RemoteTurns

        return RemoteTurns(backend)
    raise TypeError("the environment loop needs an in-process Engine (a rollout.ContinuousBackend: each "
                    "conversation keeps its KV between turns) or a RolloutClient or RolloutPool (a "
                    f"rollout.RequestBackend: each turn one request), got {type(backend).__name__}")
