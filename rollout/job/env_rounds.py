"""Rounds of multi-turn conversations (``rollout.env``): the main job's round driver when an environment is set.

Drain mode: round r takes the prompts at stream positions [r * num_prompts, (r + 1) * num_prompts); partial mode
carries unfinished groups across rounds (``EnvRoundDriver``). Each prompt gets ``sampling.n`` conversations (a
group), each with its own environment instance and its own seed (a hash of the job seed, the round that admitted
the group and the group, plus the sample index), through ``EnvLoop`` on the in-process engine (each conversation's
KV resident between turns) or, in drain mode, on a ``RolloutPool`` (each turn one request, every turn of a
conversation on the same replica, whose prefix cache serves the earlier turns; weights pushed between rounds reach
every replica). A row's completion
holds the model's and the environment's tokens; ``env_mask`` tells them apart, ``logprobs`` are 0.0 at environment
tokens, and ``reward`` is the environment's ``get_reward()`` (or the job's ``rollout.reward`` on the completion's
text when the environment has none).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from rollout.api import ContinuousBackend, RolloutBackend, require_backend
from rollout.envs import EnvLimits, EnvLoop, EnvSpec, Episode
from rollout.job.data import PromptDataset, column_name
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


@dataclass(slots=True, eq=False)
class _Group:
    group_id: int
    round: int  # the round that admitted it: its seeds (a resume keeps them)
    index: int  # the dataset row
    row: dict[str, Any]
    episodes: list[Episode] = field(default_factory=list)
    done: int = 0


class EnvRoundDriver:
    """``drain``: round r runs the groups at stream positions [r * num_prompts, (r + 1) * num_prompts) to their end.
    ``partial``: the engine always holds ``max_inflight_groups`` groups of conversations; a round hands out the
    first ``num_prompts`` groups to finish (all n conversations done) and the others keep going into the next
    round, KV, parked turns and environment calls included, under the weights pushed meanwhile (each token
    carries its version; ``recompute_running`` recomputes carried KV). A group whose oldest token is more than
    ``max_staleness`` versions old is dropped or regenerated (``stale_groups``). ``state()`` names the groups
    not handed out, so a resume regenerates exactly those, with their seeds."""

    def __init__(self, engine: Any, dataset: PromptDataset, sampling_params: SamplingParams, num_prompts: int,
                 spec: EnvSpec, limits: EnvLimits, reward_fn: RewardFn | None = None, start_round: int = 0,
                 seed: int | None = None, mode: str = "drain", max_inflight_groups: int | None = None,
                 max_staleness: int | None = None, stale_groups: str = "drop", recompute_running: bool = True,
                 state: dict[str, Any] | None = None) -> None:
        # drain: any backend the environment loop takes (its door says which); partial carries running
        # conversations across rounds and weight pushes, in the in-process engine only
        self.engine = require_backend(engine, f"the main job with rollout.env and rollout.mode={mode!r}",
                                      ContinuousBackend if mode == "partial" else RolloutBackend)
        if dataset.tokenizer is None:
            raise ValueError("rollout.env needs a tokenizer with a chat template; set model.tokenizer")
        self.dataset, self.params, self.num_prompts = dataset, sampling_params, num_prompts
        self.spec, self.reward_fn, self.seed = spec, reward_fn, seed
        self.round = start_round
        self.partial = mode == "partial"
        self.max_inflight = max_inflight_groups or num_prompts
        self.max_staleness, self.stale_groups, self.recompute_running = max_staleness, stale_groups, recompute_running
        self.loop = EnvLoop(engine, spec, dataset.tokenizer, limits)
        self._groups: dict[int, _Group] = {}  # admitted, not handed out
        self._owner: dict[int, int] = {}  # id(episode) -> group id, while it runs
        self._complete: list[int] = []  # groups whose conversations all ended, in the order they did
        self._next_group = start_round * num_prompts
        self._queue: list[tuple[int, int]] = []  # (group, admitted round) to submit before fresh ones
        if state is not None and self.partial:
            self._next_group = int(state["next_group"])
            admitted = {int(g): int(r) for g, r in state.get("admitted", {}).items()}
            self._queue = [(int(g), admitted.get(int(g), start_round)) for g in sorted(state["inflight_groups"])]

    def state(self) -> dict[str, Any]:
        groups = sorted(self._groups)
        return {"next_group": self._next_group, "inflight_groups": groups,
                "admitted": {str(g): self._groups[g].round for g in groups},
                "policy_version": self.engine.policy_version}

    def update_weights(self, named_tensors: Iterable[tuple[str, Any]] | dict[str, Any],
                       version: int | None = None) -> int:
        return self.engine.update_weights(named_tensors, version=version, recompute_running=self.recompute_running)

    def run_round(self) -> RoundResult:
        r = self.round
        before = self.engine.get_stats()
        t0 = time.perf_counter()
        dropped = 0
        try:
            if not self.partial:
                for i in range(self.num_prompts):
                    self._submit(r * self.num_prompts + i, r)
                self._next_group = (r + 1) * self.num_prompts
                self.loop.drive()
                handed = [self._groups.pop(g) for g in sorted(self._collect())]
                self._complete.clear()
            else:
                handed, dropped = self._partial_round(r)
        except BaseException:
            self._forget_running()
            raise
        t1 = time.perf_counter()
        episodes = [ep for g in handed for ep in g.episodes]
        trajectories = [self._row(r, ep, g.group_id, j, g.index, g.row) for g in handed
                        for j, ep in enumerate(g.episodes)]
        after = self.engine.get_stats()
        self.round += 1
        metrics = self._metrics(r, episodes, trajectories, before, after, t1 - t0)
        metrics.update(carried_over_groups=len(self._groups), dropped_groups=dropped)
        return RoundResult(r, trajectories, metrics)

    def close(self) -> None:
        self.loop.abandon()
        self.loop.close()

    # ---- groups -----------------------------------------------------------------------------------------------
    def _submit(self, g: int, admitted: int) -> None:
        index = g % len(self.dataset)
        if self.dataset.order is not None:
            index = self.dataset.order[index]
        row = dict(self.dataset.rows[index])
        n = self.params.n
        group = _Group(g, admitted, index, row)
        group.episodes = self.loop.add([row] * n, [row[self.dataset.prompt_field]] * n,
                                       [self._params(admitted, g, j) for j in range(n)],
                                       [f"round{admitted}-group{g}-{j}" for j in range(n)])
        self._groups[g] = group
        for ep in group.episodes:
            self._owner[id(ep)] = g
        self._collect()  # a conversation refused at once (its factory raised) is done already

    def _collect(self) -> list[int]:
        """Count the conversations that ended since the last call; returns the complete groups, in order."""
        for ep in self.loop.finished:
            g = self._owner.pop(id(ep), None)
            if g is None:
                continue
            group = self._groups[g]
            group.done += 1
            if group.done == len(group.episodes):
                self._complete.append(g)
        self.loop.finished.clear()
        return self._complete

    def _fill(self, r: int) -> None:
        while len(self._groups) < self.max_inflight:
            if self._queue:
                self._submit(*self._queue.pop(0))
            else:
                self._submit(self._next_group, r)
                self._next_group += 1

    def _partial_round(self, r: int) -> tuple[list[_Group], int]:
        handed: list[_Group] = []
        dropped = 0
        while len(handed) < self.num_prompts:
            self._fill(r)
            need = self.num_prompts - len(handed)
            self.loop.drive(until=lambda need=need: len(self._collect()) >= need)
            for g in self._collect()[:need]:
                group = self._groups.pop(g)
                if self._stale(group):
                    dropped += 1
                    if self.stale_groups == "regenerate":
                        self._queue.append((g, r))
                    continue
                handed.append(group)
            del self._complete[:need]
        return handed, dropped

    def _stale(self, group: _Group) -> bool:
        if self.max_staleness is None:
            return False
        versions = [v for ep in group.episodes for v in ep.policy_versions] or [self.engine.policy_version]
        return self.engine.policy_version - min(versions) > self.max_staleness

    def _forget_running(self) -> None:
        """A round that raised: its conversations are gone (the loop abandoned them); a resume regenerates them."""
        self._owner.clear()
        self._complete.clear()

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
            columns={column_name(k): v for k, v in row.items()},
        )

    def _metrics(self, r: int, episodes: list[Episode], rows: list[Trajectory], before: Any, after: Any,
                 wall: float) -> dict[str, Any]:
        generated = after.num_generated_tokens - before.num_generated_tokens
        given = sum(len(ep.prompt_ids) + ep.env_mask.count(0) for ep in episodes)
        prefill = after.num_prefill_tokens - before.num_prefill_tokens
        rewards = [t.reward for t in rows if t.reward is not None]
        m: dict[str, Any] = {
            "round": r, "num_samples": len(rows), "generated_tokens": generated, "round_time_s": wall,
            "generated_tokens_per_s": generated / max(wall, 1e-9),
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
