"""RoundDriver: a prompt dataset -> rounds of trajectories, with weight hot-swap between rounds.

Each prompt is one request with ``n`` samples (a group), so the group shares its prompt's KV blocks.
The driver steps the backend one step at a time (not ``generate``) so that progress and per-step metrics are
visible while a round runs.

Two modes:
- ``drain`` (default): round r submits the groups at stream positions [r * num_prompts, (r + 1) *
  num_prompts) and waits for all of them; the batch shrinks to the longest samples at the round's end.
- ``partial``: the engine always holds ``max_inflight_groups`` groups; a round ends as soon as
  ``num_prompts`` groups have finished, and the groups still running keep their KV into the next round,
  continuing under whatever weights arrive between rounds (each token records its ``policy_version``).
  A group is handed out only when all ``n`` samples have finished; one whose oldest token is more than
  ``max_staleness`` versions behind the current weights is dropped or regenerated. ``state()`` names
  the groups not yet handed out and the round that admitted each, so a resume regenerates exactly those,
  with the seeds they had: every group is written once, and as the uninterrupted run wrote it.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from rollout.api import ContinuousBackend, SteppedBackend, require_backend
from rollout.job.data import PromptDataset
from rollout.job.round_metrics import round_metrics
from rollout.job.seeds import request_seed
from rollout.job.trajectory import Trajectory, group_trajectories
from rollout.rl.groups import Group, GroupTracker
from rollout.rl.metrics import PoolMeter, RoundTrace
from rollout.rl.rewards import RewardFn
from rollout.sampling_params import SamplingParams

MODES = ("drain", "partial")
StepCallback = Callable[[dict[str, float]], None]


@dataclass(slots=True)
class RoundResult:
    round: int
    trajectories: list[Trajectory]
    metrics: dict[str, Any] = field(default_factory=dict)
    staleness: list[int] = field(default_factory=list)  # per group handed out (for a histogram)


class RoundDriver:
    def __init__(
        self,
        engine: Any,
        dataset: PromptDataset,
        sampling_params: SamplingParams,
        num_prompts: int,
        reward_fn: RewardFn | None = None,
        start_round: int = 0,
        log_every_steps: int = 16,
        on_step: StepCallback | None = None,
        progress: bool = False,
        seed: int | None = None,
        mode: str = "drain",
        max_staleness: int | None = None,
        stale_groups: str = "drop",
        recompute_running: bool = True,
        max_inflight_groups: int | None = None,
        state: dict[str, Any] | None = None,
        copy_bandwidth: float | None = None,
        num_rounds: int | None = None,
    ) -> None:
        """``seed``: the job seed; each request's seed derives from it, the round and the group, so a
        resumed run repeats an uninterrupted one (None leaves unseeded requests to the engine).
        ``state``: a previous run's ``state()`` after its last complete round (partial mode's resume).
        ``copy_bandwidth``: the device's measured bytes/s (``rollout.job.bandwidth``), for the floor ratio.
        ``num_rounds``: the job's rounds, for the progress bar's "round N/M"."""
        if num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
        if start_round < 0:
            raise ValueError(f"start_round must be >= 0, got {start_round}")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        need = ContinuousBackend if mode == "partial" else SteppedBackend
        self.engine = require_backend(engine, f"the main job (rollout.mode={mode})", need)
        self.dataset, self.params = dataset, sampling_params
        self.num_prompts, self.reward_fn = num_prompts, reward_fn
        self.round = start_round  # the next round to run
        self.log_every_steps, self.on_step, self.progress = log_every_steps, on_step, progress
        self.seed, self.mode, self.max_staleness, self.stale_groups = seed, mode, max_staleness, stale_groups
        self.recompute_running = recompute_running
        self.max_inflight_groups = max_inflight_groups or num_prompts
        # groups by stream position; drain mode never discards (no staleness limit)
        self.groups = GroupTracker(engine, max_staleness if mode == "partial" else None, stale_groups)
        self._next_group = start_round * num_prompts  # the next fresh stream position
        self._admitted: dict[int, int] = {}  # resumed group -> the round that admitted it before the stop
        if state is not None and mode == "partial":
            self._next_group = int(state["next_group"])
            self._admitted = {int(g): int(r) for g, r in state.get("admitted", {}).items()}
            for g in sorted(int(g) for g in state["inflight_groups"]):
                self.groups.queue(Group(g))  # submitted (again) before fresh ones
        self._in_round = False
        self.copy_bandwidth, self.num_rounds = copy_bandwidth, num_rounds
        self._awaiting_first: dict[str, float] = {}  # request id -> submission time, in submission order
        self._pool_meter = PoolMeter()

    @property
    def partial(self) -> bool:
        return self.mode == "partial"

    @property
    def next_group(self) -> int:
        """The next fresh position in the prompt stream (groups before it were submitted at least once)."""
        return self._next_group

    def in_flight(self) -> dict[str, int]:
        """Request id -> group id of every group running in the engine (carried over in partial mode)."""
        return {rid: g.group_id for rid, g in self.groups.running.items()}

    def state(self) -> dict[str, Any]:
        """What a resume needs: the next fresh position, every group started but not handed out and the round
        that admitted each still running or finished (one waiting to be regenerated is admitted anew), and the
        policy version reached (a resume never goes below it)."""
        admitted = {g.group_id: g.round for g in [*self.groups.running.values(), *self.groups.ready]}
        admitted.update((g.group_id, self._admitted[g.group_id]) for g in self.groups.regenerate
                        if g.group_id in self._admitted)
        return {"next_group": self._next_group, "inflight_groups": sorted(self.groups.groups),
                "admitted": {str(g): admitted[g] for g in sorted(admitted)},
                "policy_version": self.engine.policy_version}

    def update_weights(
        self, named_tensors: Iterable[tuple[str, Any]] | dict[str, Any], version: int | None = None
    ) -> int:
        """Hot-swap weights between rounds (the engine validates all names and shapes first). In partial
        mode the groups carried over continue under the new weights (``recompute_running``: recompute their
        KV with them, at the cost of one prefill of each running sequence; else keep the old KV)."""
        if self._in_round or (not self.partial and self.engine.has_unfinished_requests()):
            raise RuntimeError("update_weights must be called between rounds; requests are still running")
        if not self.partial:
            return self.engine.update_weights(named_tensors, version=version)
        return self.engine.update_weights(named_tensors, version=version, recompute_running=self.recompute_running)

    def run_round(self) -> RoundResult:
        """Hand out ``num_prompts`` finished groups (drain: exactly this round's), scored, with metrics."""
        r = self.round
        before = self.engine.get_stats()
        trace = RoundTrace(time.perf_counter(), first_tokens=before.num_first_tokens)
        self._in_round = True
        try:
            if self.partial:
                for rid in self.groups.stop_stale(trace):
                    self._awaiting_first.pop(rid, None)
                self._fill(r)
            else:
                self._submit(r, [r * self.num_prompts + i for i in range(self.num_prompts)])
                self._next_group = (r + 1) * self.num_prompts
            handed = self._drive(r, trace, before.num_generated_tokens)
        finally:
            self._in_round = False
        t1 = time.perf_counter()
        trajectories = [t for g in handed for t in self._rows(r, g)]
        self.groups.carry_over(trace)
        after = self.engine.get_stats()
        metrics = round_metrics(r, trajectories, before, after, trace, t1, self.partial, self.copy_bandwidth)
        if after.pool is not None:
            metrics.update(self._pool_meter.metrics(after.pool, t1 - trace.t0))
        self.round += 1
        return RoundResult(r, trajectories, metrics, list(trace.staleness))

    # ---- submitting ---------------------------------------------------------------------------------------
    def _submit(self, r: int, positions: list[int]) -> None:
        """One request per group; if the engine refuses one (e.g. too long), withdraw every running group."""
        try:
            for g in positions:
                prompt = self.dataset.get(g)
                admitted = self._admitted.pop(g, r)  # a resumed group keeps the round (and seed) it had
                rid = f"round{admitted}-group{g}"
                self.groups.admit(Group(g, prompt, prompt.token_ids, round=admitted), self._params(admitted, g), rid)
                self._awaiting_first[rid] = time.perf_counter()
        except Exception:
            self._withdraw_all()
            raise

    def _fill(self, r: int) -> None:
        """Partial mode: top the engine up to ``max_inflight_groups`` groups, regenerations first."""
        wanted = self.max_inflight_groups - len(self.groups.running)
        positions = []
        while len(positions) < wanted:
            if self.groups.regenerate:
                positions.append(self.groups.regenerate.pop(0).group_id)
            else:
                positions.append(self._next_group)
                self._next_group += 1
        if positions:
            self._submit(r, positions)

    def _params(self, r: int, group: int) -> SamplingParams:
        if self.seed is None:
            return self.params
        return dataclasses.replace(self.params, seed=request_seed(self.seed, r, group))

    def _withdraw_all(self) -> None:
        self.groups.withdraw()
        self._awaiting_first.clear()

    # ---- the loop -------------------------------------------------------------------------------------------
    def _drive(self, r: int, trace: RoundTrace, generated0: int) -> list[Group]:
        """Step until ``num_prompts`` groups can be handed out; returns them by group id."""
        handed = self.groups.take(self.num_prompts, trace)
        of = f"/{self.num_rounds}" if self.num_rounds is not None else ""
        bar = _progress_bar(self.num_prompts * self.params.n * self.params.max_tokens, f"round {r + 1}{of}",
                            self.progress)
        window = [trace.t0, generated0]
        counted = generated0  # tokens the bar has shown: it counts generated tokens, so it moves every step
        steps, scheduled = 0, self.engine.get_stats().num_scheduled_seqs
        try:
            while len(handed) < self.num_prompts:
                if not self.engine.has_unfinished_requests():
                    raise RuntimeError(
                        f"engine has no unfinished requests but {self.num_prompts - len(handed)} groups of "
                        "this round are missing"
                    )
                outs = self.engine.step()
                steps += 1
                stats = self.engine.get_stats()
                now = time.perf_counter()
                trace.steps.append((now, stats.num_scheduled_seqs - scheduled))
                scheduled = stats.num_scheduled_seqs
                trace.kv.append(stats.kv_cache_usage)
                self._observe_first_tokens(outs, stats, trace, now)
                self.groups.collect(outs)
                taken = self.groups.take(self.num_prompts - len(handed), trace)
                handed += taken
                if bar is not None:
                    bar.update(stats.num_generated_tokens - counted)
                    counted = stats.num_generated_tokens
                    bar.set_postfix_str(f"{len(handed)}/{self.num_prompts} groups, running "
                                        f"{stats.num_running_seqs}, KV {100 * stats.kv_cache_usage:.0f}%",
                                        refresh=False)
                if self.partial:
                    self._fill(r)
                if steps % self.log_every_steps == 0 or len(handed) >= self.num_prompts:
                    self._log_step(stats, window)
        finally:
            if bar is not None:
                if len(handed) >= self.num_prompts and bar.n < bar.total:  # samples ended before max_tokens
                    bar.total = bar.n
                    bar.refresh()
                bar.close()
        return sorted(handed, key=lambda g: g.group_id)

    def _observe_first_tokens(self, outs: list[Any], stats: Any, trace: RoundTrace, now: float) -> None:
        """Time to first token. The engine counts the requests whose first token landed; it admits in
        arrival order, so beyond the ones that just finished those are the oldest still waiting (exact
        when a round's requests are submitted together, as in drain mode). On a pool the step returns
        only when a group finishes, so there it is the time until seen."""
        new = stats.num_first_tokens - trace.first_tokens
        trace.first_tokens = stats.num_first_tokens
        for out in outs:
            t = self._awaiting_first.pop(out.request_id, None)
            if t is not None:
                trace.ttft.append(now - t)
                new -= 1
        for rid in list(itertools.islice(self._awaiting_first, max(new, 0))):
            trace.ttft.append(now - self._awaiting_first.pop(rid))

    def _log_step(self, stats: Any, window: list[float]) -> None:
        now = time.perf_counter()
        tok_s = (stats.num_generated_tokens - window[1]) / max(now - window[0], 1e-9)
        window[:] = [now, stats.num_generated_tokens]
        if self.on_step is not None:
            self.on_step(
                {
                    "engine_step": stats.num_steps,
                    "step/running_seqs": stats.num_running_seqs,
                    "step/waiting_seqs": stats.num_waiting_seqs,
                    "step/tokens_per_s": tok_s,
                    "step/kv_cache_usage": stats.kv_cache_usage,
                }
            )

    # ---- results ------------------------------------------------------------------------------------------
    def _rows(self, r: int, group: Group) -> list[Trajectory]:
        return group_trajectories(
            r, group.group_id, group.prompt, group.output, self.params.n, self._decode, self.reward_fn,
            self.engine.policy_version,
        )

    def _decode(self, ids: list[int]) -> str:
        tok = self.dataset.tokenizer
        return tok.decode(ids, skip_special_tokens=True) if tok is not None else ""


def _progress_bar(total: int, desc: str, enabled: bool) -> Any:
    if not enabled:
        return None
    from tqdm.auto import tqdm

    # generated tokens (tqdm shows their rate as tok/s); the total is the round's most (every sample to max_tokens)
    return tqdm(total=total, desc=desc, unit="tok", unit_scale=True, dynamic_ncols=True)
