"""PPO's pieces, small enough to check by eye: config, batch layout, token logprobs, value model, GAE, losses.

The loop that puts them together with the engine is ``trainer_hooks.ppo_loop.EnginePPO``. Conventions:

- A batch is right-padded ``[B, T]`` over *completion* tokens (``mask`` 1 on the model's tokens; 0 on padding and
  on an environment's tokens between model turns, which are context only: no advantage, no policy or value loss).
  Token t of a completion is predicted from position ``prompt_len - 1 + t`` of ``prompt + completion``; its value is the
  value model's output at that same position (the state before the token is chosen).
- Rewards are per token: ``-kl_coef * (log pi_old - log pi_ref)`` on every token (KL to a frozen reference,
  as in InstructGPT), plus the sequence's score on its last token.
- The behaviour policy's logprobs are the engine's (the tokens were sampled there); the clipped ratio is
  taken against them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True, slots=True)
class PPOConfig:
    learning_rate: float = 5e-3  # policy
    value_learning_rate: float = 5e-3
    ppo_epochs: int = 2  # passes over each rollout batch
    num_minibatches: int = 2  # optimizer steps per pass (each one pushes weights to the engine)
    clip_range: float = 0.2
    clip_range_value: float = 0.2
    kl_coef: float = 0.001
    gamma: float = 1.0
    lam: float = 0.95
    whiten_advantages: bool = True
    max_grad_norm: float = 1.0
    forward_batch_size: int = 16  # sequences per no-grad forward (reference, old policy, values)

    def __post_init__(self) -> None:
        for key in ("learning_rate", "value_learning_rate", "clip_range", "clip_range_value", "max_grad_norm"):
            _check(key, _num(getattr(self, key)) and getattr(self, key) > 0, "a number > 0")
        for key in ("ppo_epochs", "num_minibatches", "forward_batch_size"):
            _check(key, _int(getattr(self, key)) and getattr(self, key) >= 1, "an int >= 1")
        _check("kl_coef", _num(self.kl_coef) and self.kl_coef >= 0, "a number >= 0")
        for key in ("gamma", "lam"):
            _check(key, _num(getattr(self, key)) and 0 <= getattr(self, key) <= 1, "a number in [0, 1]")
        _check("whiten_advantages", isinstance(self.whiten_advantages, bool), "true or false")


def _int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _num(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v


def _check(key: str, ok: bool, allowed: str) -> None:
    if not ok:
        raise ValueError(f"train.ppo.{key} is invalid: must be {allowed}")


PPO_FIELDS = tuple(f.name for f in dataclasses.fields(PPOConfig))


# ---- batch layout ---------------------------------------------------------------------------------------
@dataclass
class Sequences:
    """Prompt + completion token ids, right-padded, and where each completion starts."""

    input_ids: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor  # [B, L]
    prompt_lens: torch.Tensor  # [B]
    mask: torch.Tensor  # [B, T] completion-token mask
    completion_ids: torch.Tensor  # [B, T]

    @classmethod
    def build(cls, prompts: list[list[int]], completions: list[list[int]], pad_id: int,
              masks: list[list[int]] | None = None) -> Sequences:
        """``masks``: per completion token 1 (trained) or 0 (an environment's token: context only, TRL's
        ``tool_mask``); None: every completion token is the model's."""
        full = [p + c for p, c in zip(prompts, completions)]
        length, t_max = max(map(len, full)), max(1, max(map(len, completions)))
        ids = torch.full((len(full), length), pad_id, dtype=torch.long)
        attn = torch.zeros_like(ids)
        comp = torch.full((len(full), t_max), pad_id, dtype=torch.long)
        mask = torch.zeros((len(full), t_max), dtype=torch.float32)
        for i, (seq, c) in enumerate(zip(full, completions)):
            ids[i, : len(seq)] = torch.tensor(seq)
            attn[i, : len(seq)] = 1
            comp[i, : len(c)] = torch.tensor(c, dtype=torch.long)
            mask[i, : len(c)] = 1.0 if masks is None else torch.tensor(masks[i], dtype=torch.float32)
        return cls(ids, attn, torch.tensor([len(p) for p in prompts]), mask, comp)

    def to(self, device: torch.device | str) -> Sequences:
        return Sequences(*(t.to(device) for t in dataclasses.astuple(self)))

    def select(self, index: torch.Tensor) -> Sequences:
        return Sequences(*(t[index] for t in dataclasses.astuple(self)))

    def positions(self) -> torch.Tensor:
        """[B, T] index into the full sequence of the position that predicts each completion token."""
        t = torch.arange(self.mask.shape[1], device=self.prompt_lens.device)
        return (self.prompt_lens[:, None] - 1 + t[None, :]).clamp(max=self.input_ids.shape[1] - 1)


def pad_rows(rows: list[list[float]], width: int) -> torch.Tensor:
    out = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=torch.float32)
    return out


# ---- models ---------------------------------------------------------------------------------------------
def token_logprobs(model: nn.Module, seqs: Sequences, temperature: float) -> torch.Tensor:
    """[B, T] log softmax(logits / T) of each completion token, in float32 (the engine's ``policy`` mode).
    Logits are computed only from the first completion-predicting position on (``logits_to_keep``)."""
    length = seqs.input_ids.shape[1]
    keep = int(length - (int(seqs.prompt_lens.min()) - 1))
    logits = model(input_ids=seqs.input_ids, attention_mask=seqs.attention_mask, logits_to_keep=keep).logits
    pos = seqs.positions() - (length - keep)
    picked = logits.gather(1, pos[..., None].expand(-1, -1, logits.shape[-1]))  # [B, T, V]
    logp = torch.log_softmax(picked.float() / temperature, dim=-1)
    return logp.gather(-1, seqs.completion_ids[..., None]).squeeze(-1) * seqs.mask


class ValueModel(nn.Module):
    """A transformer trunk with a scalar head: V(state before each completion token)."""

    def __init__(self, trunk: nn.Module, hidden_size: int) -> None:
        super().__init__()
        self.trunk = trunk
        self.head = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    @classmethod
    def from_pretrained(cls, path: str, **kwargs: Any) -> ValueModel:
        from transformers import AutoModel
        from transformers.utils import logging as hf_logging

        level = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # the checkpoint's lm_head is expected to go unused: no load report
        try:
            trunk = AutoModel.from_pretrained(path, **kwargs)
        finally:
            hf_logging.set_verbosity(level)
        return cls(trunk, trunk.config.get_text_config().hidden_size)

    def forward(self, seqs: Sequences) -> torch.Tensor:
        hidden = self.trunk(input_ids=seqs.input_ids, attention_mask=seqs.attention_mask).last_hidden_state
        pos = seqs.positions()
        picked = hidden.gather(1, pos[..., None].expand(-1, -1, hidden.shape[-1]))
        return self.head(picked.to(self.head.weight.dtype)).squeeze(-1).float() * seqs.mask


# ---- advantages and losses ------------------------------------------------------------------------------
def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    return (x - mean) * torch.rsqrt(var + eps) * mask


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimates and returns over [B, T] tensors (V = 0 after the end). The steps are the
    tokens where ``mask`` is 1: a masked token inside a row (an environment's reply between two model turns) is
    part of the transition from one model token to the next, so it gets no advantage and credit flows across it
    (right padding is the special case of masked tokens at the end)."""
    advantages = torch.zeros_like(rewards)
    last = torch.zeros(rewards.shape[0], dtype=rewards.dtype, device=rewards.device)
    next_value = torch.zeros_like(last)  # V of the next model token
    for t in reversed(range(rewards.shape[1])):
        m = mask[:, t] > 0
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        here = delta + gamma * lam * last
        advantages[:, t] = torch.where(m, here, torch.zeros_like(here))
        last = torch.where(m, here, last)
        next_value = torch.where(m, values[:, t], next_value)
    return advantages, (advantages + values) * mask


def token_rewards(scores: torch.Tensor, old_logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor,
                  kl_coef: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token rewards (KL penalty on every model token, the score on the last model token) and the per-token KL."""
    kl = (old_logp - ref_logp) * mask
    rewards = -kl_coef * kl
    index = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(mask > 0, index, torch.full_like(index, -1)).max(1).values.clamp(min=0)
    rewards[torch.arange(len(scores)), last] += scores * (mask.sum(1) > 0)
    return rewards, kl


def policy_loss(logp: torch.Tensor, behaviour_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                clip: float) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped surrogate against the behaviour policy (the engine's logprobs)."""
    log_ratio = (logp - behaviour_logp) * mask
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip, 1 + clip)
    loss = masked_mean(torch.maximum(unclipped, clipped), mask)
    with torch.no_grad():
        stats = {"ppo/clip_frac": masked_mean((clipped > unclipped).float(), mask).item(),
                 "ppo/approx_kl": masked_mean((ratio - 1) - log_ratio, mask).item(),
                 "ppo/ratio_mean": masked_mean(ratio, mask).item()}
    return loss, stats


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               clip: float) -> tuple[torch.Tensor, dict[str, float]]:
    """0.5 * max of the plain and the clipped squared error (values kept within ``clip`` of the old ones)."""
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    plain_err, clipped_err = (values - returns) ** 2, (clipped - returns) ** 2
    loss = 0.5 * masked_mean(torch.maximum(plain_err, clipped_err), mask)
    with torch.no_grad():
        stats = {"ppo/value_clip_frac": masked_mean((clipped_err > plain_err).float(), mask).item()}
    return loss, stats
