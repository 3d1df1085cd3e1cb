"""One row of the output: a sample of a group, with its tokens, logprobs and the weights that made them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Trajectory:
    round: int  # the round that handed it out
    group_id: int  # the prompt's position in the prompt stream: unique across rounds, shared by its n samples
    sample_index: int  # 0 .. n-1 within the group
    prompt_index: int  # the dataset row
    prompt: str
    completion: str
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]  # one per completion token, as the engine's logprobs_mode defines them
    finish_reason: str
    policy_version: int  # the weight version that produced the last token
    reward: float | None = None
