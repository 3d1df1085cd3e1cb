"""Runs a plan on the model: inputs -> forward -> sample. This one is the synchronous path that
works on any device (the CPU in CI); the CUDA runner adds streams, IO slots and graphs on top.

``execute`` returns a handle and ``collect`` reads it, so the engine loop is written once for both:
here the handle is already complete when ``execute`` returns.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rollout.engine.inputs import HostInputs, build_host_inputs
from rollout.engine.plan import BatchPlan, SampleResult
from rollout.layers.attention_metadata import AttentionMetadata
from rollout.layers.sampler import SamplingTensors, sample


@dataclass(slots=True)
class PendingStep:
    plan: BatchPlan
    tokens: torch.Tensor  # [num_sample_rows] int64 on the device (the carry-over source of the next step)
    logprobs: torch.Tensor


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], block_size: int,
                 attn_backend: object, device: torch.device) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.attn_backend = attn_backend
        self.device = device
        self.vocab_size: int = model.vocab_size
        self._last: PendingStep | None = None

    @torch.inference_mode()
    def execute(self, plan: BatchPlan) -> PendingStep:
        h = build_host_inputs(plan, self.block_size)
        self.copy_blocks(plan.block_copies)
        input_ids = self._tensor(h.input_ids, torch.int64)
        if h.carry_dst:
            assert self._last is not None, "carry-over without a previous step"
            src = self._last.tokens[self._tensor(h.carry_src, torch.int64)]
            input_ids[self._tensor(h.carry_dst, torch.int64)] = src
        meta = self.build_metadata(h)
        hidden = self.model(input_ids, meta.positions, self.kv_caches, meta, self.attn_backend)
        logits = self.model.compute_logits(hidden[self._tensor(h.sample_idx, torch.int64)])
        tokens, logprobs = sample(logits, self.sampling_tensors(h))
        self._last = PendingStep(plan, tokens, logprobs)
        return self._last

    def release(self) -> None:
        """Drop every reference to the KV cache (engine.sleep)."""
        self._last = None

    def restore(self, kv_caches: list[torch.Tensor]) -> None:
        self.kv_caches = kv_caches

    def collect(self, pending: PendingStep) -> SampleResult:
        return SampleResult(pending.plan.step_id, pending.tokens.tolist(), pending.logprobs.tolist())

    # ---- shared helpers (also used by the CUDA runner) -------------------------------------
    def _tensor(self, data: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(data, dtype=dtype, device=self.device)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if not copies:
            return
        src = self._tensor([s for s, _ in copies], torch.int64)
        dst = self._tensor([d for _, d in copies], torch.int64)
        for cache in self.kv_caches:
            cache[:, dst] = cache[:, src]

    def build_metadata(self, h: HostInputs) -> AttentionMetadata:
        width = max(len(t) for t in h.block_tables)
        tables = [t + [0] * (width - len(t)) for t in h.block_tables]
        return AttentionMetadata(
            positions=self._tensor(h.positions, torch.int64),
            slot_mapping=self._tensor(h.slot_mapping, torch.int64),
            query_start_loc=self._tensor(h.query_start_loc, torch.int32),
            seq_lens=self._tensor(h.seq_lens, torch.int32),
            block_tables=self._tensor(tables, torch.int32),
            max_query_len=h.max_query_len,
            max_seq_len=h.max_seq_len,
            decode_only=h.decode_only,
            query_lens_host=h.query_lens,
            seq_lens_host=h.seq_lens,
        )

    def sampling_tensors(self, h: HostInputs) -> SamplingTensors:
        suppress = None
        if any(h.suppress):
            width = max(len(ids) for ids in h.suppress)
            suppress = self._tensor([list(ids) + [-1] * (width - len(ids)) for ids in h.suppress], torch.int64)
        return SamplingTensors(
            temperature=self._tensor(h.temperature, torch.float32),
            top_k=self._tensor(h.top_k, torch.int64),
            top_p=self._tensor(h.top_p, torch.float32),
            min_p=self._tensor(h.min_p, torch.float32),
            seed=self._tensor(h.seed, torch.int64),
            position=self._tensor(h.position, torch.int64),
            mode=self._tensor(h.mode, torch.int64),
            suppress_ids=suppress,
            needs_filter=h.needs_filter,
            all_greedy=all(t == 0 for t in h.temperature),
        )
