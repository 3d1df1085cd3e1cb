"""The one contract between scheduler and model runner: a plain batch plan in, sampled tokens out.

No torch here; the runner turns a plan into device tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SeqPlan:
    """One sequence's share of a step: compute ``input_ids`` at positions ``start_pos ..``."""

    seq_id: int
    input_ids: list[int]  # PLACEHOLDER (-1) where the token arrives by carry-over
    start_pos: int  # num_computed_tokens before this step
    block_table: list[int]
    sample: bool  # draw a token from the logits of the last input token
    carry_src: int = -1  # row of the previous step's samples that fills the placeholder input, or -1
    # Sampling settings (only read when ``sample``).
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0
    sample_pos: int = 0  # index of the output token being sampled: with ``seed``, fixes the random draw
    logprobs_mode: str = "policy"
    suppress_ids: tuple[int, ...] = ()  # token ids masked out of sampling (EOS before min_tokens)

    @property
    def num_new_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def seq_len(self) -> int:
        return self.start_pos + len(self.input_ids)


@dataclass(slots=True)
class BatchPlan:
    step_id: int
    seqs: list[SeqPlan]
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst) blocks
    policy_version: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(len(s.input_ids) for s in self.seqs)

    @property
    def decode_only(self) -> bool:
        return all(len(s.input_ids) == 1 for s in self.seqs)

    @property
    def sample_seqs(self) -> list[SeqPlan]:
        return [s for s in self.seqs if s.sample]


@dataclass(slots=True)
class SampleResult:
    """What the runner hands back for one plan: one entry per sampling sequence, in plan order."""

    step_id: int
    token_ids: list[int]
    logprobs: list[float]
