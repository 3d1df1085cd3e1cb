"""Request and sequence state. No torch: the scheduler and block manager work on these alone."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from rollout.sampling_params import SamplingParams

# In async mode a sequence's next token is appended as a placeholder when it is scheduled to sample;
# the real value arrives one step later (and reaches the device earlier, through the carry-over).
PLACEHOLDER = -1


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    """One sample of one request: prompt + output tokens and where its KV lives.

    "No phases" (vLLM v1): each step computes some of the tokens whose KV is not yet cached,
    ``num_computed_tokens`` catches up with ``num_tokens``, and a sample is drawn whenever it does.
    Chunked prefill, decode, prefix hits and recompute after preemption all fall out of that.
    """

    seq_id: int
    request_id: str
    index: int  # sample index within its request (0 .. n-1)
    token_ids: list[int]  # prompt + output; may end with PLACEHOLDERs in async mode
    num_prompt_tokens: int
    params: SamplingParams
    arrival: int  # admission order; preemption takes the newest first
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose KV is in the cache (or being written this step)
    num_cached_tokens: int = 0  # tokens found in the prefix cache when last allocated
    num_first_cached_tokens: int = -1  # num_cached_tokens at its first admission (-1: not admitted yet)
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of full, known blocks
    logprobs: list[float] = field(default_factory=list)
    policy_versions: list[int] = field(default_factory=list)
    num_inflight: int = 0  # placeholders at the end of token_ids awaiting their sampled value
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    parent: Sequence | None = None  # sample 0 of the request, whose prompt blocks a sibling forks
    sample_seed: int = 0  # with the output position, fixes every random draw of this sequence
    stop_ids: tuple[int, ...] = ()  # EOS and stop_token_ids: masked before min_tokens, stop after
    priority: int = 0  # lower is scheduled first within the queues; FCFS (arrival) among equals
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # when params.logprobs
    prompt_lp_start: int = -1  # first prompt token whose logprob is wanted (-1: none); caps prefix-cache hits
    score_only: bool = False  # Engine.score: finish once the prompt is computed, sample nothing
    # Multi-turn (engine/turns.py): a turn's end parks the sequence with its KV instead of freeing it.
    keep_kv: bool = False
    park_step: int = -1  # the newest step planned when it parked: samples of steps <= it are stale
    hold_until: int = 0  # its given tokens wait for other work until this step id (turn_prefill_hold_steps)
    decode_pos: int = -1  # index of the newest sampled token: computing it is decode, not prefill

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose value is known on the host (all but trailing placeholders)."""
        return len(self.token_ids) - self.num_inflight

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED


@dataclass(slots=True, eq=False)
class Request:
    """A prompt with ``params.n`` sample sequences that share its prompt blocks."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    prompt: str | None = None
    # params.prompt_logprobs / Engine.score: per prompt position (first None), filled as prefill computes them
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)
