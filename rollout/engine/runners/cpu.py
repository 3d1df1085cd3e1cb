"""Runs a plan on the model: inputs -> forward -> sample. This one is the synchronous path that
works on any device (the CPU in CI); the CUDA runner adds streams, IO slots and graphs on top. Both
build inputs with ``inputs.build_host_inputs`` and run ``base.forward_and_sample``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rollout.engine.plan import BatchPlan, SampleResult
from rollout.engine.runners.base import (
    StepOut,
    copy_blocks,
    forward_and_sample,
    host_top,
    make_metadata,
    make_sampling,
)
from rollout.engine.runners.inputs import HostInputs, build_host_inputs
from rollout.engine.runners.kv_cache import KVCache
from rollout.engine.runners.penalties import PenaltyRows
from rollout.layers.sampler import Penalties, SamplingTensors


@dataclass(slots=True)
class CpuPendingStep:
    plan: BatchPlan
    tokens: torch.Tensor  # [num_sample_rows] int64
    logprobs: torch.Tensor
    out: StepOut | None = None
    h: HostInputs | None = None

    def result(self) -> SampleResult:
        res = SampleResult(self.plan.step_id, self.tokens.tolist(), self.logprobs.tolist())
        out, h = self.out, self.h
        if out is not None and out.top_ids is not None:
            rows = list(range(len(h.sample_plans)))
            res.top_logprobs = host_top(out.top_ids.tolist(), out.top_lps.tolist(), rows, h.sample_plans)
        if out is not None and out.prompt is not None:
            res.prompt_logprobs = out.prompt.to_host(False).spans()
        return res


class CpuRunner:
    def __init__(self, model: torch.nn.Module, kv: KVCache, block_size: int, attn_backend: object,
                 device: torch.device, max_num_seqs: int = 256) -> None:
        self.model, self.kv, self.block_size = model, kv, block_size
        self.attn_backend, self.device = attn_backend, device
        self.penalties = PenaltyRows(max_num_seqs, model.vocab_size, device)
        self._last_tokens: torch.Tensor | None = None  # the previous step's samples ...
        self._last_rows: dict[int, int] = {}  # ... and each sequence's row in them

    @torch.inference_mode()
    def execute(self, plan: BatchPlan) -> CpuPendingStep:
        h = build_host_inputs(plan, self.block_size)
        layers = self.kv.layers
        if plan.swap_out or plan.swap_in:
            self.kv.swap(plan.swap_out, plan.swap_in)
        if plan.block_copies:
            copy_blocks(layers, self._tensor([s for s, _ in plan.block_copies], torch.int64),
                        self._tensor([d for _, d in plan.block_copies], torch.int64))
        input_ids = self._tensor(h.input_ids, torch.int64)
        if h.carry_dst:
            assert self._last_tokens is not None, "carry-over without a previous step"
            rows = self._tensor([self._last_rows[s] for s in h.carry_seq], torch.int64)
            input_ids[self._tensor(h.carry_dst, torch.int64)] = self._last_tokens[rows]
        width = max(len(t) for t in h.block_tables)
        tables = self._tensor([t + [0] * (width - len(t)) for t in h.block_tables], torch.int32)
        meta = make_metadata(lambda name, dt: self._tensor(getattr(h, name), dt), tables,
                             h.max_query_len, h.max_seq_len, h.decode_only, h)
        out = forward_and_sample(self.model, layers, self.attn_backend, input_ids, meta,
                                 self._tensor(h.sample_idx, torch.int64), self._sampling(h), h.prompt)
        tokens, logprobs = torch.empty(0, dtype=torch.int64), torch.empty(0)
        if out is not None and out.tokens is not None:
            tokens, logprobs = out.tokens, out.logprobs
        self._last_tokens = tokens
        self._last_rows = {seq_id: i for i, seq_id in enumerate(h.sample_seq_ids)}
        return CpuPendingStep(plan, tokens, logprobs, out, h)

    def reset(self) -> None:
        self._last_tokens, self._last_rows = None, {}
        self.penalties.reset()

    def release(self) -> None:
        self.reset()
        self.penalties.release()

    def restore(self) -> None:
        pass  # reads ``kv.layers`` every step

    @property
    def compute_seconds(self) -> float | None:
        return None

    def _tensor(self, data: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(data, dtype=dtype, device=self.device)

    def _sampling(self, h: HostInputs) -> SamplingTensors | None:
        if not h.sample_idx:
            return None
        suppress = None
        if h.has_suppress:
            width = max(len(ids) for ids in h.suppress)
            suppress = self._tensor([list(ids) + [-1] * (width - len(ids)) for ids in h.suppress], torch.int64)
        pen = None
        if h.has_penalties:
            rows, new = self.penalties.assign(h.sample_plans)
            hist = self.penalties.build(new)
            settings = [sp.penalties or (1.0, 0.0, 0.0) for sp in h.sample_plans]
            pen = Penalties(hist, self._tensor(rows, torch.int64),
                            *(self._tensor([x[i] for x in settings], torch.float32) for i in range(3)))
        return make_sampling(lambda name, dt: self._tensor(getattr(h, name), dt), suppress, h.sampler_variant,
                             pen, h.num_top)
