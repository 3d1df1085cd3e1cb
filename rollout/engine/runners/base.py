"""The contract every model runner implements, and the device work both runners share.

The engine calls ``execute(plan)`` and later ``pending.result()`` (vLLM's ``get_output()``
pattern): the synchronous CPU runner's pending step is complete when it is returned, the CUDA
runner's completes when its device-to-host copy lands. Carry-over is the runner's own business: a
plan only says "this input is the sequence's previous sample", and the runner remembers where it put
each sequence's last sample.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from rollout.engine.plan import BatchPlan, SampleResult
from rollout.engine.runners.inputs import HostInputs, PromptInputs
from rollout.engine.runners.prompt_logprobs import PromptLogprobs, compute_prompt_logprobs
from rollout.layers.attention_metadata import AttentionMetadata, DecodeRows
from rollout.layers.parallel_sampler import sample_vocab_parallel
from rollout.layers.sampler import Penalties, SamplingTensors, count_samples, top_logprobs

MAX_TOP = 20  # alternatives a step computes when any row asks (rows keep their own k)
# A mixed step gives its one-token sequences the decode kernel from this many on (fewer: the extra launches,
# eager, cost more than the prefill kernel's wasted tile rows save)
MIN_MIXED_DECODE_ROWS = 16

SAMPLING_FIELDS = (("temperature", torch.float32), ("top_k", torch.int64), ("top_p", torch.float32),
                   ("min_p", torch.float32), ("seed", torch.int64), ("position", torch.int64),
                   ("mode", torch.int64))
METADATA_FIELDS = (("positions", torch.int64), ("slot_mapping", torch.int64),
                   ("query_start_loc", torch.int32), ("seq_lens", torch.int32))


class PendingStep(Protocol):
    plan: BatchPlan

    def result(self) -> SampleResult:
        """Wait for the step's samples to reach the host and return them (once)."""
        ...


class Runner(Protocol):
    def execute(self, plan: BatchPlan) -> PendingStep:
        """Queue the plan's work; in async mode this returns before the device finishes."""
        ...

    def reset(self) -> None:
        """Forget every sequence's last sample (a step failed): the next plan carries nothing over."""
        ...

    def release(self) -> None:
        """Drop every reference to the KV cache's memory (engine.sleep)."""
        ...

    def restore(self) -> None:
        """The KV cache was allocated again (engine.wake_up)."""
        ...

    @property
    def compute_seconds(self) -> float | None:
        """Device time of every collected step so far (None where it is not measured: the CPU)."""
        ...


# ---- shared device work ---------------------------------------------------------------------
def copy_blocks(kv_layers: list[torch.Tensor], src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy-on-write: duplicate whole KV blocks ``src -> dst`` in every layer."""
    for cache in kv_layers:
        cache[:, dst] = cache[:, src]


def make_metadata(field: Callable[[str, torch.dtype], torch.Tensor], block_tables: torch.Tensor,
                  max_query_len: int, max_seq_len: int, decode_only: bool,
                  h: HostInputs | None = None) -> AttentionMetadata:
    """Attention metadata from the step's per-token / per-sequence tensors, however a runner stores them."""
    f = {name: field(name, dt) for name, dt in METADATA_FIELDS}
    return AttentionMetadata(
        positions=f["positions"], slot_mapping=f["slot_mapping"], query_start_loc=f["query_start_loc"],
        seq_lens=f["seq_lens"], block_tables=block_tables, max_query_len=max_query_len,
        max_seq_len=max_seq_len, decode_only=decode_only,
        query_lens_host=h.query_lens if h is not None else None,
        seq_lens_host=h.seq_lens if h is not None else None,
        decode_plans={},  # fresh metadata per forward: the decode partition is made once and shared by the layers
    )


def mixed_decode_rows(h: HostInputs, meta: AttentionMetadata) -> DecodeRows | None:
    """A mixed step's one-token sequences as ``DecodeRows`` (on meta's device; the index copy from pinned memory
    does not wait for the stream), or None for a decode-only step or one with fewer than
    ``MIN_MIXED_DECODE_ROWS`` of them."""
    if h.decode_only:
        return None
    seqs = [i for i, n in enumerate(h.query_lens) if n == 1]
    if len(seqs) < MIN_MIXED_DECODE_ROWS:
        return None
    device = meta.seq_lens.device
    pin = device.type == "cuda"
    both = torch.tensor([seqs, [h.query_start_loc[i] for i in seqs]], dtype=torch.int64, pin_memory=pin)
    seq_idx, token_idx = both.to(device, non_blocking=True).unbind(0)
    return DecodeRows(token_idx, meta.block_tables.index_select(0, seq_idx), meta.seq_lens.index_select(0, seq_idx),
                      decode_plans={})


def make_sampling(field: Callable[[str, torch.dtype], torch.Tensor], suppress: torch.Tensor | None,
                  variant: tuple[bool, ...], penalties: Penalties | None = None, num_top: int = 0) -> SamplingTensors:
    greedy, needs_filter = variant[:2]
    return SamplingTensors(**{name: field(name, dt) for name, dt in SAMPLING_FIELDS},
                           suppress_ids=suppress, needs_filter=needs_filter, all_greedy=greedy,
                           penalties=penalties, num_top_logprobs=num_top)


@dataclass(slots=True)
class StepOut:
    """A step's device results: samples (None when no row samples), top alternatives, prompt logprobs."""

    tokens: torch.Tensor | None
    logprobs: torch.Tensor | None
    top_ids: torch.Tensor | None = None  # [N, MAX_TOP]
    top_lps: torch.Tensor | None = None
    prompt: PromptLogprobs | None = None


def forward_and_sample(model: torch.nn.Module, kv_layers: list[torch.Tensor], attn_backend: object,
                       input_ids: torch.Tensor, meta: AttentionMetadata, sample_idx: torch.Tensor,
                       sampling: SamplingTensors | None, prompt: PromptInputs | None = None,
                       count: bool = True) -> StepOut | None:
    """The model over the flattened batch, then the sampler over the rows that sample (None: no row samples
    and no prompt logprobs are wanted). Penalised rows' samples are counted on the device here."""
    hidden = model(input_ids, meta.positions, kv_layers, meta, attn_backend)
    pl = compute_prompt_logprobs(model, hidden, prompt, input_ids.device) if prompt is not None else None
    if sampling is None:
        return None if pl is None else StepOut(None, None, prompt=pl)
    # On CUDA the fused sampler reads the lm_head's dtype; elsewhere the torch sampler gets float32.
    logits = model.compute_logits(hidden[sample_idx], float32=not hidden.is_cuda)
    # Under tensor parallelism the logits are this rank's vocabulary slice; at one rank this is ``sample``.
    tokens, lps = sample_vocab_parallel(logits, sampling, model.tp, model.vocab_start)
    out = StepOut(tokens, lps, prompt=pl)
    if sampling.num_top_logprobs:  # before the counts change: the distribution the token was drawn from
        out.top_ids, out.top_lps = top_logprobs(logits, sampling, sampling.num_top_logprobs)
    if sampling.penalties is not None and count:
        count_samples(sampling.penalties, tokens)
    return out


def host_top(ids: list[list[int]], lps: list[list[float]], rows: list[int], plans: list) -> list[list[tuple]]:
    """Per sampling row (its output row in ``rows``), its own k (token_id, logprob) pairs."""
    return [list(zip(ids[r][: sp.num_top_logprobs], lps[r][: sp.num_top_logprobs])) for r, sp in zip(rows, plans)]
