"""``EnginePPO``: a compact PPO loop around the engine (TRL 1.16 has no PPO trainer).

One ``step(rows)``: the engine samples completions (its per-token logprobs are the behaviour policy's), the
reward scores them, one no-grad pass computes the policy's own logprobs (for the KL and the engine-vs-trainer
gap), the frozen reference's and the values; GAE turns per-token rewards into advantages; then
``ppo_epochs`` x ``num_minibatches`` optimizer steps on the clipped policy and value losses, each followed by
a weight push to the engine (``push_weights``, version = optimizer steps so far), so the engine always
serves the policy being trained. The engine may be a ``RolloutPool``: each push is broadcast to every
replica, and they all reach that version before any generates again. With an environment (``env``: TRL's
``environment_factory`` / ``tools`` as ``trainer_hooks.env_rollouts`` builds them) each completion is a
conversation run by the engine's environment loop (``trainer_hooks.ppo_env``); its environment tokens are context
only (mask 0): no advantage (GAE steps over them), no policy loss, no value loss.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from rollout.api import require_backend
from rollout.envs import EnvLimits
from rollout.rl.prompts import encode_prompt
from rollout.sampling_params import SamplingParams
from trainer_hooks.engine_metrics import EngineWindow
from trainer_hooks.ppo import (
    PPOConfig,
    Sequences,
    ValueModel,
    gae,
    masked_mean,
    masked_whiten,
    pad_rows,
    policy_loss,
    token_logprobs,
    token_rewards,
    value_loss,
)
from trainer_hooks.ppo_env import PPOEnvRollouts
from trainer_hooks.weights import HFWeights, push_weights


@dataclass
class RolloutBatch:
    seqs: Sequences
    behaviour_logp: torch.Tensor  # [B, T] the engine's
    versions: list[int]  # oldest weights behind each completion
    advantages: torch.Tensor
    returns: torch.Tensor
    old_values: torch.Tensor
    metrics: dict[str, float]


class EnginePPO:
    """PPO with an engine generating for ``policy``; ``value_model`` and the frozen ``ref_model`` live beside it.

    ``reward_fn`` has TRL's signature. ``sleep_level`` 1/2 frees the engine's KV cache (and weights) while
    training (a ``RolloutPool``: its ``sleep()`` replicas' memory). ``on_push(self)`` runs after every push
    (checks, tests). ``seconds`` keeps running totals of generation and weight-push time.
    """

    def __init__(self, engine: Any, policy: nn.Module, value_model: ValueModel, ref_model: nn.Module,
                 tokenizer: Any, reward_fn: Callable[..., list[Any]] | None, config: PPOConfig,
                 sampling: SamplingParams, sleep_level: int = 0, bf16: bool = False,
                 on_push: Callable[[EnginePPO], None] | None = None, env: Any = None,
                 env_limits: EnvLimits | None = None) -> None:
        if sampling.temperature <= 0:
            raise ValueError(f"sampling.temperature={sampling.temperature} is invalid for PPO: must be > 0")
        self.engine = require_backend(engine, "EnginePPO")
        self.env = None  # trainer_hooks.env_rollouts.PPOEnvRollouts: every turn on the engine's environment loop
        if env is not None:
            self.env = PPOEnvRollouts(self.engine, env, tokenizer, env_limits or EnvLimits(), reward_fn)
        elif reward_fn is None:
            raise ValueError("EnginePPO needs a reward_fn (or an environment with get_reward)")
        self.policy, self.value_model, self.ref = policy, value_model, ref_model.eval().requires_grad_(False)
        self.tokenizer, self.reward_fn, self.cfg = tokenizer, reward_fn, config
        self.sampling = dataclasses.replace(sampling, logprobs_mode="policy")
        self.sleep_level, self.bf16, self.on_push = sleep_level, bf16, on_push
        self.device = next(policy.parameters()).device
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.pad_id = int(pad or 0)
        self.opt_policy = torch.optim.AdamW(policy.parameters(), lr=config.learning_rate)
        self.opt_value = torch.optim.AdamW(value_model.parameters(), lr=config.value_learning_rate)
        self.version = 0  # optimizer steps taken = the engine's policy_version after the latest push
        self.seconds = {"generation": 0.0, "weight_push": 0.0}
        self._push_s: list[float] = []
        self.push()  # the engine starts from exactly the policy's weights

    def close(self) -> None:
        """Stop the environment loop's threads (nothing to do without an environment)."""
        if self.env is not None:
            self.env.close()

    # ---- one iteration --------------------------------------------------------------------------------
    def step(self, rows: list[dict[str, Any]]) -> dict[str, float]:
        batch = self.rollout(rows)
        metrics = dict(batch.metrics)
        metrics.update(self.update(batch))
        if self._push_s:
            metrics["rollout/weight_push_s"] = sum(self._push_s) / len(self._push_s)
            self._push_s.clear()
        return metrics

    def push(self) -> None:
        t0 = time.perf_counter()
        reached = push_weights(self.engine, HFWeights(self.policy), version=self.version)
        seconds = time.perf_counter() - t0
        if reached != self.version:  # the next rollout's logprobs would not be this policy's
            raise RuntimeError(f"the engine is at policy_version {reached} after pushing version {self.version}")
        self._push_s.append(seconds)
        self.seconds["weight_push"] += seconds
        if self.on_push is not None:
            self.on_push(self)

    # ---- generation and scoring -----------------------------------------------------------------------
    def rollout(self, rows: list[dict[str, Any]]) -> RolloutBatch:
        if self.sleep_level and self.engine.is_sleeping:
            self.engine.wake_up()
        window = EngineWindow(self.engine)
        if self.env is not None:
            done = self.env.run(rows, self.sampling)
        else:
            outs = self.engine.generate([self.encode(r["prompt"]) for r in rows], self.sampling)
        metrics = window.close()
        if self.sleep_level:
            self.engine.sleep(self.sleep_level)
        self.seconds["generation"] += metrics["rollout/generation_s"]
        if self.env is not None:
            seqs = done.seqs.to(self.device)
            behaviour, scores, unscored, versions = done.logprobs, done.scores, done.unscored, done.versions
            metrics.update(done.metrics)
        else:
            flat = [(row, out, c) for row, out in zip(rows, outs) for c in sorted(out.outputs, key=lambda c: c.index)]
            seqs = Sequences.build([list(o.prompt_token_ids) for _, o, _ in flat],
                                   [list(c.token_ids) for _, _, c in flat], self.pad_id).to(self.device)
            behaviour = pad_rows([list(c.logprobs) for _, _, c in flat], seqs.mask.shape[1])
            scores, unscored = self.score(flat)
            versions = [min(c.policy_versions) if c.policy_versions else self.version for _, _, c in flat]
        behaviour = behaviour.to(self.device)
        with torch.no_grad():
            old_logp, ref_logp, values = self._no_grad_passes(seqs)
        rewards, kl = token_rewards(scores.to(self.device), old_logp, ref_logp, seqs.mask, self.cfg.kl_coef)
        advantages, returns = gae(rewards, values, seqs.mask, self.cfg.gamma, self.cfg.lam)
        if self.cfg.whiten_advantages:
            advantages = masked_whiten(advantages, seqs.mask)
        gap = (old_logp - behaviour).abs()[seqs.mask.bool()]
        metrics.update({
            "reward": scores.mean().item(), "reward_std": scores.std().item() if len(scores) > 1 else 0.0,
            "completions/mean_length": seqs.mask.sum(1).mean().item(), "ppo/unscored_frac": unscored,
            "ppo/kl_ref": (kl.sum(1)).mean().item(), "ppo/value_mean": masked_mean(values, seqs.mask).item(),
            "ppo/returns_mean": masked_mean(returns, seqs.mask).item(),
            "rollout/logprob_gap_mean": gap.mean().item() if gap.numel() else 0.0,
            "rollout/logprob_gap_max": gap.max().item() if gap.numel() else 0.0,
        })
        return RolloutBatch(seqs, behaviour, versions, advantages, returns, values, metrics)

    def encode(self, prompt: Any) -> list[int]:
        return encode_prompt(self.tokenizer, prompt)[1]

    def score(self, flat: list[tuple[dict[str, Any], Any, Any]]) -> tuple[torch.Tensor, float]:
        """Scores from the reward (TRL's signature and columns); an unscorable completion (None) scores 0."""
        texts = [c.text if c.text is not None else self.tokenizer.decode(c.token_ids, skip_special_tokens=True)
                 for _, _, c in flat]
        completions = [t if isinstance(row["prompt"], str) else [{"role": "assistant", "content": t}]
                       for (row, _, _), t in zip(flat, texts)]
        columns = {k: [row.get(k) for row, _, _ in flat] for k in flat[0][0] if k != "prompt"}
        values = self.reward_fn(prompts=[row["prompt"] for row, _, _ in flat], completions=completions,
                                completion_ids=[list(c.token_ids) for _, _, c in flat], **columns)
        if len(values) != len(flat):
            raise ValueError(f"the reward returned {len(values)} values for {len(flat)} completions")
        unscored = sum(v is None for v in values)
        return torch.tensor([0.0 if v is None else float(v) for v in values]), unscored / len(values)

    def _no_grad_passes(self, seqs: Sequences) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        temp = self.sampling.temperature
        old, ref, val = [], [], []
        for idx in torch.arange(seqs.mask.shape[0], device=self.device).split(self.cfg.forward_batch_size):
            part = seqs.select(idx)
            with self._autocast():
                old.append(token_logprobs(self.policy, part, temp))
                ref.append(token_logprobs(self.ref, part, temp))
                val.append(self.value_model(part))
        return torch.cat(old), torch.cat(ref), torch.cat(val)

    # ---- optimisation ---------------------------------------------------------------------------------
    def update(self, batch: RolloutBatch) -> dict[str, float]:
        cfg, n = self.cfg, batch.seqs.mask.shape[0]
        stats: dict[str, list[float]] = {}
        lags: list[float] = []
        for _ in range(cfg.ppo_epochs):
            for idx in torch.randperm(n, device=self.device).tensor_split(min(cfg.num_minibatches, n)):
                seqs = batch.seqs.select(idx)
                with self._autocast():
                    logp = token_logprobs(self.policy, seqs, self.sampling.temperature)
                    values = self.value_model(seqs)
                p_loss, p_stats = policy_loss(logp, batch.behaviour_logp[idx], batch.advantages[idx], seqs.mask,
                                              cfg.clip_range)
                v_loss, v_stats = value_loss(values, batch.old_values[idx], batch.returns[idx], seqs.mask,
                                             cfg.clip_range_value)
                grad_p = self._optimizer_step(p_loss, self.policy, self.opt_policy)
                grad_v = self._optimizer_step(v_loss, self.value_model, self.opt_value)
                lags.append(float(self.version - min(batch.versions[i] for i in idx.tolist())))
                self.version += 1
                self.push()
                for key, value in {**p_stats, **v_stats, "ppo/policy_loss": p_loss.item(),
                                   "ppo/value_loss": v_loss.item(), "ppo/policy_grad_norm": grad_p,
                                   "ppo/value_grad_norm": grad_v}.items():
                    stats.setdefault(key, []).append(value)
        out = {k: sum(v) / len(v) for k, v in stats.items()}
        # Policy lag where it matters here: optimizer steps between the sampling weights and each update.
        out.update({"ppo/optimizer_steps": float(len(lags)), "rollout/policy_lag_mean": sum(lags) / len(lags),
                    "rollout/policy_lag_max": max(lags)})
        return out

    def _optimizer_step(self, loss: torch.Tensor, model: nn.Module, opt: torch.optim.Optimizer) -> float:
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), self.cfg.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(norm)

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if not self.bf16:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)


def batches(dataset: Any, size: int, seed: int, shuffle: bool) -> Iterator[list[dict[str, Any]]]:
    """Endless batches of ``size`` rows: the dataset in order (or reshuffled each epoch), wrapping around."""
    g = torch.Generator().manual_seed(seed)
    order: list[int] = []
    while True:
        while len(order) < size:
            epoch = torch.randperm(len(dataset), generator=g).tolist() if shuffle else list(range(len(dataset)))
            order.extend(epoch)
        take, order = order[:size], order[size:]
        yield [dataset[i] for i in take]
