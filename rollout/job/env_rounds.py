"""Rounds of multi-turn conversations (``rollout.env``): the main job's round driver when an environment is set.

Round r takes the prompts at stream positions [r * num_prompts, (r + 1) * num_prompts), as drain mode does, and
runs ``sampling.n`` conversations per prompt (a group), each with its own environment instance and its own
seed (a hash of the job seed, the round and the group, plus the sample index), through ``EnvLoop`` on the
in-process engine. A row's completion holds the model's and the environment's tokens; ``env_mask`` tells them
apart, ``logprobs`` are 0.0 at environment tokens, and ``reward`` is the environment's ``get_reward()`` (or the
job's ``rollout.reward`` on the completion's text when the environment has none).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable
from typing import Any

from rollout.api import ContinuousBackend, require_backend
from rollout.envs import EnvLimits, EnvLoop, EnvSpec, Episode
from rollout.job.data import PromptDataset
from rollout.job.rounds import RoundResult
from rollout.job.seeds import SEED_BITS, request_seed
from rollout.job.trajectory import Trajectory
from rollout.rl.rewards import RewardFn
from rollout.sampling_params import SamplingParams

_GOLDEN = 0x9E3779B97F4A7C15


def env_limits(cfg: Any, params: SamplingParams) -> EnvLimits:
    """The loop's limits from the job's ``rollout`` section (``max_turn_tokens`` null: ``sampling.max_tokens``)."""
    return EnvLimits(max_turns=cfg.max_turns, max_turn_tokens=cfg.max_turn_tokens or params.max_tokens,
                     tool_timeout_s=float(cfg.tool_timeout_s), max_tool_result_chars=cfg.max_tool_result_chars)


class EnvRoundDriver:
    def __init__(self, engine: Any, dataset: PromptDataset, sampling_params: SamplingParams, num_prompts: int,
                 spec: EnvSpec, limits: EnvLimits, reward_fn: RewardFn | None = None, start_round: int = 0,
                 seed: int | None = None) -> None:
        self.engine = require_backend(engine, "the main job with rollout.env", ContinuousBackend)
        if dataset.tokenizer is None:
            raise ValueError("rollout.env needs a tokenizer with a chat template; set model.tokenizer")
        self.dataset, self.params, self.num_prompts = dataset, sampling_params, num_prompts
        self.spec, self.reward_fn, self.seed = spec, reward_fn, seed
        self.round = start_round
        self.loop = EnvLoop(engine, spec, dataset.tokenizer, limits)

    def state(self) -> dict[str, Any]:
        return {"next_group": self.round * self.num_prompts, "inflight_groups": [], "admitted": {},
                "policy_version": self.engine.policy_version}

    def update_weights(self, named_tensors: Iterable[tuple[str, Any]] | dict[str, Any],
                       version: int | None = None) -> int:
        return self.engine.update_weights(named_tensors, version=version)

    def run_round(self) -> RoundResult:
        r, n = self.round, self.params.n
        before = self.engine.get_stats()
        t0 = time.perf_counter()
        groups = [r * self.num_prompts + i for i in range(self.num_prompts)]
        rows, prompts, params, where = [], [], [], []
        for g in groups:
            index = g % len(self.dataset)
            if self.dataset.order is not None:
                index = self.dataset.order[index]
            row = dict(self.dataset.rows[index])
            for j in range(n):
                rows.append(row)
                prompts.append(row[self.dataset.prompt_field])
                params.append(self._params(r, g, j))
                where.append((g, j, index, row))
        episodes = self.loop.run(rows, prompts, params, request_prefix=f"round{r}")
        t1 = time.perf_counter()
        trajectories = [self._row(r, ep, *w) for ep, w in zip(episodes, where, strict=True)]
        after = self.engine.get_stats()
        self.round += 1
        return RoundResult(r, trajectories, self._metrics(r, episodes, trajectories, before, after, t1 - t0))

    def close(self) -> None:
        self.loop.close()

    def _params(self, r: int, group: int, j: int) -> SamplingParams:
        p = dataclasses.replace(self.params, n=1)
        if self.seed is None:
            return p
        return dataclasses.replace(p, seed=(request_seed(self.seed, r, group) + _GOLDEN * j) & ((1 << SEED_BITS) - 1))

    def _row(self, r: int, ep: Episode, group: int, j: int, index: int, row: dict[str, Any]) -> Trajectory:
        text = self.dataset.tokenizer.decode(ep.completion_ids, skip_special_tokens=True)
        versions = ep.policy_versions or [int(self.engine.policy_version)]
        reward = ep.reward
        if not self.spec.has_reward and self.reward_fn is not None and ep.error is None:
            answer = row.get(self.dataset.answer_field) if self.dataset.answer_field else None
            reward = self.reward_fn(text, None if answer is None else str(answer))
        return Trajectory(
            round=r, group_id=group, sample_index=j, prompt_index=index, prompt=ep.prompt, completion=text,
            prompt_ids=list(ep.prompt_ids), completion_ids=list(ep.completion_ids), logprobs=list(ep.logprobs),
            finish_reason=ep.finish_reason, policy_version=versions[-1], policy_versions=list(ep.policy_versions),
            min_policy_version=min(versions), max_policy_version=max(versions), reward=reward,
            env_mask=list(ep.env_mask), num_turns=ep.num_turns, tool_calls=ep.tool_calls,
            tool_failures=ep.tool_failures, env_error=ep.error,
        )

    def _metrics(self, r: int, episodes: list[Episode], rows: list[Trajectory], before: Any, after: Any,
                 wall: float) -> dict[str, Any]:
        generated = after.num_generated_tokens - before.num_generated_tokens
        given = sum(len(ep.prompt_ids) + ep.env_mask.count(0) for ep in episodes)
        prefill = after.num_prefill_tokens - before.num_prefill_tokens
        rewards = [t.reward for t in rows if t.reward is not None]
        m: dict[str, Any] = {
            "round": r, "num_samples": len(rows), "generated_tokens": generated, "round_time_s": wall,
            "generated_tokens_per_s": generated / max(wall, 1e-9), "carried_over_groups": 0, "dropped_groups": 0,
            "turns_mean": sum(ep.num_turns for ep in episodes) / max(len(episodes), 1),
            "tool_calls": sum(ep.tool_calls for ep in episodes),
            "tool_failures": sum(ep.tool_failures for ep in episodes),
            "env_errors": sum(ep.error is not None for ep in episodes),
            "env_tokens": sum(ep.env_mask.count(0) for ep in episodes),
            "prefill_tokens": prefill,
            "prefill_over_given": prefill / given if given else None,  # 1.0 = no conversation was re-prefilled
            "policy_version": self.engine.policy_version,
        }
        for reason in ("stop", "length", "abort", "env_error"):
            m[f"finish_{reason}"] = sum(t.finish_reason == reason for t in rows)
        if rewards:
            m["reward_mean"] = sum(rewards) / len(rewards)
        return m
