"""Turn a BatchPlan into the flat host arrays every runner needs (plain Python, no device work).

The one place a plan becomes inputs: the CPU runner wraps them in tensors; the CUDA runner copies them
into pinned IO-slot buffers. Carry-over is given by sequence id (``carry_seq``); each runner maps that
to wherever it left the sequence's previous sample.
"""

from __future__ import annotations

from dataclasses import dataclass

from rollout.engine.plan import BatchPlan, SeqPlan
from rollout.layers.sampler import MODES


@dataclass(slots=True)
class HostInputs:
    input_ids: list[int]  # placeholders (-1) already zeroed; carry fills them on the device
    positions: list[int]
    slot_mapping: list[int]
    query_start_loc: list[int]
    seq_lens: list[int]
    query_lens: list[int]
    block_tables: list[list[int]]  # ragged; padded by the runner
    sample_idx: list[int]  # flat index of the token whose logits are sampled, per sampling row
    sample_seq: list[int]  # batch index of each sampling row's sequence
    sample_seq_ids: list[int]  # seq_id of each sampling row (where the runner will find it next step)
    carry_dst: list[int]  # flat input index to fill ...
    carry_seq: list[int]  # ... with this sequence's sample from the previous step
    temperature: list[float]
    top_k: list[int]
    top_p: list[float]
    min_p: list[float]
    seed: list[int]
    position: list[int]
    mode: list[int]
    suppress: list[tuple[int, ...]]
    needs_filter: bool
    max_query_len: int
    max_seq_len: int
    decode_only: bool
    sample_plans: list[SeqPlan]  # the sampling rows' plans (top logprobs, penalties and their history)
    num_top: int = 0  # most alternatives a sampling row asks for (0: none)
    has_penalties: bool = False
    prompt: PromptInputs | None = None  # prompt logprobs wanted by this step

    @property
    def all_greedy(self) -> bool:
        return all(t == 0 for t in self.temperature)

    @property
    def has_suppress(self) -> bool:
        return any(self.suppress)

    @property
    def sampler_variant(self) -> tuple[bool, bool, bool, bool, bool]:
        """What selects a sampler code path (and a captured graph): greedy, filtered, suppressed ids,
        penalties, top logprobs."""
        return (self.all_greedy, self.needs_filter, self.has_suppress, self.has_penalties, self.num_top > 0)


@dataclass(slots=True)
class PromptInputs:
    """Prompt logprobs: the flat token indices whose logits score a prompt token, and each row's settings."""

    idx: list[int]
    targets: list[int]
    temperature: list[float]
    top_k: list[int]
    top_p: list[float]
    min_p: list[float]
    mode: list[int]
    spans: list[tuple[int, int, int, int]]  # per sequence: (seq_id, first position, rows, alternatives)

    @property
    def num_top(self) -> int:
        return max(k for *_, k in self.spans)

    @property
    def needs_filter(self) -> bool:
        return any(k > 0 or p < 1.0 or m > 0.0 for k, p, m in zip(self.top_k, self.top_p, self.min_p))


def _add_prompt_rows(h: HostInputs, sp: SeqPlan, base: int) -> None:
    """Rows for the chunk positions prompt_first .. (input index = position - start_pos)."""
    if h.prompt is None:
        h.prompt = PromptInputs([], [], [], [], [], [], [], [])
    pr, m = h.prompt, len(sp.prompt_targets)
    off = base + sp.prompt_first - sp.start_pos
    pr.idx.extend(range(off, off + m))
    pr.targets.extend(sp.prompt_targets)
    pr.temperature.extend([sp.temperature] * m)
    pr.top_k.extend([sp.top_k] * m)
    pr.top_p.extend([sp.top_p] * m)
    pr.min_p.extend([sp.min_p] * m)
    pr.mode.extend([MODES[sp.logprobs_mode]] * m)
    pr.spans.append((sp.seq_id, sp.prompt_first, m, sp.prompt_top))


def build_host_inputs(plan: BatchPlan, block_size: int) -> HostInputs:
    if plan.decode_only and not plan.has_prompt_logprobs:
        return _build_decode(plan, block_size)
    h = HostInputs([], [], [], [0], [], [], [], [], [], [], [], [], [], [], [], [], [], [], [], [], False, 0, 0, True,
                   [])
    for sp in plan.seqs:
        n = len(sp.input_ids)
        base = len(h.input_ids)
        if sp.carry:
            h.carry_dst.append(base + n - 1)
            h.carry_seq.append(sp.seq_id)
        h.input_ids.extend(t if t >= 0 else 0 for t in sp.input_ids)
        table = sp.block_table
        for p in range(sp.start_pos, sp.start_pos + n):
            h.positions.append(p)
            h.slot_mapping.append(table[p // block_size] * block_size + p % block_size)
        h.query_start_loc.append(base + n)
        h.seq_lens.append(sp.seq_len)
        h.query_lens.append(n)
        h.block_tables.append(table)
        h.max_query_len = max(h.max_query_len, n)
        h.max_seq_len = max(h.max_seq_len, sp.seq_len)
        h.decode_only = h.decode_only and n == 1
        if sp.prompt_targets:
            _add_prompt_rows(h, sp, base)
        if sp.sample:
            h.sample_plans.append(sp)
            h.num_top = max(h.num_top, sp.num_top_logprobs)
            h.has_penalties = h.has_penalties or sp.penalties is not None
            h.sample_idx.append(base + n - 1)
            h.sample_seq.append(len(h.seq_lens) - 1)
            h.sample_seq_ids.append(sp.seq_id)
            h.temperature.append(sp.temperature)
            h.top_k.append(sp.top_k)
            h.top_p.append(sp.top_p)
            h.min_p.append(sp.min_p)
            h.seed.append(sp.seed)
            h.position.append(sp.sample_pos)
            h.mode.append(MODES[sp.logprobs_mode])
            h.suppress.append(sp.suppress_ids)
            h.needs_filter = h.needs_filter or sp.top_k > 0 or sp.top_p < 1.0 or sp.min_p > 0.0
    return h


def _build_decode(plan: BatchPlan, bs: int) -> HostInputs:
    """The hot path (one token per sequence), written as comprehensions: ~3x faster than the loop."""
    seqs = plan.seqs
    b = len(seqs)
    pos = [sp.start_pos for sp in seqs]
    samp = [i for i, sp in enumerate(seqs) if sp.sample]
    ss = [seqs[i] for i in samp]
    carry = [(i, sp.seq_id) for i, sp in enumerate(seqs) if sp.carry]
    ids = [sp.input_ids[0] for sp in seqs]
    return HostInputs(
        input_ids=[t if t >= 0 else 0 for t in ids],
        positions=pos,
        slot_mapping=[sp.block_table[p // bs] * bs + p % bs for sp, p in zip(seqs, pos)],
        query_start_loc=list(range(b + 1)),
        seq_lens=[p + 1 for p in pos],
        query_lens=[1] * b,
        block_tables=[sp.block_table for sp in seqs],
        sample_idx=samp,
        sample_seq=samp,
        sample_seq_ids=[sp.seq_id for sp in ss],
        carry_dst=[i for i, _ in carry],
        carry_seq=[c for _, c in carry],
        temperature=[sp.temperature for sp in ss],
        top_k=[sp.top_k for sp in ss],
        top_p=[sp.top_p for sp in ss],
        min_p=[sp.min_p for sp in ss],
        seed=[sp.seed for sp in ss],
        position=[sp.sample_pos for sp in ss],
        mode=[MODES[sp.logprobs_mode] for sp in ss],
        suppress=[sp.suppress_ids for sp in ss],
        needs_filter=any(sp.top_k > 0 or sp.top_p < 1.0 or sp.min_p > 0.0 for sp in ss),
        max_query_len=1,
        max_seq_len=max(pos) + 1 if pos else 0,
        decode_only=True,
        sample_plans=ss,
        num_top=max((sp.num_top_logprobs for sp in ss), default=0),
        has_penalties=any(sp.penalties is not None for sp in ss),
    )
