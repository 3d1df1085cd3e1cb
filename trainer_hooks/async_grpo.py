"""TRL's asynchronous GRPO (``trl.experimental.async_grpo``) on our engine instead of a vLLM server.

``AsyncGRPOTrainer`` takes two plug-ins: a rollout worker (``RolloutWorkerProtocol``) that keeps a queue
of scored samples full, and a weight transfer (``WeightTransferProtocol``) that streams the trainer's
parameters to the generator. Here both live in the trainer's process: ``EngineRolloutWorker`` is a
thread that steps the engine (one request per prompt group, ``n = num_generations``, so the group
shares its prompt's KV), and ``EngineWeightTransfer`` calls ``push_weights``, which lands between two
engine steps and recomputes running sequences, so generation never stops for a sync.

The engine's per-token logprobs are each sample's ``old_log_probs``: AsyncGRPOTrainer's clipped ratio is
taken against the generator's own logprobs (TRL's design for vLLM). Both plug-ins put ``rollout/*``
engine metrics on the worker's ``metrics_queue``, which the trainer drains into its logs.

The worker is partial rollouts by construction: groups are handed out as they finish, and a push lands
between two steps while the others keep generating. What it shares with the job's ``rollout.mode=partial``
(``rollout.rl.groups.GroupTracker``): ``max_staleness`` drops groups whose oldest token is more versions behind the
engine's weights, running ones at a push (not worth finishing) and finished ones before they are scored
(counted as ``rollout/dropped_groups_total``; TRL's own ``max_staleness`` drops samples later, when the
trainer takes them); at each push ``rollout/carried_over_groups`` / ``_tokens`` (groups still running and the
tokens they hold); each sample's metrics carry ``rollout/policy_version_min`` / ``_max``, its tokens' oldest
and newest version (TRL's collator averages sample metrics over a micro-batch, its log keeps the extremes).
``trainer_hooks.async_trainer.build_async_grpo_trainer`` wires them up.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from rollout.api import ContinuousBackend, RolloutBackend, require_backend
from rollout.rl.groups import Group, GroupTracker
from rollout.rl.metrics import RoundTrace
from rollout.rl.prompts import encode_prompt
from trainer_hooks.engine_metrics import EngineWindow, policy_lag
from trainer_hooks.trl import sampling_params_from_args
from trainer_hooks.weights import push_weights


class EngineWeightTransfer:
    """``WeightTransferProtocol`` for an in-process engine. Version k is the trainer's k-th sync, which
    is exactly ``AsyncGRPOTrainer.model_version`` once that sync completes. ``recompute_running``: running
    sequences recompute their KV under the new weights (one prefill each) or keep the old KV."""

    def __init__(self, engine: Any, start_version: int = 0, metrics_queue: queue.Queue | None = None,
                 recompute_running: bool = True) -> None:
        self.engine = require_backend(engine, "EngineWeightTransfer", RolloutBackend)
        self.recompute_running = recompute_running
        self.version = start_version
        self.seconds: list[float] = []
        self.metrics_queue = metrics_queue  # the worker's: push times reach the trainer's logs with the rest

    def init_weight_transfer(self) -> None:
        """Nothing to connect: the engine shares the process."""

    def pause(self) -> None:
        """Nothing to pause: the swap lands between two engine steps under the engine's lock."""

    def send_weights(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        t0 = time.perf_counter()
        push_weights(self.engine, iterator, version=self.version + 1, recompute_running=self.recompute_running)
        self.version += 1
        self.seconds.append(time.perf_counter() - t0)
        if self.metrics_queue is not None:
            with contextlib.suppress(queue.Full):
                self.metrics_queue.put_nowait({"rollout/weight_push_s": self.seconds[-1]})

    def resume(self) -> None:
        """Nothing to resume (see ``pause``)."""

    def destroy(self) -> None:
        """Nothing to release."""


class EngineRolloutWorker:
    """``RolloutWorkerProtocol``: a thread that cycles the dataset, generates a group per prompt, scores
    it with TRL-style reward functions and puts one ``RolloutSample`` per completion on
    ``rollout_buffer``. At most ``max_inflight`` completions are generated or queued but not consumed.
    ``max_staleness`` (None: no limit here) drops groups too far behind the weights (see the module doc)."""

    def __init__(self, engine: Any, dataset: Any, reward_funcs: list[Callable[..., list[float]]],
                 tokenizer: Any, args: Any, max_inflight: int | None = None, max_staleness: int | None = None
                 ) -> None:
        self.engine = require_backend(engine, "the async GRPO rollout worker", ContinuousBackend)
        if args.num_generations < 1:
            raise ValueError(f"num_generations must be >= 1, got {args.num_generations}")
        if len(dataset) == 0 or "prompt" not in dataset.column_names:
            raise ValueError(f"the dataset needs rows with a 'prompt' column, got {dataset.column_names}")
        self.tracker = GroupTracker(self.engine, max_staleness)  # a group: its prompt, ids and dataset row (columns)
        self.dataset, self.reward_funcs, self.tokenizer = dataset, list(reward_funcs), tokenizer
        self.n = args.num_generations
        self.params = dataclasses.replace(sampling_params_from_args(args, self._eos_ids(tokenizer)), n=self.n)
        self.chat_template_kwargs = dict(getattr(args, "chat_template_kwargs", None) or {})
        per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps
        self.max_inflight = max_inflight or max(1, getattr(args, "max_staleness", 1)) * max(per_step, self.n)
        self.rollout_buffer: queue.Queue = queue.Queue()
        self.metrics_queue: queue.Queue = queue.Queue(maxsize=4096)
        self.model_version = 0
        self.heartbeat = time.time()
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._next_group = 0
        self._window: EngineWindow | None = None
        self.dropped_groups = 0
        self._seen_version = self.engine.policy_version

    @property
    def running(self) -> bool:
        """Whether the generation thread is alive (between ``start()`` and ``stop()``)."""
        return self._thread is not None

    # ---- protocol -------------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._stop.clear()
        self.heartbeat = time.time()
        self._window = EngineWindow(self.engine)
        self._thread = threading.Thread(target=self._run, name="engine-rollout-worker", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)
            self._thread = None
        self.tracker.withdraw()

    def update_model_version(self, model_version: int) -> None:
        self.model_version = int(model_version)

    def check_health(self, stale_after_s: float) -> None:
        if self.error is not None:
            raise RuntimeError("the engine rollout worker failed; see the chained exception") from self.error
        age = time.time() - self.heartbeat
        if self._thread is not None and age > stale_after_s:
            raise RuntimeError(f"engine rollout worker heartbeat stale: {age:.0f}s > {stale_after_s:.0f}s")

    # ---- the loop -------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._tick()
        except BaseException as e:  # surfaced to the trainer by check_health
            self.error = e

    def _tick(self) -> None:
        """One pass of the loop: top the requests up, react to new weights, step the engine once."""
        self.heartbeat = time.time()
        if self.engine.policy_version != self._seen_version:
            self._new_weights()
        while (len(self.tracker.running) + 1) * self.n + self.rollout_buffer.qsize() <= self.max_inflight:
            self._submit()
        if not self.tracker.running:
            time.sleep(0.01)  # backpressure: the trainer has enough samples waiting
            return
        self.tracker.collect(self.engine.step())
        trace = RoundTrace(0.0)
        for group in self.tracker.take(len(self.tracker.ready), trace):  # the too stale are dropped
            self._finish(group)
        if trace.dropped_groups:
            dropped: dict[str, float] = {}
            self._count_dropped(trace.dropped_groups, dropped)
            with contextlib.suppress(queue.Full):
                self.metrics_queue.put_nowait(dropped)

    def _new_weights(self) -> None:
        """After a push: stop the groups already over ``max_staleness``; count what carries over."""
        self._seen_version = self.engine.policy_version
        trace = RoundTrace(0.0)
        self.tracker.stop_stale(trace)
        self.tracker.carry_over(trace)
        metrics = {"rollout/carried_over_groups": float(trace.carried_over_groups),
                   "rollout/carried_over_tokens": float(trace.carried_over_tokens)}
        if trace.dropped_groups:
            self._count_dropped(trace.dropped_groups, metrics)
        with contextlib.suppress(queue.Full):
            self.metrics_queue.put_nowait(metrics)

    def _count_dropped(self, groups: int, metrics: dict[str, float]) -> None:
        self.dropped_groups += groups
        metrics["rollout/dropped_groups_total"] = float(groups)  # a "total" key: TRL sums it over a log window

    def _submit(self) -> None:
        group = self._next_group
        self._next_group += 1
        row = self.dataset[group % len(self.dataset)]
        _, ids = encode_prompt(self.tokenizer, row["prompt"], **self.chat_template_kwargs)
        self.tracker.admit(Group(group, row["prompt"], ids, row), self.params, f"async-grpo-group{group}")

    def _finish(self, group: Group) -> None:
        from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

        out, row, prompt_ids = group.output, group.columns or {}, list(group.prompt_ids)
        comps = sorted(out.outputs, key=lambda c: c.index)
        texts = [self.tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in comps]
        conversational = not isinstance(row["prompt"], str)
        completions = [[{"role": "assistant", "content": t}] if conversational else t for t in texts]
        rewards, per_func = self._score(row, completions, [list(c.token_ids) for c in comps])
        advantages, std = group_advantages(rewards)
        now = time.time()
        for i, c in enumerate(comps):
            metrics = {"reward": float(rewards[i]), "reward_std": std}
            metrics.update({f"rewards/{name}": float(v[i]) for name, v in per_func.items()})
            if c.policy_versions:  # TRL reduces "min" / "max" keys as extrema over a log window
                metrics.update({"rollout/policy_version_min": float(min(c.policy_versions)),
                                "rollout/policy_version_max": float(max(c.policy_versions))})
            p, k = len(prompt_ids), len(c.token_ids)
            self.rollout_buffer.put(RolloutSample(
                prompt=row["prompt"], completion=completions[i],
                input_ids=np.asarray(prompt_ids + list(c.token_ids), dtype=np.int64),
                completion_mask=np.asarray([0] * p + [1] * k, dtype=np.int64),
                old_log_probs=np.asarray([0.0] * p + list(c.logprobs), dtype=np.float32),
                advantage=float(advantages[i]),
                model_version=min(c.policy_versions) if c.policy_versions else self.engine.policy_version,
                group_id=group.group_id, metrics=metrics, enqueued_at=now,
            ))
        self._put_engine_metrics([len(c.token_ids) for c in comps], [c.policy_versions for c in comps])

    def _put_engine_metrics(self, lengths: list[int], versions: list[list[int]],
                            extra: dict[str, float] | None = None) -> None:
        """A finished group's completion length, policy lag and the engine's counters since the previous one."""
        engine_metrics = {"rollout/completion_len_mean": float(np.mean(lengths)), **(extra or {})}
        engine_metrics.update(policy_lag(self.model_version, versions))
        if self._window is not None:  # engine counters since the previous finished group
            engine_metrics.update(self._window.close())
            engine_metrics.pop("rollout/generation_s")  # a window here is not one generation (groups overlap)
            self._window = EngineWindow(self.engine)
        with contextlib.suppress(queue.Full):
            self.metrics_queue.put_nowait(engine_metrics)

    def _score(self, row: dict[str, Any], completions: list[Any], ids: list[list[int]]
               ) -> tuple[np.ndarray, dict[str, list[float]]]:
        extra = {k: [v] * self.n for k, v in row.items() if k != "prompt"}
        per_func: dict[str, list[float]] = {}
        for fn in self.reward_funcs:
            values = fn(prompts=[row["prompt"]] * self.n, completions=completions, completion_ids=ids, **extra)
            per_func[getattr(fn, "__name__", "reward")] = [math.nan if v is None else float(v) for v in values]
        arr = np.array(list(per_func.values()), dtype=float).reshape(len(per_func), self.n)
        rewards = np.nansum(arr, axis=0)
        rewards[np.all(np.isnan(arr), axis=0)] = np.nan
        return rewards, per_func

    @staticmethod
    def _eos_ids(tokenizer: Any) -> list[int]:
        eos = getattr(tokenizer, "eos_token_id", None)
        return [eos] if isinstance(eos, int) else []


def group_advantages(rewards: np.ndarray) -> tuple[np.ndarray, float]:
    """GRPO's advantages over a group's scored completions (NaN rewards: unscorable, advantage 0, as TRL)."""
    ok = ~np.isnan(rewards)
    advantages = np.zeros_like(rewards)
    std = float(rewards[ok].std()) if ok.any() else math.nan
    if ok.any():
        advantages[ok] = (rewards[ok] - rewards[ok].mean()) / (std + 1e-8)
    return advantages, std
