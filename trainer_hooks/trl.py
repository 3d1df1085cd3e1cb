"""TRL's ``GRPOTrainer(rollout_func=...)`` backed by our engine, with weight sync by training step.

TRL hands the rollout function each prompt repeated ``num_generations`` times in a row. Each run of
identical prompts becomes one request with ``n`` = the run's length, so the group shares its prompt's KV
blocks, and one row comes back per input prompt. Logprobs are the engine's ``policy`` mode: log
softmax(logits / T) over the full vocabulary, the number GRPO recomputes.

``mode="partial"`` (``trainer_hooks.trl_partial``) returns complete groups as soon as enough have finished
and carries the rest, KV included, into later calls; ``drain`` (the default) waits for every group.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator, Sequence
from typing import Any

from rollout.api import require_backend
from rollout.rl.prompts import encode_prompt
from rollout.rl.rewards import completion_text, digit_fraction, trl_reward  # noqa: F401  (re-exported)
from rollout.sampling_params import SamplingParams
from trainer_hooks.engine_metrics import (
    EngineWindow,
    add_to_wandb_config,
    partial_rollout_metrics,
    policy_lag,
    reports_to_wandb,
)
from trainer_hooks.trl_partial import GROUP_KEY, PartialRollouts
from trainer_hooks.weights import HFWeights, push_weights

MODES = ("drain", "partial")

# SamplingParams fields that `generation_kwargs` may set (vLLM's names).
GENERATION_KWARGS = tuple(
    f.name for f in dataclasses.fields(SamplingParams) if f.init and f.name != "n"
)


class TRLRollout:
    """A ``rollout_func`` for ``GRPOTrainer``: ``TRLRollout(backend)(prompts, trainer) -> dict``.

    Before generating it pushes the trainer's weights to the engine when ``trainer.state.global_step``
    moved since the last push (and on the first call), as version ``global_step``. ``last_outputs``
    keeps the engine's ``RequestOutput``s of the latest call (for checks and logging).

    Each call reports ``rollout/*`` engine metrics (see ``trainer_hooks.engine_metrics``) through the
    trainer's ``_log_metric`` (the sink GRPOTrainer hands reward functions as ``log_metric``), so they land
    in the trainer's own W&B run; the engine's resolved config joins that run's config on the first call.
    ``sleep_level`` 1 or 2 co-locates the engine with the trainer: its KV cache (level 2: also its weights)
    is released after every generation and restored before the next (a ``RolloutPool``: its ``sleep()``
    replicas, the co-located one in the scripts; pushes reach the sleeping ones). ``run_config`` is added to the W&B
    run's config next to the engine's.

    ``mode="partial"``: a training call for P prompts returns P rows of complete groups, the oldest finished
    first, possibly admitted by earlier calls; the others keep generating into later calls (see
    ``trainer_hooks.trl_partial`` for how this fits TRL's reward computation: ``wrap_rewards``). Its knobs are
    the main job's: ``max_inflight_groups`` (groups in the engine at a call's start; default twice the call's),
    ``max_staleness`` / ``stale_groups`` (``drop`` | ``regenerate``), ``prompt_dataset`` (where the groups
    beyond TRL's come from; default the trainer's train_dataset). ``recompute_running`` goes with each push:
    carried-over sequences recompute their KV under the new weights (one prefill each) or keep the old KV.
    Rows then also carry ``policy_versions`` (per token) and ``rollout_group_id``; metrics add
    ``rollout/staleness_*``, ``dropped_groups``, ``regenerated_groups``, ``carried_over_groups`` / ``_tokens``
    and ``tail_batch_size``.
    """

    def __init__(self, engine: Any, sync_weights: bool = True, sleep_level: int = 0,
                 run_config: dict[str, Any] | None = None, mode: str = "drain",
                 max_inflight_groups: int | None = None, max_staleness: int | None = None,
                 stale_groups: str = "drop", recompute_running: bool = True, prompt_dataset: Any = None,
                 tool_timeout_s: float = 60.0, max_turn_tokens: int | None = None) -> None:
        if sleep_level not in (0, 1, 2):
            raise ValueError(f"sleep_level={sleep_level!r} is invalid: must be 0 (never sleep), 1 (free the KV "
                             "cache between generations) or 2 (also move the engine's weights to the CPU)")
        if mode not in MODES:
            raise ValueError(f"mode={mode!r} is invalid: must be one of {list(MODES)}")
        self.engine = require_backend(engine, "TRLRollout")
        self.sync_weights = sync_weights
        self.sleep_level = sleep_level
        self.mode, self.recompute_running = mode, bool(recompute_running)
        self.partial: PartialRollouts | None = None
        if mode == "partial":
            if sleep_level:
                raise ValueError(f"sleep_level={sleep_level} is invalid with mode='partial': must be 0 (carried-over "
                                 "groups keep their KV between calls)")
            self.partial = PartialRollouts(self.engine, max_inflight_groups, max_staleness, stale_groups,
                                           prompt_dataset)
        else:
            given = {"max_inflight_groups": max_inflight_groups, "max_staleness": max_staleness,
                     "prompt_dataset": prompt_dataset, "stale_groups": None if stale_groups == "drop" else stale_groups}
            for key, value in given.items():
                if value is not None:
                    raise ValueError(f"{key}={value!r} is partial mode's: leave it unset with mode='drain'")
        self.run_config = dict(run_config or {})
        self.tool_timeout_s = tool_timeout_s  # TRL's tools / environment_factory: one tool call's limit
        self.max_turn_tokens = max_turn_tokens  # and one turn's tokens (None: max_completion_length)
        self.tool_rollouts: Any = None  # trainer_hooks.trl_tools.ToolRollouts, made on the first call with tools
        self.last_tool_loop: Any = None  # the latest call's ToolLoopResult, for EngineGRPOTrainer._tool_call_loop
        self.synced_step: int | None = None
        self.last_outputs: list[Any] = []
        self.last_metrics: dict[str, float] = {}
        self.seconds = {"generation": 0.0, "weight_push": 0.0}  # running totals, for step-time splits
        self._push_s: list[float] = []  # pushes since the last report
        self._config_logged = False

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        if not prompts:
            raise ValueError("rollout_func got no prompts")
        if self.sync_weights:
            self.maybe_sync(trainer)
        if self.partial is not None and getattr(getattr(trainer, "model", None), "training", True):
            return self._call_partial(prompts, trainer)
        if getattr(trainer, "tools", None):
            return self._call_tools(prompts, trainer)
        prompt_ids = tokenize_prompts(prompts, trainer)
        runs = list(_runs(prompt_ids))
        base = sampling_params_from_args(trainer.args, getattr(trainer, "eos_token_ids", None))
        params = [dataclasses.replace(base, n=length) for _, length in runs]
        self._wake()
        window = EngineWindow(self.engine)
        outs = self.engine.generate([list(ids) for ids, _ in runs], params)
        metrics = window.close()
        self._sleep()
        self.seconds["generation"] += metrics["rollout/generation_s"]
        self.last_outputs = outs
        rows, versions = self._rows(outs)
        assert len(rows["prompt_ids"]) == len(prompts), (len(rows["prompt_ids"]), len(prompts))
        metrics.update(policy_lag(int(trainer.state.global_step), versions))
        self._report(trainer, metrics)
        return rows

    def _call_tools(self, prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        """TRL's tools / environments, every turn on the engine (``trainer_hooks.trl_tools``)."""
        from trainer_hooks.trl_tools import ToolRollouts

        if self.tool_rollouts is None:
            self.tool_rollouts = ToolRollouts(self.engine, trainer, self.tool_timeout_s, self.max_turn_tokens)
        prompt_ids = tokenize_prompts(prompts, trainer)
        base = sampling_params_from_args(trainer.args, getattr(trainer, "eos_token_ids", None))
        self._wake()
        window = EngineWindow(self.engine)
        episodes, self.last_tool_loop = self.tool_rollouts.run(prompt_ids, trainer, base)
        metrics = window.close()
        self._sleep()
        self.seconds["generation"] += metrics["rollout/generation_s"]
        self.last_outputs = episodes
        versions = [ep.policy_versions or [self.engine.policy_version] for ep in episodes]
        rows = {"prompt_ids": [ep.prompt_ids for ep in episodes],
                "completion_ids": [ep.completion_ids for ep in episodes],
                "logprobs": [ep.logprobs for ep in episodes],
                "policy_version": [int(min(v)) for v in versions]}
        metrics.update(policy_lag(int(trainer.state.global_step), versions))
        self._report(trainer, metrics)
        return rows

    def _call_partial(self, prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        assert self.partial is not None
        if getattr(trainer, "tools", None) or getattr(trainer, "environment_factories", None):
            raise ValueError("mode='partial' cannot serve tools or environments: TRL runs them against its own "
                             "prompts, which may belong to another group; use mode='drain'")
        unwrapped = [f for f in getattr(trainer, "reward_funcs", None) or []
                     if getattr(f, "_partial_rollouts", None) is not self.partial]
        if unwrapped:
            raise ValueError("mode='partial' returns groups of earlier prompts, so each reward function must see "
                             "its row's own prompt and columns: build the trainer with reward_funcs="
                             "rollout.wrap_rewards([...]) (EngineGRPOTrainer does it itself); unwrapped: "
                             f"{[getattr(f, '__name__', type(f).__name__) for f in unwrapped]}")
        n = int(getattr(trainer, "num_generations", None) or trainer.args.num_generations)
        base = sampling_params_from_args(trainer.args, getattr(trainer, "eos_token_ids", None))
        window = EngineWindow(self.engine)
        handed, trace = self.partial.generate(
            prompts, tokenize_prompts(prompts, trainer), dataclasses.replace(base, n=n),
            int(getattr(trainer.args, "seed", 0) or 0), getattr(trainer, "train_dataset", None),
            lambda more: tokenize_prompts(more, trainer))
        metrics = window.close()
        metrics.update(partial_rollout_metrics(trace, time.perf_counter()))
        self.seconds["generation"] += metrics["rollout/generation_s"]
        self.last_outputs = [g.output for g in handed]
        rows, versions = self._rows(self.last_outputs, [g.group_id for g in handed])
        assert len(rows["prompt_ids"]) == len(prompts), (len(rows["prompt_ids"]), len(prompts))
        metrics.update(policy_lag(int(trainer.state.global_step), versions))
        self._report(trainer, metrics)
        return rows

    def wrap_rewards(self, reward_funcs: Any) -> list[Any]:
        """TRL's ``reward_funcs`` (one or a list) made to score each row against its own prompt and columns,
        as partial mode needs (``trainer_hooks.trl_partial``); unchanged in drain mode."""
        funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
        return funcs if self.partial is None else [self.partial.wrap_reward(f) for f in funcs]

    def close(self) -> None:
        """Partial mode: abort the groups still in flight (never handed out); stop the tool loop's threads."""
        if self.partial is not None:
            self.partial.close()
        if self.tool_rollouts is not None:
            self.tool_rollouts.close()

    def _rows(self, outs: list[Any], group_ids: list[int] | None = None) -> tuple[dict[str, list[Any]], list[Any]]:
        """One row per sample, by sample index; ``group_ids`` (partial) adds per-token versions and the group."""
        rows: dict[str, list[Any]] = {"prompt_ids": [], "completion_ids": [], "logprobs": [], "policy_version": []}
        if group_ids is not None:
            rows.update(policy_versions=[], **{GROUP_KEY: []})
        versions = []
        for i, out in enumerate(outs):
            for c in sorted(out.outputs, key=lambda c: c.index):
                rows["prompt_ids"].append(list(out.prompt_token_ids))
                rows["completion_ids"].append(list(c.token_ids))
                rows["logprobs"].append(list(c.logprobs))
                version = min(c.policy_versions) if c.policy_versions else self.engine.policy_version
                rows["policy_version"].append(int(version))
                versions.append(c.policy_versions or [version])
                if group_ids is not None:
                    rows["policy_versions"].append([int(v) for v in c.policy_versions])
                    rows[GROUP_KEY].append(group_ids[i])
        return rows, versions

    def maybe_sync(self, trainer: Any) -> bool:
        """Push the unwrapped trainer model if the step moved since the last push; True if it pushed."""
        step = int(trainer.state.global_step)
        if step == self.synced_step:
            return False
        model = trainer.accelerator.unwrap_model(trainer.model)
        t0 = time.perf_counter()
        with merged_adapter(model):
            push_weights(self.engine, HFWeights(model), version=step, recompute_running=self.recompute_running)
        seconds = time.perf_counter() - t0
        self._push_s.append(seconds)
        self.seconds["weight_push"] += seconds
        self.synced_step = step
        return True

    def _wake(self) -> None:
        if self.sleep_level and self.engine.is_sleeping:
            self.engine.wake_up()

    def _sleep(self) -> None:
        if self.sleep_level:
            self.engine.sleep(self.sleep_level)

    def _report(self, trainer: Any, metrics: dict[str, float]) -> None:
        if self._push_s:
            metrics["rollout/weight_push_s"] = sum(self._push_s) / len(self._push_s)
            self._push_s.clear()
        self.last_metrics = metrics
        log_metric = getattr(trainer, "_log_metric", None)  # GRPOTrainer: averaged into the step's logs
        if callable(log_metric):
            for key, value in metrics.items():
                log_metric(key, value)
        args = getattr(trainer, "args", None)
        if not self._config_logged and reports_to_wandb(getattr(args, "report_to", None)):
            self._config_logged = add_to_wandb_config({"engine": self.engine.describe(), **self.run_config})


@contextlib.contextmanager
def merged_adapter(model: Any) -> Iterator[None]:
    """Fold a PEFT adapter into the base weights for the push and unfold it after (TRL does the same for
    vLLM); a plain model passes through."""
    merge = getattr(model, "merge_adapter", None)
    if merge is None or not callable(merge):
        yield
        return
    merge()
    try:
        yield
    finally:
        model.unmerge_adapter()


def tokenize_prompts(prompts: list[Any], trainer: Any) -> list[list[int]]:
    """Token ids as GRPOTrainer would make them: chat messages through the trainer tokenizer's chat
    template (with the trainer's tools, template and ``chat_template_kwargs``), strings as they are."""
    tok = getattr(trainer, "processing_class", None)
    if tok is None:
        raise ValueError("the trainer has no processing_class (tokenizer); it is needed to encode prompts")
    if _is_conversation(prompts[0]):
        kwargs = dict(tools=getattr(trainer, "tools", None) or None,
                      chat_template=getattr(trainer, "chat_template", None),
                      **(getattr(trainer, "chat_template_kwargs", None) or {}))
        return [encode_prompt(tok, p, **kwargs)[1] for p in prompts]
    if all(isinstance(p, str) for p in prompts):
        return [list(ids) for ids in tok(text=prompts)["input_ids"]]  # one batch, as GRPOTrainer
    raise TypeError(f"prompts must be strings or lists of {{role, content}} messages, got {prompts[0]!r:.200}")


def _is_conversation(prompt: Any) -> bool:
    return isinstance(prompt, list) and bool(prompt) and all(isinstance(m, dict) and "role" in m for m in prompt)


def _runs(prompt_ids: list[list[int]]) -> Iterator[tuple[list[int], int]]:
    """(prompt ids, run length) for each run of identical consecutive prompts."""
    start = 0
    for i in range(1, len(prompt_ids) + 1):
        if i == len(prompt_ids) or prompt_ids[i] != prompt_ids[start]:
            yield prompt_ids[start], i - start
            start = i


def sampling_params_from_args(args: Any, stop_token_ids: Sequence[int] | None = None) -> SamplingParams:
    """SamplingParams from a GRPOConfig: temperature, top_p, top_k, min_p, max_completion_length and
    ``generation_kwargs`` (which override, vLLM-style). What the engine cannot honour is refused."""
    penalty = getattr(args, "repetition_penalty", 1.0)
    if penalty not in (None, 1.0):
        raise ValueError(f"repetition_penalty={penalty} is not supported by the rollout engine; allowed: 1.0")
    top_k = getattr(args, "top_k", 0)
    values: dict[str, Any] = dict(
        temperature=float(getattr(args, "temperature", 1.0)),
        top_p=float(getattr(args, "top_p", 1.0) if getattr(args, "top_p", None) is not None else 1.0),
        top_k=0 if top_k is None else int(top_k),
        min_p=float(getattr(args, "min_p", None) or 0.0),
        max_tokens=int(getattr(args, "max_completion_length", None) or 16),
        logprobs_mode="policy",
    )
    if stop_token_ids:
        values["stop_token_ids"] = sorted({int(t) for t in stop_token_ids})
    extra = getattr(args, "generation_kwargs", None) or {}
    unknown = sorted(set(extra) - set(GENERATION_KWARGS))
    if unknown:
        raise ValueError(f"generation_kwargs {unknown} are not supported; allowed: {list(GENERATION_KWARGS)}")
    values.update(extra)
    if values.get("ignore_eos"):
        values.pop("stop_token_ids", None)
    return SamplingParams(**values)
