"""Partial rollouts for TRL's GRPOTrainer (``TRLRollout(engine, mode="partial")``): a call returns complete
groups as soon as enough have finished; the others keep generating, KV included, and a later call hands them
out under whatever weights were pushed in between (each token's ``policy_versions`` entry says which).

TRL's contract shapes the design (trl 1.16, ``GRPOTrainer._generate`` / ``_calculate_rewards``): the
rollout_func returns exactly one row per prompt it was given, read as groups of ``num_generations``; the rows'
``prompt_ids`` / ``completion_ids`` / ``logprobs`` are what the trainer trains on, but every reward function is
called with TRL's own ``prompts`` list and the dataset columns (``answer``, ...) of TRL's own batch, row by row.
Extra keys of the returned dict are merged into those columns. A carried-over group answers an earlier call's
prompt, so:

- each call admits the groups of the prompts TRL passed (generated now, handed out now or later) and returns
  as many complete groups, oldest first, each row with its own ``prompt_ids`` and ``rollout_group_id``;
- at a call's start the engine holds at least ``max_inflight_groups`` groups (default: twice the call's). The
  ones beyond TRL's are drawn from the trainer's train dataset (``prompt_dataset``; a seeded order), at the
  first call and to replace groups dropped as stale: without a surplus nothing could be carried over (a call
  that must return every group it admitted waits for its longest one). These are prompts TRL's sampler did
  not pick; over a run each call still trains on exactly its batch size of groups;
- ``wrap_reward`` makes a reward function see each row's own prompt and dataset columns (the columns of TRL's
  prompts are recorded when a reward function first sees them, in the call that admitted them).
  ``EngineGRPOTrainer`` wraps its reward functions itself; a plain GRPOTrainer needs
  ``reward_funcs=rollout.wrap_rewards([...])``, checked on every call. Reward models (``nn.Module``) cannot be
  wrapped (TRL feeds them its own prompt texts) and are refused, as are tools and environments.

The groups are kept as the job keeps them (``rollout.rl.groups.GroupTracker``), staleness included: versions
between a group's oldest token and the weights at hand-out. After a push, running groups over ``max_staleness``
are stopped; a finished one over it is not handed out; either is dropped (counted) or regenerated from its
prompt (``stale_groups``).

Limits: the engine steps only inside a call (nothing generates while the trainer trains); TRL's completions
table (``log_completions``) pairs a carried-over completion with TRL's prompt of that row; groups in flight
when training stops are never handed out (``close()`` aborts them); eval calls generate their own prompts to
completion; one process (no distributed trainer).
"""

from __future__ import annotations

import functools
import inspect
import random
import time
from collections.abc import Callable
from typing import Any

from rollout.api import ContinuousBackend, require_backend
from rollout.rl.groups import Group, GroupTracker
from rollout.rl.metrics import RoundTrace

GROUP_KEY = "rollout_group_id"
ROW_KEYS = ("policy_version", "policy_versions", GROUP_KEY)  # what the rows add to TRL's columns
NOT_COLUMNS = (*ROW_KEYS, "completion_ids", "trainer_state", "log_extra", "log_metric", "environments")
Encode = Callable[[list[Any]], list[list[int]]]


class PartialRollouts:
    """The groups a ``TRLRollout`` in partial mode keeps across calls, and the reward-side bookkeeping."""

    def __init__(self, engine: Any, max_inflight_groups: int | None = None, max_staleness: int | None = None,
                 stale_groups: str = "drop", prompt_dataset: Any = None) -> None:
        if max_inflight_groups is not None and (isinstance(max_inflight_groups, bool)
                                                or not isinstance(max_inflight_groups, int) or max_inflight_groups < 1):
            raise ValueError(f"max_inflight_groups={max_inflight_groups!r} is invalid: must be an int >= 1 or None")
        self.engine = require_backend(engine, "TRLRollout(mode='partial')", ContinuousBackend)
        # a group's prompt: as TRL passed it, or the dataset row's "prompt"; its columns: the row's other dataset
        # columns (TRL's: None until a reward function sees them)
        self.tracker = GroupTracker(engine, max_staleness, stale_groups)
        self.max_inflight_groups, self.prompt_dataset = max_inflight_groups, prompt_dataset
        self.incoming: list[int] = []  # the group of each row TRL passed to the latest call
        self.handed: dict[int, Group] = {}  # the latest call's groups (their rewards are computed after it)
        self._next_id = 0
        self._requests = 0
        self._order: list[int] = []
        self._epoch = 0

    # ---- one call -----------------------------------------------------------------------------------------
    @property
    def groups(self) -> dict[int, Group]:
        """Admitted and not yet forgotten: in flight, or handed out by the latest call."""
        return {**self.handed, **self.tracker.groups}

    def generate(self, prompts: list[Any], prompt_ids: list[list[int]], params: Any, seed: int,
                 train_dataset: Any, encode: Encode) -> tuple[list[Group], RoundTrace]:
        """Admit TRL's groups (runs of ``params.n`` identical prompts), top the engine up, and step until as
        many complete groups as TRL passed can be handed out; returns them oldest first, with the call's trace."""
        n = params.n
        if len(prompts) % n or any(prompt_ids[i] != prompt_ids[i - i % n] for i in range(len(prompt_ids))):
            raise ValueError(f"mode='partial' needs the prompts in runs of num_generations={n} identical ones "
                             f"(GRPOTrainer's order); got {len(prompts)} prompts not in such runs")
        self.handed = {}
        trace = RoundTrace(time.perf_counter())
        self.tracker.stop_stale(trace)
        self._regenerate(params)
        incoming = [self._admit(prompts[i], prompt_ids[i], params) for i in range(0, len(prompts), n)]
        self.incoming = [g.group_id for g in incoming for _ in range(n)]
        target = self.max_inflight_groups or 2 * len(incoming)
        while len(self.tracker.groups) < target:
            row = self._lookahead_row(seed, train_dataset)
            prompt = row.pop("prompt")
            self._admit(prompt, encode([prompt])[0], params, columns=row)
        handed = self._drive(len(incoming), params, trace)
        self.tracker.carry_over(trace)
        self.handed = {g.group_id: g for g in handed}
        return handed, trace

    def close(self) -> None:
        """Abort the groups still in flight (they are never handed out)."""
        self.tracker.withdraw()
        self.tracker.ready.clear()

    def _admit(self, prompt: Any, prompt_ids: list[int], params: Any, columns: dict[str, Any] | None = None,
               group: Group | None = None) -> Group:
        if group is None:
            group = Group(self._next_id, prompt, list(prompt_ids), columns)
        self.tracker.admit(group, params, f"trl-group{group.group_id}-{self._requests}")  # a refused prompt raises
        self._requests += 1
        if group.group_id == self._next_id:
            self._next_id += 1
        return group

    def _regenerate(self, params: Any) -> None:
        """Admit again, from their prompts, the groups discarded as stale (``stale_groups=regenerate``)."""
        while self.tracker.regenerate:
            self._admit(None, [], params, group=self.tracker.regenerate.pop(0))

    def _drive(self, wanted: int, params: Any, trace: RoundTrace) -> list[Group]:
        handed = self._take(wanted, params, trace)
        scheduled = self.engine.get_stats().num_scheduled_seqs
        while len(handed) < wanted:
            if not self.engine.has_unfinished_requests():
                raise RuntimeError(f"the engine has no unfinished requests but {wanted - len(handed)} groups are "
                                   "missing")
            outs = self.engine.step()
            stats = self.engine.get_stats()
            trace.steps.append((time.perf_counter(), stats.num_scheduled_seqs - scheduled))
            scheduled = stats.num_scheduled_seqs
            self.tracker.collect(outs)
            handed += self._take(wanted - len(handed), params, trace)
        return handed

    def _take(self, wanted: int, params: Any, trace: RoundTrace) -> list[Group]:
        handed = self.tracker.take(wanted, trace)
        self._regenerate(params)
        return handed

    def _lookahead_row(self, seed: int, train_dataset: Any) -> dict[str, Any]:
        """The next row of the prompt dataset in a seeded order (reshuffled each pass)."""
        ds = self.prompt_dataset if self.prompt_dataset is not None else train_dataset
        if ds is None or not hasattr(ds, "__len__") or not hasattr(ds, "__getitem__") or len(ds) == 0:
            raise ValueError("mode='partial' keeps more groups in flight than TRL passes and draws them from a "
                             "map-style dataset with a 'prompt' column: pass prompt_dataset=... (the trainer's "
                             f"train_dataset is {type(ds).__name__})")
        if not self._order:
            self._order = list(range(len(ds)))
            random.Random(seed * 1_000_003 + self._epoch).shuffle(self._order)
            self._epoch += 1
        row = dict(ds[self._order.pop()])
        if "prompt" not in row:
            raise ValueError(f"the prompt dataset's rows need a 'prompt' column, got {sorted(row)}")
        return row

    # ---- rewards ------------------------------------------------------------------------------------------
    def wrap_reward(self, fn: Any) -> Callable[..., Any]:
        """``fn`` called with each row's own prompt and dataset columns instead of TRL's for that position."""
        if getattr(fn, "_partial_rollouts", None) is self:
            return fn
        if isinstance(fn, str) or not callable(fn) or _is_module(fn):
            raise TypeError(f"mode='partial' can only wrap reward functions (callables), got {type(fn).__name__}: "
                            "TRL scores a reward model on its own prompt texts, which may belong to another group")
        if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__):
            async def wrapped(prompts: list[Any], completions: list[Any], **kw: Any) -> Any:
                prompts, kw = self.reward_inputs(prompts, kw)
                return await fn(prompts=prompts, completions=completions, **kw)
        else:
            def wrapped(prompts: list[Any], completions: list[Any], **kw: Any) -> Any:
                prompts, kw = self.reward_inputs(prompts, kw)
                return fn(prompts=prompts, completions=completions, **kw)
        functools.update_wrapper(wrapped, fn, updated=())
        wrapped.__name__ = _callable_name(fn)
        wrapped._partial_rollouts = self  # type: ignore[attr-defined]
        return wrapped

    def reward_inputs(self, prompts: list[Any], kw: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
        """TRL's reward arguments rewritten row by row for the groups actually returned."""
        gids = kw.get(GROUP_KEY)
        if gids is None:  # rows of a drain call (eval): TRL's prompts are theirs
            return prompts, kw
        if not (len(gids) == len(prompts) == len(self.incoming)):
            raise RuntimeError(f"a reward function got {len(prompts)} rows, {len(gids)} group ids, but the latest "
                               f"partial call took {len(self.incoming)} prompts")
        columns = [k for k, v in kw.items() if k not in NOT_COLUMNS and isinstance(v, list) and len(v) == len(prompts)]
        groups = self.groups
        for i, g in enumerate(self.incoming):
            group = groups.get(g)
            if group is not None and group.columns is None:
                group.columns = {k: kw[k][i] for k in columns}
        rows = [groups[int(g)] for g in gids]
        out = dict(kw)
        for k in columns:
            out[k] = [(r.columns or {}).get(k) for r in rows]
        return [r.prompt for r in rows], out


def _is_module(fn: Any) -> bool:
    import torch

    return isinstance(fn, torch.nn.Module)


def _callable_name(fn: Any) -> str:
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "__name__", type(fn).__name__)
