"""``EngineGRPOTrainer``: TRL's GRPOTrainer with the engine's logprobs in its importance-sampling correction.

GRPOTrainer (trl 1.16) takes a ``rollout_func`` whose rows carry per-token ``logprobs``, but it only uses
them when ``use_vllm`` is on: then it recomputes the trainer's logprobs of the sampled tokens, weights each
token's loss by the truncated importance ratio exp(trainer - sampler) (``vllm_importance_sampling_*``
options: mode, clip range) and logs the mismatch as ``sampling/sampling_logp_difference/{mean,max}`` and
``sampling/importance_sampling_ratio/{min,mean,max}``. There is no option that asks for this without
vLLM, so this subclass constructs the trainer with ``use_vllm=False`` (nothing of vLLM is imported) and then
switches the trainer's own flag on, with the engine standing in for TRL's vLLM generation object, whose one
method TRL calls on this path, ``sync_weights``, pushes the trainer's weights through ``TRLRollout``.

Everything else is TRL's code path, unchanged. It was read against trl==1.16.0 and is refused on any other
version (``check_trl_version``), since the attributes it sets are TRL internals.
"""

from __future__ import annotations

from typing import Any

import trl
from trl import GRPOTrainer

from trainer_hooks.trl import TRLRollout

TRL_VERSION = "1.16.0"
IS_METRICS = ("sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max")


def check_trl_version(what: str = "trainer_hooks.grpo") -> None:
    if trl.__version__ != TRL_VERSION:
        raise ImportError(
            f"{what} was checked against trl=={TRL_VERSION} and relies on its internals; found "
            f"trl=={trl.__version__}. Install trl=={TRL_VERSION} (requirements.lock), or use a plain "
            "GRPOTrainer(rollout_func=TRLRollout(engine)) without the importance-sampling correction."
        )


class _EngineGeneration:
    """What GRPOTrainer's rollout_func path asks of its vLLM object: ``sync_weights()`` when the step moved."""

    def __init__(self, trainer: GRPOTrainer, rollout: TRLRollout) -> None:
        self.trainer, self.rollout = trainer, rollout

    def sync_weights(self) -> None:
        self.rollout.maybe_sync(self.trainer)


class EngineGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer(..., rollout_func=TRLRollout(engine))`` plus the engine's logprobs as sampling logprobs.

    Set the correction with GRPOConfig's own fields: ``vllm_importance_sampling_correction`` (on by
    default), ``vllm_importance_sampling_mode`` (``token_truncate`` is truncated IS per token, as TRL
    does for vLLM), ``vllm_importance_sampling_clip_min`` / ``_clip_max``. The engine-vs-trainer gap is
    also logged as ``rollout/logprob_gap_{mean,max}`` next to the other engine metrics. With
    ``TRLRollout(mode="partial")`` the reward functions are wrapped (``TRLRollout.wrap_rewards``) so that each
    row is scored against its own group's prompt and dataset columns.
    """

    def __init__(self, *args: Any, rollout_func: TRLRollout, **kwargs: Any) -> None:
        check_trl_version()
        if not isinstance(rollout_func, TRLRollout):
            raise TypeError("EngineGRPOTrainer needs rollout_func=TRLRollout(engine), "
                            f"got {type(rollout_func).__name__}")
        training_args = kwargs.get("args", args[2] if len(args) > 2 else None)
        if training_args is not None and training_args.use_vllm:
            raise ValueError("use_vllm=True: the engine is the generator here; leave use_vllm=False")
        if rollout_func.partial is not None:  # each row scored against its own group's prompt (partial mode)
            if "reward_funcs" in kwargs:
                kwargs["reward_funcs"] = rollout_func.wrap_rewards(kwargs["reward_funcs"])
            elif len(args) > 1:
                args = (args[0], rollout_func.wrap_rewards(args[1]), *args[2:])
        super().__init__(*args, rollout_func=rollout_func, **kwargs)
        self.use_vllm = True  # TRL's switch for "generator logprobs are in the rows": IS correction + metrics
        self.vllm_mode = "server"  # never "colocate": that branch reads a vLLM engine's max_model_len
        self.vllm_generation = _EngineGeneration(self, rollout_func)
        self._last_loaded_step = -1

    def _tool_call_loop(self, prompts: Any, prompt_ids: Any, completion_ids: Any, completions: Any, logprobs: Any,
                        images: Any, multimodal_fields: Any) -> tuple:
        """The engine already ran the tools (``trainer_hooks.trl_tools``): hand TRL its env_mask and counts."""
        done = self.rollout_func.last_tool_loop
        if done is None:  # not this call's rows (cannot happen through TRLRollout): TRL's own loop
            return super()._tool_call_loop(prompts, prompt_ids, completion_ids, completions, logprobs, images,
                                           multimodal_fields)
        self.rollout_func.last_tool_loop = None
        return (done.env_mask, done.completions, completion_ids, logprobs, done.tool_calls, done.tool_failures,
                [[] for _ in completion_ids])

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        metrics = self._metrics["train" if self.model.training else "eval"]
        for key in IS_METRICS:
            if key in metrics:
                metrics["rollout/logprob_gap_" + key.rsplit("/", 1)[1]] = list(metrics[key])
        super().log(logs, start_time)
