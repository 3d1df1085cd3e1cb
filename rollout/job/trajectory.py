"""One row of the output: a sample of a group, with its tokens, logprobs and the weights that made them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


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
    policy_versions: list[int]  # the weight version that produced each token (partial mode: may change)
    min_policy_version: int  # the oldest and newest of them (the current version for an empty completion)
    max_policy_version: int
    reward: float | None = None
    stop_reason: str | None = None  # the stop string, or the stop token id as text; None for EOS or a length stop
    columns: dict[str, Any] = field(default_factory=dict)  # the dataset row's own columns (``PromptDataset``)
    # multi-turn rows (rollout.env): completion_ids hold model and environment tokens, logprobs 0.0 at the latter
    env_mask: list[int] | None = None  # 1 model token, 0 environment token (TRL's)
    num_turns: int = 1
    tool_calls: int = 0
    tool_failures: int = 0
    env_error: str | None = None  # why a finish_reason="env_error" row ended (reset/step/get_reward raised)


def group_trajectories(
    r: int, group: int, prompt: Any, out: Any, n: int, decode: Callable[[list[int]], str], reward_fn: Any,
    current_version: int,
) -> list[Trajectory]:
    """The ``n`` rows of one finished group, by sample index."""
    assert len(out.outputs) == n, f"request {out.request_id}: {len(out.outputs)} of {n}"
    rows = []
    for c in sorted(out.outputs, key=lambda c: c.index):
        text = c.text if c.text is not None else decode(c.token_ids)
        versions = [int(v) for v in c.policy_versions] or [int(current_version)]
        rows.append(
            Trajectory(
                round=r,
                group_id=group,
                sample_index=c.index,
                prompt_index=prompt.index,
                prompt=prompt.text,
                completion=text,
                prompt_ids=list(out.prompt_token_ids),
                completion_ids=list(c.token_ids),
                logprobs=list(c.logprobs),
                finish_reason=c.finish_reason or "abort",
                policy_version=versions[-1],
                policy_versions=list(c.policy_versions),
                min_policy_version=min(versions),
                max_policy_version=max(versions),
                reward=reward_fn(text, prompt.answer) if reward_fn is not None else None,
                stop_reason=None if c.stop_reason is None else str(c.stop_reason),
                columns=dict(getattr(prompt, "columns", ())),
            )
        )
    return rows
