"""The GPU fast path: three streams ordered by events, two IO slots, carry-over, CUDA graphs.

execute(plan N+1) returns as soon as the work is queued:
  host:    fill slot B's pinned buffers (slot B was last used by batch N-1, already collected)
  h2d:     wait "compute of N-1 done" (it read slot B's device buffers) -> copy pinned -> device
  compute: wait h2d; carry-over (batch N's sampled tokens, still on the device in slot A, are
           copied into the placeholder inputs); forward; sample -> slot B's output buffers
  d2h:     wait compute -> copy tokens and logprobs to pinned host memory
batch N's ``pending.result()`` waits only for its device-to-host event. The CPU therefore schedules and prepares
batch N+1 while the GPU runs batch N; the only blocking point is reading batch N's tokens.

Decode steps replay CUDA graphs captured per (slot, padded batch size, sampler variant), all from
one memory pool (graphs never run concurrently, so two slots cost about one).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rollout.engine.plan import BatchPlan, SampleResult
from rollout.engine.runners.base import (
    MAX_TOP,
    copy_blocks,
    forward_and_sample,
    host_top,
    make_metadata,
    make_sampling,
    mixed_decode_rows,
)
from rollout.engine.runners.graphs import UNEVEN, graph_sizes, padded_size, split_kind
from rollout.engine.runners.inputs import HostInputs, build_host_inputs
from rollout.engine.runners.io_slot import IOSlot, SlotShape
from rollout.engine.runners.kv_cache import KVCache
from rollout.engine.runners.penalties import PenaltyRows
from rollout.engine.runners.prompt_logprobs import PromptLogprobs
from rollout.layers.gemm_tune import GemmPick, tune_gemms
from rollout.layers.sampler import Penalties

_NO_PENALTIES = (1.0, 0.0, 0.0)


@dataclass(frozen=True, slots=True)
class StepRecord:
    decode: bool
    batch: int
    kv_tokens: int
    compute_ms: float
    graph_b: int = 0  # padded size of the replayed decode graph; 0 = eager
    split: int = 0  # the decode kernel's split kind (graphs.split_kind: UNEVEN, EVEN, UNIFORM)


@dataclass(slots=True)
class StepClock:
    """Compute-stream time of collected steps: the engine's GPU busy fraction, and per-step records
    for scripts/bench.py while ``record_steps`` is on."""

    total_ms: float = 0.0
    record_steps: bool = False
    records: list[StepRecord] = field(default_factory=list)


@dataclass(slots=True)
class CudaPendingStep:
    plan: BatchPlan
    slot: IOSlot
    rows: list[int]  # output-buffer row of each sampling sequence, in plan order
    decode: bool
    batch: int
    clock: StepClock
    h: HostInputs | None = None  # kept when the step returns top logprobs
    prompt: PromptLogprobs | None = None  # host copies, landed with d2h_done
    graph_b: int = 0  # padded size of the replayed decode graph; 0 = eager
    split: int = 0  # the decode kernel's split kind of this step

    def result(self) -> SampleResult:
        slot = self.slot
        slot.d2h_done.synchronize()
        toks, lps = slot.host_tokens.tolist(), slot.host_logprobs.tolist()
        ms = slot.compute_start.elapsed_time(slot.compute_end)
        self.clock.total_ms += ms
        if self.clock.record_steps:
            rec = StepRecord(self.decode, self.batch, self.plan.num_context_tokens, ms, self.graph_b, self.split)
            self.clock.records.append(rec)
        res = SampleResult(self.plan.step_id, [toks[r] for r in self.rows], [lps[r] for r in self.rows])
        if self.h is not None:
            res.top_logprobs = host_top(slot.host_top_ids.tolist(), slot.host_top_lps.tolist(), self.rows,
                                        self.h.sample_plans)
        if self.prompt is not None:
            res.prompt_logprobs = self.prompt.spans()
        return res


class CudaRunner:
    def __init__(self, model: torch.nn.Module, kv: KVCache, block_size: int,
                 attn_backend: object, device: torch.device, *, max_num_seqs: int, max_num_rows: int,
                 max_num_batched_tokens: int, max_model_len: int, cuda_graphs: bool,
                 max_graph_batch_size: int, gemm_autotune: bool = False) -> None:
        self.model, self.kv, self.block_size = model, kv, block_size
        self.attn_backend, self.device = attn_backend, device
        self.shape = SlotShape(
            max_tokens=max(max_num_batched_tokens, max_num_rows), max_seqs=max_num_rows,
            max_blocks=-(-max_model_len // block_size), max_suppress=16, max_copies=max_num_seqs,
        )
        self.slots = [IOSlot(i, self.shape, device) for i in range(2)]
        self.h2d = torch.cuda.Stream(device)
        self.compute = torch.cuda.Stream(device)
        self.d2h = torch.cuda.Stream(device)
        self.cuda_graphs = cuda_graphs
        self.mixed_decode = attn_backend.uses_decode_rows
        self.graph_sizes = graph_sizes(max_graph_batch_size, max_num_rows)
        self.graphs: dict[tuple[int, int, tuple[bool, ...], int], torch.cuda.CUDAGraph] = {}
        self.graph_pool = None
        self.gemm_autotune = gemm_autotune
        self.gemm_picks: dict[int, list[GemmPick]] = {}  # graph size -> its projections' tuned GEMMs
        self._next_slot = 0
        self._last_rows: dict[int, int] = {}  # seq_id -> its sample's row in the previous step's output buffer
        self.clock = StepClock()
        self.penalties = PenaltyRows(max_num_seqs, model.vocab_size, device)
        self.num_top = min(MAX_TOP, model.vocab_size)

    # ---- the step ----------------------------------------------------------------------------
    def execute(self, plan: BatchPlan) -> CudaPendingStep:
        slot = self.slots[self._next_slot]
        self._next_slot ^= 1
        h = build_host_inputs(plan, self.block_size)
        b, t = len(plan.seqs), len(h.input_ids)
        graph_b = self._graph_size(h)
        decode = h.decode_only
        # the decode kernel's split kind (graphs.split_kind): a graph per kind
        even = split_kind(h.seq_lens, getattr(self.attn_backend, "uniform_split", False)) if decode else UNEVEN
        if slot.used:
            slot.h2d_done.synchronize()  # the pinned buffers' last copy (two steps ago) is done
        pen_rows, pen_new = self.penalties.assign(h.sample_plans) if h.has_penalties else (None, [])
        rows = self._fill(slot, h, graph_b, plan.block_copies, pen_rows)
        variant = h.sampler_variant
        if variant[4]:
            slot.ensure_top(MAX_TOP)
        prompt = None
        with torch.cuda.stream(self.h2d):
            if slot.used:
                self.h2d.wait_event(slot.compute_done)
            for group in ("i64", "i32", "f32"):
                slot.dev[group].copy_(slot.host[group], non_blocking=True)
            slot.h2d_done.record(self.h2d)
        with torch.cuda.stream(self.compute):
            self.compute.wait_event(slot.h2d_done)
            if slot.used:
                self.compute.wait_event(slot.d2h_done)  # slot's outputs of two steps ago were read
            slot.compute_start.record(self.compute)
            if plan.swap_out or plan.swap_in:  # before anything writes a swapped-out block again
                self.kv.swap(plan.swap_out, plan.swap_in)
            if plan.block_copies:
                self._copy_blocks(slot, len(plan.block_copies))
            if h.has_penalties:
                self.penalties.build(pen_new)  # rows of sequences new to it, before anything reads them
            if graph_b:
                self._replay(slot, graph_b, variant, even)
            else:
                prompt = self._forward(slot, t, b, len(h.sample_idx), h, variant, even=even)
            slot.compute_end.record(self.compute)
            slot.compute_done.record(self.compute)
        with torch.cuda.stream(self.d2h):
            self.d2h.wait_event(slot.compute_done)
            n = graph_b or len(h.sample_idx)
            slot.host_tokens[:n].copy_(slot.out_tokens[:n], non_blocking=True)
            slot.host_logprobs[:n].copy_(slot.out_logprobs[:n], non_blocking=True)
            if variant[4]:
                slot.host_top_ids[:n].copy_(slot.out_top_ids[:n], non_blocking=True)
                slot.host_top_lps[:n].copy_(slot.out_top_lps[:n], non_blocking=True)
            if prompt is not None:
                prompt = prompt.to_host(non_blocking=True)
            slot.d2h_done.record(self.d2h)
        slot.used = True
        self._last_rows = dict(zip(h.sample_seq_ids, rows))
        return CudaPendingStep(plan, slot, rows, decode, b, self.clock, h if variant[4] else None, prompt, graph_b,
                               even)

    @property
    def compute_seconds(self) -> float | None:
        return self.clock.total_ms / 1e3

    def reset(self) -> None:
        self._last_rows = {}
        self.penalties.reset()

    # ---- host side ---------------------------------------------------------------------------
    def _graph_size(self, h: HostInputs) -> int:
        """Padded batch size of a captured decode graph, or 0 for an eager step."""
        if not (self.cuda_graphs and h.decode_only) or h.prompt is not None:
            return 0
        if any(len(s) > self.shape.max_suppress for s in h.suppress):
            return 0
        return padded_size(self.graph_sizes, len(h.input_ids))

    def _fill(self, slot: IOSlot, h: HostInputs, graph_b: int, copies: list[tuple[int, int]],
              pen_rows: list[int] | None) -> list[int]:
        """Write the step's inputs into the slot's pinned buffers; returns each sample's output row."""
        t, b = len(h.input_ids), len(h.seq_lens)
        tt, bb = (graph_b, graph_b) if graph_b else (t, b)
        v = slot.host_view
        v("input_ids")[:t] = h.input_ids
        v("positions")[:t] = h.positions
        v("slot_mapping")[:t] = h.slot_mapping
        carry = v("carry")
        carry[:tt] = -1
        for dst, seq_id in zip(h.carry_dst, h.carry_seq):
            carry[dst] = self._last_rows[seq_id]
        v("query_start_loc")[: b + 1] = h.query_start_loc
        v("seq_lens")[:b] = h.seq_lens
        tables = v("block_tables").reshape(self.shape.max_seqs, self.shape.max_blocks)
        for i, table in enumerate(h.block_tables):
            tables[i, : len(table)] = table
        if graph_b:  # padding rows: no KV write, empty context, neutral greedy sampling
            v("input_ids")[t:tt], v("positions")[t:tt], v("slot_mapping")[t:tt] = 0, 0, -1
            v("query_start_loc")[b + 1 : bb + 1] = range(t + 1, tt + 1)
            v("seq_lens")[b:bb] = 0
            rows = list(h.sample_seq)  # every row is sampled; keep those of sampling sequences
            v("sample_idx")[:bb] = range(bb)
            n_rows = bb
        else:
            rows = list(range(len(h.sample_idx)))
            v("sample_idx")[: len(h.sample_idx)] = h.sample_idx
            n_rows = len(h.sample_idx)
        self._fill_sampling(slot, h, rows, n_rows)
        if pen_rows is not None:
            self._fill_penalties(slot, h, rows, n_rows, pen_rows)
        if copies:
            assert len(copies) <= self.shape.max_copies
            v("copy_src")[: len(copies)] = [s for s, _ in copies]
            v("copy_dst")[: len(copies)] = [d for _, d in copies]
        return rows

    def _fill_sampling(self, slot: IOSlot, h: HostInputs, rows: list[int], n_rows: int) -> None:
        v = slot.host_view
        temp, top_k, top_p, min_p = v("temperature"), v("top_k"), v("top_p"), v("min_p")
        seed, pos, mode = v("seed"), v("position"), v("mode")
        sup = v("suppress").reshape(self.shape.max_seqs, self.shape.max_suppress)
        temp[:n_rows], top_k[:n_rows], top_p[:n_rows], min_p[:n_rows] = 0.0, 0, 1.0, 0.0
        seed[:n_rows], pos[:n_rows], mode[:n_rows] = 0, 0, 0
        sup[:n_rows] = -1
        if rows:
            temp[rows], top_k[rows], top_p[rows], min_p[rows] = h.temperature, h.top_k, h.top_p, h.min_p
            seed[rows], pos[rows], mode[rows] = h.seed, h.position, h.mode
        for j, r in enumerate(rows):
            if h.suppress[j]:
                sup[r, : len(h.suppress[j])] = h.suppress[j]

    def _fill_penalties(self, slot: IOSlot, h: HostInputs, rows: list[int], n_rows: int,
                        pen_rows: list[int]) -> None:
        v = slot.host_view
        hist_row, rep, pres, freq = v("hist_row"), v("repetition"), v("presence"), v("frequency")
        hist_row[:n_rows], rep[:n_rows], pres[:n_rows], freq[:n_rows] = self.penalties.zero_row, 1.0, 0.0, 0.0
        if rows:
            at = slice(rows[0], rows[0] + len(rows)) if rows[-1] - rows[0] + 1 == len(rows) else rows
            hist_row[at] = pen_rows
            rep[at], pres[at], freq[at] = zip(*[sp.penalties or _NO_PENALTIES for sp in h.sample_plans])

    # ---- device side -------------------------------------------------------------------------
    def _copy_blocks(self, slot: IOSlot, n: int) -> None:
        copy_blocks(self.kv.layers, slot.dev_view("copy_src", n), slot.dev_view("copy_dst", n))

    def _forward(self, slot: IOSlot, t: int, b: int, n_rows: int, h: HostInputs | None,
                 variant: tuple[bool, ...], count: bool = True, even: int = UNEVEN) -> PromptLogprobs | None:
        """Carry-over, forward and sampling on slot views; graph-capturable when ``h`` is None. ``count``:
        add the samples to the penalty counts (not in a graph's eager warm-up, whose replay counts them).
        ``even``: a decode step's split kind (graphs.split_kind; ``AttentionMetadata.decode_even_lengths``)."""
        prev = self.slots[slot.index ^ 1].out_tokens
        carry = slot.dev_view("carry", t)
        ids = torch.where(carry >= 0, prev[carry.clamp(min=0)], slot.dev_view("input_ids", t))
        tables = slot.dev_view("block_tables", b * self.shape.max_blocks).view(b, self.shape.max_blocks)
        per_seq = {"query_start_loc": b + 1, "seq_lens": b}
        meta = make_metadata(
            lambda name, _dt: slot.dev_view(name, per_seq.get(name, t)), tables,
            h.max_query_len if h else 1, h.max_seq_len if h else self.shape.max_blocks * self.block_size,
            h.decode_only if h else True,
        )
        meta.decode_even_lengths = even
        if h is not None and self.mixed_decode:
            meta.decode_rows = mixed_decode_rows(h, meta)
        sampling = None
        if n_rows:
            suppress = None
            if variant[2]:
                suppress = slot.dev_view("suppress", n_rows * self.shape.max_suppress).view(
                    n_rows, self.shape.max_suppress)
            pen = None
            if variant[3]:
                pen = Penalties(self.penalties.hist, *(slot.dev_view(name, n_rows) for name in
                                                       ("hist_row", "repetition", "presence", "frequency")))
            sampling = make_sampling(lambda name, _dt: slot.dev_view(name, n_rows), suppress, variant, pen,
                                     self.num_top if variant[4] else 0)
        out = forward_and_sample(self.model, self.kv.layers, self.attn_backend, ids, meta,
                                 slot.dev_view("sample_idx", n_rows), sampling, h.prompt if h else None, count)
        if out is None:
            return None
        if out.tokens is not None:  # None: a prefill chunk that samples nothing
            slot.out_tokens[:n_rows].copy_(out.tokens)
            slot.out_logprobs[:n_rows].copy_(out.logprobs)
        if out.top_ids is not None:
            slot.out_top_ids[:n_rows, : self.num_top].copy_(out.top_ids)
            slot.out_top_lps[:n_rows, : self.num_top].copy_(out.top_lps)
        return out.prompt

    def _replay(self, slot: IOSlot, b: int, variant: tuple[bool, ...], even: int) -> None:
        key = (slot.index, b, variant, even)
        graph = self.graphs.get(key)
        if graph is None:
            if self.gemm_autotune and b not in self.gemm_picks:  # before the warm-up, which compiles the picks
                self.gemm_picks[b] = tune_gemms(self.model, b)
            # Warm up eagerly (compiles Triton kernels; computes exactly what the replay recomputes),
            # then capture on the compute stream into the shared pool.
            self._forward(slot, b, b, b, None, variant, count=False, even=even)
            if self.graph_pool is None:
                self.graph_pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.graph_pool, stream=self.compute):
                self._forward(slot, b, b, b, None, variant, even=even)
            self.graphs[key] = graph
        graph.replay()

    # ---- memory ------------------------------------------------------------------------------
    def release(self) -> None:
        """engine.sleep: graphs hold the KV cache's addresses, so they go too."""
        torch.cuda.synchronize(self.device)
        self.graphs.clear()
        self.graph_pool = None
        self.reset()
        self.penalties.release()

    def restore(self) -> None:
        pass  # graphs are captured again, against ``kv.layers``, on first use
