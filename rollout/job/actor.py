"""RolloutActor: a prompt dataset -> rounds of trajectories, with weight hot-swap between rounds.

Each prompt is one request with ``n`` samples, so the group shares its prompt's KV blocks. The actor
drives the engine step by step (not ``generate``) so that progress and per-step metrics are visible
while a round runs, and so a trainer could interleave other work between steps.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from rollout.job.data import Prompt, PromptDataset
from rollout.job.rewards import RewardFn
from rollout.job.seeds import request_seed
from rollout.job.trajectory import Trajectory
from rollout.sampling_params import SamplingParams

FINISH_REASONS = ("stop", "length", "abort")
StepCallback = Callable[[dict[str, float]], None]


@dataclass(slots=True)
class RoundResult:
    round: int
    trajectories: list[Trajectory]
    metrics: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class _StepWindow:
    """Counters for the step-level log: tokens/s over the steps since the last log line."""

    t: float
    generated: int


class RolloutActor:
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
    ) -> None:
        """``seed``: the job seed; each request's seed is derived from it, the round and the group, so a
        resumed run repeats an uninterrupted one. None leaves unseeded requests to the engine."""
        if num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
        if start_round < 0:
            raise ValueError(f"start_round must be >= 0, got {start_round}")
        self.engine, self.dataset, self.params = engine, dataset, sampling_params
        self.num_prompts, self.reward_fn = num_prompts, reward_fn
        self.round = start_round  # the next round to run; prompts [round * num_prompts, ...) come next
        self.log_every_steps, self.on_step, self.progress = log_every_steps, on_step, progress
        self.seed = seed

    def update_weights(
        self, named_tensors: Iterable[tuple[str, Any]] | dict[str, Any], version: int | None = None
    ) -> int:
        """Hot-swap weights between rounds (the engine validates all names and shapes first)."""
        if self.engine.has_unfinished_requests():
            raise RuntimeError("update_weights must be called between rounds; requests are still running")
        return self.engine.update_weights(named_tensors, version=version)

    def run_round(self) -> RoundResult:
        """Generate ``n`` samples for each of the next ``num_prompts`` prompts; score; return trajectories."""
        r = self.round
        first = r * self.num_prompts
        prompts = {first + i: self.dataset.get(first + i) for i in range(self.num_prompts)}
        before, t0 = self.engine.get_stats(), time.perf_counter()
        pending = self._submit(r, prompts)
        finished, kv = self._drive(pending, r, t0, before.num_generated_tokens)
        elapsed = max(time.perf_counter() - t0, 1e-9)
        trajectories = [
            t for g in sorted(finished) for t in self._trajectories(r, g, prompts[g], finished[g])
        ]
        metrics = self._metrics(r, trajectories, before, self.engine.get_stats(), elapsed, kv)
        self.round += 1
        return RoundResult(r, trajectories, metrics)

    # ---- the loop -----------------------------------------------------------------------------------------
    def _submit(self, r: int, prompts: dict[int, Prompt]) -> dict[str, int]:
        """One request per prompt; if the engine refuses one (e.g. too long), withdraw the others."""
        pending: dict[str, int] = {}
        try:
            for g, p in prompts.items():
                pending[self.engine.add_request(list(p.token_ids), self._params(r, g), f"round{r}-group{g}")] = g
        except Exception:
            for request_id in pending:
                self.engine.abort(request_id)
            while self.engine.has_unfinished_requests():  # drain the aborted outputs
                self.engine.step()
            raise
        return pending

    def _params(self, r: int, group: int) -> SamplingParams:
        if self.seed is None:
            return self.params
        return dataclasses.replace(self.params, seed=request_seed(self.seed, r, group))

    def _drive(
        self, pending: dict[str, int], r: int, t0: float, generated0: int
    ) -> tuple[dict[int, Any], list[float]]:
        """Step until every request of the round finished; returns outputs by group and KV usage per step."""
        n = self.params.n
        done: dict[int, Any] = {}
        kv: list[float] = []
        window = _StepWindow(t0, generated0)
        bar = _progress_bar(len(pending) * n, f"round {r}", self.progress)
        steps = 0
        try:
            while pending:
                if not self.engine.has_unfinished_requests():
                    raise RuntimeError(
                        f"engine has no unfinished requests but {len(pending)} of this round are missing"
                    )
                outs = self.engine.step()
                steps += 1
                stats = self.engine.get_stats()
                kv.append(stats.kv_cache_usage)
                for out in outs:
                    group = pending.pop(out.request_id, None)
                    if group is not None:
                        done[group] = out
                        if bar is not None:
                            bar.update(n)
                if steps % self.log_every_steps == 0 or not pending:
                    self._log_step(stats, window, bar)
        finally:
            if bar is not None:
                bar.close()
        return done, kv

    def _log_step(self, stats: Any, window: _StepWindow, bar: Any) -> None:
        now = time.perf_counter()
        tok_s = (stats.num_generated_tokens - window.generated) / max(now - window.t, 1e-9)
        window.t, window.generated = now, stats.num_generated_tokens
        if bar is not None:
            bar.set_postfix(tok_s=f"{tok_s:.0f}", running=stats.num_running_seqs, refresh=False)
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
    def _trajectories(self, r: int, group: int, prompt: Prompt, out: Any) -> list[Trajectory]:
        assert len(out.outputs) == self.params.n, (
            f"request {out.request_id}: {len(out.outputs)} of {self.params.n}"
        )
        result = []
        for c in sorted(out.outputs, key=lambda c: c.index):
            text = c.text if c.text is not None else self._decode(c.token_ids)
            version = c.policy_versions[-1] if c.policy_versions else self.engine.policy_version
            reward = self.reward_fn(text, prompt.answer) if self.reward_fn is not None else None
            result.append(
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
                    policy_version=int(version),
                    reward=reward,
                )
            )
        return result

    def _decode(self, ids: list[int]) -> str:
        tok = getattr(self.engine, "tokenizer", None) or self.dataset.tokenizer
        return tok.decode(ids, skip_special_tokens=True) if tok is not None else ""

    def _metrics(
        self, r: int, trajs: list[Trajectory], before: Any, after: Any, elapsed: float, kv: list[float]
    ) -> dict[str, Any]:
        lengths = [len(t.completion_ids) for t in trajs]
        steps = after.num_steps - before.num_steps
        reasons = Counter(t.finish_reason for t in trajs)
        m: dict[str, Any] = {
            "round": r,
            "num_prompts": len({t.group_id for t in trajs}),
            "num_samples": len(trajs),
            "round_time_s": elapsed,
            "generated_tokens": sum(lengths),
            "prompt_tokens": after.num_prompt_tokens - before.num_prompt_tokens,
            "generated_tokens_per_s": sum(lengths) / elapsed,
            "prompt_tokens_per_s": (after.num_prompt_tokens - before.num_prompt_tokens) / elapsed,
            "num_steps": steps,
            "mean_batch_size": (after.num_scheduled_seqs - before.num_scheduled_seqs) / max(steps, 1),
            "kv_cache_usage_mean": sum(kv) / len(kv) if kv else 0.0,
            "kv_cache_usage_peak": max(kv, default=0.0),
            "num_preemptions": after.num_preemptions - before.num_preemptions,
            "gpu_busy_frac": (None if after.gpu_compute_s is None or before.gpu_compute_s is None
                              else min(1.0, (after.gpu_compute_s - before.gpu_compute_s) / max(elapsed, 1e-9))),
            "completion_len_mean": sum(lengths) / len(lengths) if lengths else 0.0,
            "completion_len_max": max(lengths, default=0),
            "policy_version": after.policy_version,
        }
        for reason in sorted(set(FINISH_REASONS) | set(reasons)):
            m[f"finish_{reason}"] = reasons.get(reason, 0)
        rewards = [t.reward for t in trajs if t.reward is not None]
        if rewards:
            mean = sum(rewards) / len(rewards)
            m["reward_mean"] = mean
            m["reward_std"] = math.sqrt(sum((x - mean) ** 2 for x in rewards) / len(rewards))
        return m


def _progress_bar(total: int, desc: str, enabled: bool) -> Any:
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="sample", dynamic_ncols=True)
