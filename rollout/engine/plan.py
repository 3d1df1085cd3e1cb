"""The one contract between scheduler and model runner: a plain batch plan in, sampled tokens out.

No torch here; the runner turns a plan into device tensors. The plan never says where a previous
step's outputs live: a ``carry`` input is "this sequence's latest sample, still on the device", and
each runner remembers where it put that sample.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SeqPlan:
    """One sequence's share of a step: compute ``input_ids`` at positions ``start_pos ..``."""

    seq_id: int
    input_ids: list[int]  # the last one is PLACEHOLDER (-1) when ``carry``
    start_pos: int  # num_computed_tokens before this step
    block_table: list[int]
    sample: bool  # draw a token from the logits of the last input token
    carry: bool = False  # the last input is this sequence's sample from the previous step (runner fills it)
    # Sampling settings (only read when ``sample``).
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0
    sample_pos: int = 0  # index of the output token being sampled: with ``seed``, fixes the random draw
    logprobs_mode: str = "policy"
    suppress_ids: tuple[int, ...] = ()  # token ids masked out of sampling (EOS before min_tokens)
    num_top_logprobs: int = 0  # also return this many most likely tokens of the sampled distribution
    penalties: tuple[float, float, float] | None = None  # (repetition, presence, frequency); None = off
    # The sequence's tokens (shared, not copied; trailing PLACEHOLDERs are in flight) and its prompt length:
    # a runner builds its device-side token counts from them when it first sees the sequence.
    history: list[int] | None = None
    num_prompt_tokens: int = 0
    # Prompt logprobs: the logits at positions prompt_first .. + len(prompt_targets) - 1 score these tokens.
    prompt_targets: list[int] | None = None
    prompt_first: int = 0
    prompt_top: int = 0  # alternatives per prompt token

    @property
    def seq_len(self) -> int:
        return self.start_pos + len(self.input_ids)


@dataclass(slots=True)
class BatchPlan:
    step_id: int
    seqs: list[SeqPlan]
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst) blocks
    policy_version: int = 0  # the weights this step runs with: every token it samples is tagged with it
    num_prompt_tokens: int = 0  # prompt tokens computed by this step (prefill work, for stats)
    # Swap copies, done before ``block_copies`` and the forward, swap-outs first: (gpu_block, host_block)
    # saves a preempted sequence's KV; (host_block, gpu_block) restores a resumed one.
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    has_prompt_logprobs: bool = False  # some SeqPlan has prompt_targets
    score_done: list[int] = field(default_factory=list)  # score-only sequences this step completes

    @property
    def decode_only(self) -> bool:
        return all(len(s.input_ids) == 1 for s in self.seqs)

    @property
    def sample_seqs(self) -> list[SeqPlan]:
        return [s for s in self.seqs if s.sample]

    @property
    def num_context_tokens(self) -> int:
        """Tokens whose KV this step's attention reads (its share of the byte floor)."""
        return sum(s.seq_len for s in self.seqs)


@dataclass(slots=True)
class SampleResult:
    """What the runner hands back for one plan: one entry per sampling sequence, in plan order."""

    step_id: int
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per row, its SeqPlan.num_top_logprobs pairs
    # (seq_id, position of the first scored token, logprobs, alternatives per token or None)
    prompt_logprobs: list[tuple[int, int, list[float], list[list[tuple[int, float]]] | None]] = field(
        default_factory=list)
