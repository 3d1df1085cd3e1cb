"""``EngineAsyncGRPOTrainer``: TRL's AsyncGRPOTrainer with the engine as generator, on a GPU or a CPU.

A thin subclass, read against trl==1.16.0 (refused on other versions, like ``trainer_hooks.grpo``):

- it wires ``EngineRolloutWorker`` and ``EngineWeightTransfer`` (``trainer_hooks.async_grpo``) in;
- it logs the engine-vs-trainer mismatch with the names GRPOTrainer uses for vLLM
  (``sampling/sampling_logp_difference/{mean,max}``, ``sampling/importance_sampling_ratio/{min,mean,max}``,
  mirrored as ``rollout/logprob_gap_{mean,max}``), read from the log-probs the training forward computes
  anyway. AsyncGRPOTrainer's ratio is taken against the engine's logprobs directly, so these are over every
  trained token: for samples of the current weights (staleness 0) the pure numeric gap, for older ones
  gap plus the policy's drift since (``rollout/policy_lag_*`` says how much of the batch is older).
- where CUDA is absent (or ``torch_attention=True``) it swaps two things TRL has no option for: its packed
  "tree" attention calls a FlashAttention-3 kernel fetched from the Hub (replaced by the plain-torch
  ``torch_tree_attention`` through transformers' ``AttentionInterface``), and its constructor reads the
  GPU's name for MFU (answered with "unknown" for the duration of the constructor only).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from transformers import AttentionInterface, TrainerCallback
from trl.experimental.async_grpo import AsyncGRPOTrainer
from trl.experimental.async_grpo import async_grpo_trainer as trainer_module
from trl.experimental.async_grpo.packing import TREE_ATTENTION

from rollout.api import ContinuousBackend, require_backend
from trainer_hooks.async_env import EnvRolloutWorker
from trainer_hooks.async_grpo import EngineRolloutWorker, EngineWeightTransfer
from trainer_hooks.engine_metrics import add_to_wandb_config, reports_to_wandb
from trainer_hooks.env_rollouts import env_limits, train_env_spec
from trainer_hooks.grpo import check_trl_version


class RunConfigCallback(TrainerCallback):
    """Adds the engine's resolved config (and the job's) to the W&B run the trainer opened."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config

    def on_train_begin(self, args: Any, state: Any, control: Any, **_: Any) -> None:
        if reports_to_wandb(args.report_to):
            add_to_wandb_config(self.config)


class EngineAsyncGRPOTrainer(AsyncGRPOTrainer):
    """``AsyncGRPOTrainer`` generating with an in-process engine (no vLLM server). ``args.token_budget``
    unset defaults to the engine's ``max_model_len`` (TRL would ask the vLLM server). ``max_staleness`` and
    ``recompute_running`` are the engine side's partial-rollout knobs (``trainer_hooks.async_grpo``).
    ``environment_factory`` / ``tools`` (TRL's) run every turn on the engine's environment loop
    (``trainer_hooks.async_env``): environment tokens are context only (``completion_mask`` 0), bounded as TRL's
    (``max_tool_calling_iterations``, ``max_completion_length`` for model and environment tokens together), each
    tool call by ``tool_timeout_s`` and each model turn by ``max_turn_tokens`` (None: the whole budget)."""

    def __init__(self, model: str, engine: Any, reward_funcs: list[Callable[..., list[float]]], args: Any,
                 train_dataset: Any, processing_class: Any, torch_attention: bool | None = None,
                 run_config: dict[str, Any] | None = None, callbacks: list[Any] | None = None,
                 max_staleness: int | None = None, recompute_running: bool = True,
                 environment_factory: Callable[[], Any] | None = None, tools: list[Callable[..., Any]] | None = None,
                 tool_timeout_s: float = 60.0, max_turn_tokens: int | None = None, **kwargs: Any) -> None:
        check_trl_version("trainer_hooks.async_trainer")
        engine = require_backend(engine, "train.trainer=async_grpo", ContinuousBackend)
        if args.token_budget is None:
            args.token_budget = engine.limits.max_model_len
        use_torch = (not torch.cuda.is_available()) if torch_attention is None else torch_attention
        spec = train_env_spec(environment_factory, tools)
        if spec is None:
            worker = EngineRolloutWorker(engine, train_dataset, reward_funcs, processing_class, args,
                                         max_staleness=max_staleness)
        else:  # TRL's environment_factory / tools: every turn on the engine's environment loop
            limits = env_limits(int(args.max_completion_length), tool_timeout_s, max_turn_tokens,
                                args.max_tool_calling_iterations)
            worker = EnvRolloutWorker(engine, train_dataset, reward_funcs, processing_class, args, spec, limits,
                                      max_staleness=max_staleness)
        transfer = EngineWeightTransfer(engine, metrics_queue=worker.metrics_queue,
                                        recompute_running=recompute_running)
        config = {"engine": engine.describe(), **(run_config or {})}
        with _no_peak_flops(use_torch):
            super().__init__(model=model, reward_funcs=reward_funcs, args=args, train_dataset=train_dataset,
                             processing_class=processing_class, rollout_worker=worker, weight_transfer=transfer,
                             callbacks=[*(callbacks or []), RunConfigCallback(config)], **kwargs)
        if use_torch:  # after construction: the trainer registers its own kernel under the same name
            AttentionInterface.register(TREE_ATTENTION, torch_tree_attention)

    def compute_loss(self, model: Any, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        captured: list[torch.Tensor] = []
        hook = model.register_forward_hook(lambda _m, _a, out: captured.append(out.log_probs.detach()))
        try:
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        finally:
            hook.remove()
        if captured:
            self._log_sampling_gap(captured[0], inputs)
        return loss

    def _log_sampling_gap(self, log_probs: torch.Tensor, inputs: dict[str, Any]) -> None:
        selected = inputs["token_index"] >= 0
        if not bool(selected.any()):
            return
        trainer_lp = log_probs.flatten()[inputs["token_index"][selected]].float()
        diff = trainer_lp - inputs["old_log_probs"][selected].float()
        gap, ratio = diff.abs(), diff.exp()
        m = self._metrics["train"]
        for name, value in (("sampling/sampling_logp_difference/mean", gap.mean()),
                            ("sampling/sampling_logp_difference/max", gap.max()),
                            ("sampling/importance_sampling_ratio/min", ratio.min()),
                            ("sampling/importance_sampling_ratio/mean", ratio.mean()),
                            ("sampling/importance_sampling_ratio/max", ratio.max()),
                            ("rollout/logprob_gap_mean", gap.mean()), ("rollout/logprob_gap_max", gap.max())):
            m[name].append(value.item())


@contextlib.contextmanager
def _no_peak_flops(active: bool) -> Iterator[None]:
    """AsyncGRPOTrainer's constructor asks ``torch.cuda`` for the device name (MFU); without CUDA that raises."""
    original = trainer_module.get_peak_flops_per_device
    if active:
        trainer_module.get_peak_flops_per_device = lambda *a, **k: None
    try:
        yield
    finally:
        trainer_module.get_peak_flops_per_device = original


def build_async_grpo_trainer(model_path: str, engine: Any, reward_funcs: list[Callable[..., list[float]]],
                             args: Any, train_dataset: Any, processing_class: Any,
                             torch_attention: bool | None = None, **kwargs: Any) -> EngineAsyncGRPOTrainer:
    """``EngineAsyncGRPOTrainer(...)`` under its older name."""
    return EngineAsyncGRPOTrainer(model_path, engine, reward_funcs, args, train_dataset, processing_class,
                                  torch_attention=torch_attention, **kwargs)


def torch_tree_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: Any, *, tree_kv_index: torch.Tensor, tree_cu_seqlens_q: torch.Tensor,
                         tree_cu_seqlens_k: torch.Tensor, scaling: float | None = None,
                         sliding_window: int | None = None, softcap: float | None = None, **_: Any
                         ) -> tuple[torch.Tensor, None]:
    """TRL's tree attention in plain torch: each packed segment attends, causally and aligned to its end
    (FlashAttention's varlen convention), to the K/V rows of its root-to-segment path."""
    q = query.transpose(1, 2)[0]
    k = key.transpose(1, 2)[0].index_select(0, tree_kv_index)
    v = value.transpose(1, 2)[0].index_select(0, tree_kv_index)
    rep = q.shape[1] // k.shape[1]
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    out = torch.empty_like(q)
    cu_q, cu_k = tree_cu_seqlens_q.tolist(), tree_cu_seqlens_k.tolist()
    for s in range(len(cu_q) - 1):
        qs = q[cu_q[s]:cu_q[s + 1]]
        ks = k[cu_k[s]:cu_k[s + 1]].repeat_interleave(rep, dim=1)
        vs = v[cu_k[s]:cu_k[s + 1]].repeat_interleave(rep, dim=1)
        scores = torch.einsum("qhd,khd->hqk", qs, ks).float() * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        qpos = torch.arange(len(qs), device=q.device)[:, None] + (len(ks) - len(qs))
        kpos = torch.arange(len(ks), device=q.device)[None, :]
        allowed = kpos <= qpos
        if sliding_window:
            allowed &= kpos > qpos - sliding_window
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1).to(vs.dtype)
        out[cu_q[s]:cu_q[s + 1]] = torch.einsum("hqk,khd->qhd", probs, vs)
    return out.unsqueeze(0), None
