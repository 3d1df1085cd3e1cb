"""Prompt logprobs (``SamplingParams.prompt_logprobs``, ``Engine.score``) from a step's hidden states.

The logits of a prompt position score the next prompt token under the request's own distribution
(``logprobs_mode`` and temperature, as its generated tokens are scored), so scoring a generated
sequence gives back the logprobs the generation returned. The lm_head runs over ``CHUNK`` rows at a
time, and on CUDA one fused pass per row (``kernels.token_logprobs``) reads its output without a float32 copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rollout.engine.runners.inputs import PromptInputs
from rollout.layers.sampler import MODE_RAW, SamplingTensors, mode_logprobs

CHUNK = 4096  # rows per lm_head call (bf16 logits: 1.2 GiB at qwen2.5's vocabulary)
FILTERED_CHUNK = 256  # processed logprobs under filters build several float32 [rows, vocab] tensors


@dataclass(slots=True)
class PromptLogprobs:
    """Device results of one step: a logprob per row, and its top alternatives when any span asks."""

    inputs: PromptInputs
    logprobs: torch.Tensor  # [P] float32
    top_ids: torch.Tensor | None = None  # [P, k] int64
    top_lps: torch.Tensor | None = None

    def to_host(self, non_blocking: bool) -> PromptLogprobs:
        """Copies on the current stream (the device tensors stay alive for it until the copies are done)."""

        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            if t.is_cuda:
                t.record_stream(torch.cuda.current_stream(t.device))
            return t.to("cpu", non_blocking=non_blocking)

        return PromptLogprobs(self.inputs, move(self.logprobs), move(self.top_ids), move(self.top_lps))

    def spans(self) -> list[tuple[int, int, list[float], list[list[tuple[int, float]]] | None]]:
        """Per sequence (seq_id, first position, logprobs, alternatives) on the host (call after ``to_host``)."""
        lps = self.logprobs.tolist()
        ids = self.top_ids.tolist() if self.top_ids is not None else None
        tls = self.top_lps.tolist() if self.top_lps is not None else None
        out, at = [], 0
        for seq_id, first, m, k in self.inputs.spans:
            tops = None
            if ids is not None:
                tops = [list(zip(ids[r][:k], tls[r][:k])) for r in range(at, at + m)]
            out.append((seq_id, first, lps[at : at + m], tops))
            at += m
        return out


def token_logprobs_torch(logits: torch.Tensor, inv: torch.Tensor,
                         targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprob of each row's target, logsumexp) of s = logits * inv: the fused kernel's specification."""
    s = logits.float() * inv[:, None]
    lse = torch.logsumexp(s, dim=-1)
    return s.gather(1, targets[:, None])[:, 0] - lse, lse


def compute_prompt_logprobs(model: torch.nn.Module, hidden: torch.Tensor, pr: PromptInputs,
                            device: torch.device) -> PromptLogprobs:
    pin = device.type == "cuda"

    def t(data: list, dtype: torch.dtype) -> torch.Tensor:
        # Pinned: a copy from pageable memory first waits for the stream, i.e. for this step's whole forward,
        # and the host could not prepare the next step meanwhile (scoring ran at 0.78 GPU busy).
        return torch.tensor(data, dtype=dtype, pin_memory=pin).to(device, non_blocking=True)

    idx, targets = t(pr.idx, torch.int64), t(pr.targets, torch.int64)
    temp, mode = t(pr.temperature, torch.float32), t(pr.mode, torch.int64)
    # policy (1 / T, or 1 when greedy) and raw (1) scale the logits as the sampler does
    inv = 1.0 / torch.where((temp == 0) | (mode == MODE_RAW), torch.ones_like(temp), temp)
    filt = pr.needs_filter
    st_all = None
    if filt:
        st_all = SamplingTensors(temp, t(pr.top_k, torch.int64), t(pr.top_p, torch.float32),
                                 t(pr.min_p, torch.float32), torch.zeros_like(idx), torch.zeros_like(idx), mode,
                                 needs_filter=True)
    k = min(pr.num_top, int(model.vocab_size))
    n = len(pr.idx)
    out = torch.empty(n, dtype=torch.float32, device=device)
    top_ids = torch.empty(n, k, dtype=torch.int64, device=device) if k else None
    top_lps = torch.empty(n, k, dtype=torch.float32, device=device) if k else None
    step = FILTERED_CHUNK if filt else CHUNK
    for a in range(0, n, step):
        b = min(n, a + step)
        h = hidden[idx[a:b]]
        if filt:  # processed logprobs under top-k / top-p / min-p: the sampler's whole distribution
            logits = model.compute_logits(h)
            st = SamplingTensors(*(getattr(st_all, f)[a:b] for f in
                                   ("temperature", "top_k", "top_p", "min_p", "seed", "position", "mode")),
                                 needs_filter=True)
            lp = mode_logprobs(logits, st)
            out[a:b] = lp.gather(1, targets[a:b, None])[:, 0]
            if k:
                top_lps[a:b], top_ids[a:b] = lp.topk(k, dim=-1)
            continue
        # the lm_head's own output (compute_logits is this plus .float()): no [rows, vocab] float32 copy on CUDA
        lm_head = getattr(model, "lm_head", None)
        logits = lm_head(h) if device.type == "cuda" and lm_head is not None else model.compute_logits(h)
        if device.type == "cuda":
            from rollout.kernels.token_logprobs import token_logprobs

            out[a:b], lse = token_logprobs(logits, inv[a:b].contiguous(), targets[a:b].contiguous())
        else:
            out[a:b], lse = token_logprobs_torch(logits, inv[a:b], targets[a:b])
        if k:  # 1 / T > 0 keeps the order: the top tokens of the raw logits
            vals, top_ids[a:b] = logits.topk(k, dim=-1)
            top_lps[a:b] = vals.float() * inv[a:b, None] - lse[:, None]
    return PromptLogprobs(pr, out, top_ids, top_lps)
