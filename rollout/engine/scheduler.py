"""Continuous batching: decide which sequences compute which tokens this step. No torch.

Policy (vLLM v1's "no phases"): running sequences first, oldest first, each asking for the tokens
it has not computed yet (one for decode, a chunk for a prefill); then waiting sequences FIFO while
the token budget, ``max_num_seqs`` and free blocks allow. When blocks run out the newest running
sequence is preempted, so the oldest always progresses and nothing is lost.

Swap or recompute (the rule): a preempted sequence is swapped to the host pool when it holds at least
``SWAP_MIN_BLOCKS`` blocks of its own (ref_count 1) and the pool has room for them; its shared blocks (a
group's prompt, prefix hits) stay on the device, still held. Otherwise its KV is freed and recomputed on
readmission (shared blocks then come back as prefix hits, so recompute also costs only its own tokens).
Re-prefilling a short context is cheaper than a round trip over PCIe; a long one is not. A swapped
sequence resumes with its ``num_computed_tokens`` (no recompute).

Admission watermark: a waiting sequence is admitted only if, after its blocks, the free blocks still
cover one new block for each running (and just admitted) sequence whose next two tokens cross its last
block, so the step after next does not have to preempt what this one admitted.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass

from rollout.engine.block_manager import BlockManager
from rollout.engine.extras import add_prompt_targets, add_sample_extras, apply_prompt_logprobs
from rollout.engine.plan import BatchPlan, SampleResult, SeqPlan
from rollout.engine.sequence import PLACEHOLDER, Request, Sequence, SequenceStatus
from rollout.engine.stop import check_stop

TURN_ROWS_CONTEXT = 1 << 18  # per step, a sequence's decode rows x its context stay under this many tokens
SWAP_MIN_BLOCKS = 2  # computed context (in blocks) from which a preempted sequence is swapped, not recomputed
WATERMARK_STEPS = 2  # admission keeps a block for each running sequence crossing a block within this many tokens


@dataclass(frozen=True, slots=True)
class SchedulerLimits:
    max_num_seqs: int
    max_num_batched_tokens: int
    turn_prefill_hold_steps: int = 0  # a resumed conversation's given tokens wait up to this many steps (turns.py)
    turn_rows_max_tokens: int = 0  # given tokens up to this many are computed as one-token decode rows (0 = off)
    max_num_rows: int = 0  # rows of a step: one per sequence plus replies' extra rows (0 = max_num_seqs)

    @property
    def rows(self) -> int:
        return max(self.max_num_rows, self.max_num_seqs)


class Scheduler:
    """Owns every request from admission to its end: plans steps, applies their samples, checks stops.

    ``detokenize`` (ids -> text) is only needed for stop strings; it is an opaque callable, so no
    tokenizer or torch is imported here.
    """

    def __init__(self, limits: SchedulerLimits, block_manager: BlockManager,
                 detokenize: Callable[[list[int]], str] | None = None) -> None:
        self.limits = limits
        self.block_manager = block_manager
        self.detokenize = detokenize
        self.waiting: list[Sequence] = []  # sorted by (priority, arrival, seq_id)
        self.running: list[Sequence] = []  # sorted by (priority, arrival, seq_id)
        self.requests: dict[str, Request] = {}
        self.seqs: dict[int, Sequence] = {}
        self.num_preemptions = 0
        self.num_generated_tokens = 0  # samples applied to a live sequence (late, dropped ones not counted)
        # Requests whose first token landed, their prompt tokens, and how many of those the prefix cache held
        # (time to first token and the hit rate are windows over these).
        self.num_first_tokens = self.num_started_prompt_tokens = self.num_prefix_cached_tokens = 0
        self.num_swapped_out_blocks = 0
        self.num_swap_outs = 0  # preemptions by swap (sequences)
        self.num_swap_ins = 0
        self._swap_out: list[tuple[int, int]] = []  # this step's (gpu, host) copies
        self._swapped_now: list[Sequence] = []
        self._step_id = 0
        self._rows: dict[int, int] = {}  # this step's sequences computed as decode rows: seq_id -> rows
        self._extra_rows = 0  # rows beyond one per chosen sequence (they count against limits.rows)
        self.parked: dict[str, Request] = {}  # multi-turn requests between turns, KV kept (engine/turns.py)
        self.num_prefill_tokens = 0  # tokens computed that were not the newest sample (prompt, env, recompute)

    # ---- admission and removal -------------------------------------------------------------
    def add(self, request: Request) -> None:
        assert request.request_id not in self.requests, request.request_id
        self.requests[request.request_id] = request
        for seq in request.seqs:
            self.seqs[seq.seq_id] = seq
            self._insert(self.waiting, seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """End a sequence: drop pending placeholders (a late stop's extra token) and free its blocks."""
        if seq.is_finished:
            return
        if seq.num_inflight:
            del seq.token_ids[len(seq.token_ids) - seq.num_inflight :]
            seq.num_inflight = 0
        seq.status, seq.finish_reason, seq.stop_reason = SequenceStatus.FINISHED, reason, stop_reason
        if not self._remove(self.running, seq):
            self._remove(self.waiting, seq)
        if seq.keep_kv and reason != "abort":  # a turn ended: the conversation goes on from this KV
            seq.park_step = self._step_id
            self.parked[seq.request_id] = self.requests[seq.request_id]
            del self.seqs[seq.seq_id]
            return
        self.block_manager.free(seq)
        del self.seqs[seq.seq_id]

    def abort(self, request_id: str) -> Request | None:
        """Finish every sample of the request with ``"abort"``; returns it (removed), or None if unknown."""
        request = self.requests.get(request_id)
        if request is not None:
            for seq in request.seqs:
                self.finish(seq, "abort")
            self._pop_finished(request_id)
        return request

    def _pop_finished(self, request_id: str) -> Request | None:
        request = self.requests.get(request_id)
        if request is not None and request.finished:
            return self.requests.pop(request_id)
        return None

    # ---- one step ----------------------------------------------------------------------------
    def schedule(self, policy_version: int = 0) -> BatchPlan | None:
        budget = self.limits.max_num_batched_tokens
        chosen: list[tuple[Sequence, int]] = []
        copies: list[tuple[int, int]] = []
        swap_in: list[tuple[int, int]] = []
        self._swap_out, self._swapped_now = [], []
        preempted = False
        held: list[Sequence] = []
        self._rows, self._extra_rows = {}, 0
        running = list(self.running)
        for i, seq in enumerate(running):
            if not self._room(chosen) or budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = self._num_new_tokens(seq, budget)
            if n == 0:
                continue
            if n > 1 and seq.hold_until > self._step_id:
                held.append(seq)  # a conversation's given tokens: batched with others' (below)
                continue
            rows = n > 1 and self._as_rows(seq)
            if rows:  # one row each, as many as fit beside one for every running sequence after it
                room = self.limits.rows - len(chosen) - self._extra_rows - (len(running) - i - 1)
                n = max(1, min(n, room, TURN_ROWS_CONTEXT // (seq.num_computed_tokens + n)))
            if n == 1 and self._fits_in_last_block(seq):
                chosen.append((seq, 1))  # the common decode step: no block-manager work at all
                budget -= 1
                continue
            while not self.block_manager.can_append(seq, n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status is SequenceStatus.RUNNING:
                copies += self.block_manager.append_slots(seq, n)
                chosen.append((seq, n))
                budget -= n
                if rows and n > 1:
                    self._rows[seq.seq_id] = n
                    self._extra_rows += n - 1
        if not preempted:
            budget = self._admit(chosen, copies, swap_in, budget)
        if held and (not chosen or any(n > 1 for _, n in chosen)):
            budget = self._release_held(held, chosen, copies, budget)
        if not chosen:
            for seq in self._swapped_now:  # no step runs the copies: recompute these instead
                self.block_manager.free(seq, register=False)
                self.num_swap_outs -= 1
            return None
        plan = self._make_plan(chosen, copies, policy_version)
        plan.swap_out, plan.swap_in = self._swap_out, swap_in
        self.num_swapped_out_blocks += len(self._swap_out)
        return plan

    def _release_held(self, held: list[Sequence], chosen: list[tuple[Sequence, int]], copies: list[tuple[int, int]],
                      budget: int) -> int:
        """Held given tokens join a step that computes more than one token for some sequence anyway (so runs
        eagerly, not from a decode graph), or one that would otherwise have nothing to run."""
        for seq in held:
            n = self._num_new_tokens(seq, budget) if self._room(chosen) else 0
            if n and self.block_manager.can_append(seq, n):
                copies += self.block_manager.append_slots(seq, n)
                chosen.append((seq, n))
                budget -= n
        return budget

    def _room(self, chosen: list[tuple[Sequence, int]]) -> bool:
        """Another sequence fits in this step: under ``max_num_seqs`` sequences and under the rows cap."""
        return len(chosen) < self.limits.max_num_seqs and len(chosen) + self._extra_rows < self.limits.rows

    def _watermark(self, chosen: list[tuple[Sequence, int]]) -> int:
        """Blocks to keep free: one per chosen sequence whose next ``WATERMARK_STEPS`` tokens leave its table."""
        bs = self.block_manager.block_size
        return sum(seq.num_computed_tokens + n + WATERMARK_STEPS > len(seq.block_table) * bs for seq, n in chosen)

    def _swap_in(self, seq: Sequence, budget: int, reserve: int, swap_in: list[tuple[int, int]]) -> int:
        """Resume a swapped sequence if its blocks (and the watermark) fit; returns its tokens (0: not now)."""
        bm = self.block_manager
        n = self._num_new_tokens(seq, budget)
        table = bm.swapped_table_len(seq)
        need = bm.num_swap_in_blocks(seq) + max(0, -(-(seq.num_computed_tokens + n) // bm.block_size) - table)
        if n == 0 or need + reserve > bm.num_free_blocks:
            return 0
        swap_in += bm.swap_in(seq)
        self.num_swap_ins += 1
        return n

    def _admit(self, chosen: list[tuple[Sequence, int]], copies: list[tuple[int, int]],
               swap_in: list[tuple[int, int]], budget: int) -> int:
        admitted: set[int] = set()
        bm = self.block_manager
        reserve = self._watermark(chosen)  # kept up to date as sequences are admitted
        for seq in list(self.waiting):
            if not self._room(chosen) or budget == 0:
                break
            if seq.num_inflight:
                continue  # preempted with a sample still in flight; re-admit once it lands
            parent = seq.parent
            if bm.is_swapped(seq):
                n = self._swap_in(seq, budget, reserve, swap_in)
                if n == 0:
                    break
                copies += bm.append_slots(seq, n)
                self._start(seq, n, chosen, admitted)
                reserve += self._watermark(chosen[-1:])
                budget -= n
                continue
            if parent is not None and parent.status is SequenceStatus.RUNNING:
                if parent.num_computed_tokens < seq.num_prompt_tokens - 1 or parent.seq_id in admitted:
                    continue  # wait until the parent's prompt KV is computed (in an earlier step), then share it
                self.block_manager.fork(parent, seq, seq.num_prompt_tokens - 1)
            else:
                self.block_manager.allocate_prefix(seq)
            n = self._num_new_tokens(seq, budget)
            if n == 0 or bm.num_blocks_needed(seq, n) + reserve > bm.num_free_blocks:
                self.block_manager.free(seq)
                break  # FIFO: do not let later requests overtake this one
            copies += self.block_manager.append_slots(seq, n)
            self._start(seq, n, chosen, admitted)
            reserve += self._watermark(chosen[-1:])
            budget -= n
        return budget

    def _start(self, seq: Sequence, n: int, chosen: list[tuple[Sequence, int]], admitted: set[int]) -> None:
        self._remove(self.waiting, seq)
        seq.status = SequenceStatus.RUNNING
        if seq.num_first_cached_tokens < 0:
            seq.num_first_cached_tokens = seq.num_cached_tokens
        self._insert(self.running, seq)
        admitted.add(seq.seq_id)
        chosen.append((seq, n))

    def _fits_in_last_block(self, seq: Sequence) -> bool:
        """The next position lies in the sequence's own, unshared, partly filled last block."""
        table, bs = seq.block_table, self.block_manager.block_size
        pos = seq.num_computed_tokens
        return (bool(table) and (len(table) - 1) * bs < pos < len(table) * bs
                and self.block_manager.blocks[table[-1]].ref_count == 1)

    def _as_rows(self, seq: Sequence) -> bool:
        """A resumed conversation's given tokens (past its prompt, at most ``turn_rows_max_tokens`` of them) go
        as one-token rows, each attending to the KV the rows before it wrote in the same layer: the step stays a
        decode step (a graph replay on the GPU) instead of an eager one for a few tokens of prefill."""
        pending = seq.num_tokens - seq.num_computed_tokens
        return (pending <= self.limits.turn_rows_max_tokens and seq.num_computed_tokens >= seq.num_prompt_tokens
                and not seq.score_only)

    def _num_new_tokens(self, seq: Sequence, budget: int) -> int:
        target = seq.num_tokens
        if seq.num_output_tokens >= seq.params.max_tokens:
            target -= 1  # the final token is never an input, so its KV is never needed
        return max(0, min(target - seq.num_computed_tokens, budget))

    def _make_plan(
        self, chosen: list[tuple[Sequence, int]], copies: list[tuple[int, int]], policy_version: int
    ) -> BatchPlan:
        plans: list[SeqPlan] = []
        num_prompt = 0
        has_prompt_lp, score_done = False, []
        for seq, n in chosen:
            start = seq.num_computed_tokens
            inputs = seq.token_ids[start : start + n]
            carry = inputs[-1] == PLACEHOLDER
            assert n == 1 or PLACEHOLDER not in inputs[:-1], "only the newest token can be in flight"
            sample = start + n == seq.num_tokens
            if seq.score_only and sample:
                sample = False
                score_done.append(seq.seq_id)
            self.num_prefill_tokens += n - (start == seq.decode_pos)
            num_prompt += max(0, min(start + n, seq.num_prompt_tokens) - start)
            p = seq.params
            head = n - 1 if seq.seq_id in self._rows else 0  # decode rows: all but the last token, no sample
            plans += [SeqPlan(seq.seq_id, [tok], start + j, seq.block_table, False) for j, tok in
                      enumerate(inputs[:head])]
            inputs, first = inputs[head:], start + head
            # The table is shared, not copied: runners read it before the next schedule() changes it.
            if sample:
                plan = SeqPlan(seq.seq_id, inputs, first, seq.block_table, True, carry, p.temperature,
                               p.effective_top_k, p.top_p, p.min_p, seq.sample_seed, seq.num_output_tokens,
                               p.logprobs_mode, seq.stop_ids if seq.num_output_tokens < p.min_tokens else ())
                if p.logprobs is not None or p.has_penalties:
                    add_sample_extras(plan, seq)
                seq.decode_pos = len(seq.token_ids)
                seq.token_ids.append(PLACEHOLDER)
                seq.num_inflight += 1
            else:
                plan = SeqPlan(seq.seq_id, inputs, first, seq.block_table, False, carry)
            if seq.prompt_lp_start >= 0 and start < seq.num_prompt_tokens - 1:
                has_prompt_lp = add_prompt_targets(plan, seq, start, n) or has_prompt_lp
            seq.num_computed_tokens = start + n
            plans.append(plan)
        self._step_id += 1
        batch = BatchPlan(self._step_id, plans, copies, policy_version, num_prompt)
        batch.has_prompt_logprobs, batch.score_done = has_prompt_lp, score_done
        return batch

    def update_from_output(self, plan: BatchPlan, result: SampleResult) -> list[Request]:
        """Apply a step's samples: fill placeholders, tag each token with the plan's weights version,
        check stops and free what finished. Returns the requests that finished (removed from here).

        A sample for a sequence that finished meanwhile (an async late stop, an abort) is dropped.
        """
        assert result.step_id == plan.step_id, (result.step_id, plan.step_id)
        finished: list[Request] = []
        if result.prompt_logprobs:
            apply_prompt_logprobs(self.requests, self.seqs, result)
        tops = result.top_logprobs or [None] * len(result.token_ids)
        for sp, tok, lp, top in zip(plan.sample_seqs, result.token_ids, result.logprobs, tops, strict=True):
            seq = self.seqs.get(sp.seq_id)
            if seq is None or seq.num_inflight == 0:
                continue
            idx = len(seq.token_ids) - seq.num_inflight
            assert seq.token_ids[idx] == PLACEHOLDER
            seq.token_ids[idx] = tok
            seq.num_inflight -= 1
            seq.logprobs.append(lp)
            if seq.params.logprobs is not None:
                seq.top_logprobs.append(top if top is not None else [])
            seq.policy_versions.append(plan.policy_version)
            self.num_generated_tokens += 1
            if seq.index == 0 and len(seq.logprobs) == 1:  # the request's first token
                self.num_first_tokens += 1
                self.num_started_prompt_tokens += seq.num_prompt_tokens
                self.num_prefix_cached_tokens += min(seq.num_cached_tokens, seq.num_prompt_tokens)
            stop = check_stop(seq, self.detokenize)
            if stop is not None:
                self.finish(seq, *stop)
                request = self._pop_finished(seq.request_id)
                if request is not None:
                    finished.append(request)
        for seq_id in plan.score_done:  # Engine.score: the prompt is computed, its logprobs are in
            seq = self.seqs.get(seq_id)
            if seq is not None:
                self.num_started_prompt_tokens += seq.num_prompt_tokens
                self.num_prefix_cached_tokens += min(seq.num_cached_tokens, seq.num_prompt_tokens)
                self.finish(seq, "length")
                request = self._pop_finished(seq.request_id)
                if request is not None:
                    finished.append(request)
        return finished

    def rollback(self) -> int:
        """A step failed (its samples, and any in flight, are lost): drop every placeholder and send every
        running sequence back to be recomputed from its known tokens. KV written by the lost steps may be
        partial, so nothing is registered and the prefix cache is reset. Returns how many went back."""
        for seq in self.running + self.waiting:
            if seq.num_inflight:
                del seq.token_ids[len(seq.token_ids) - seq.num_inflight :]
                seq.num_inflight = 0
        self._drop_swapped()
        self.evict_parked()
        moved = list(self.running)
        for seq in reversed(moved):
            self._remove(self.running, seq)
            self.block_manager.free(seq, register=False)
            seq.status = SequenceStatus.WAITING
            self._insert(self.waiting, seq)
        self.block_manager.reset_prefix_cache()
        return len(moved)

    def recompute_running(self) -> int:
        """The weights changed: every running sequence goes back to the queue with its tokens kept and
        its KV freed, to be recomputed under the new weights (siblings fork the prompt again). Not
        counted as a preemption. Swapped sequences drop their host copy too. Returns how many went back."""
        self._drop_swapped()
        self.evict_parked()
        moved = list(self.running)
        for seq in reversed(moved):
            assert seq.num_inflight == 0, "recompute with a sample in flight (collect it first)"
            self._remove(self.running, seq)
            self.block_manager.free(seq)
            seq.status = SequenceStatus.WAITING
            self._insert(self.waiting, seq)
        return len(moved)

    # ---- helpers -----------------------------------------------------------------------------
    def _preempt(self, seq: Sequence) -> None:
        """Swap or recompute by the module docstring's rule. A sample still in flight stays a placeholder
        (admission waits for it); its KV position is not computed yet, so neither path loses it."""
        self._remove(self.running, seq)
        bm = self.block_manager
        if bm.num_own_blocks(seq) >= SWAP_MIN_BLOCKS and bm.can_swap_out(seq):
            self._swap_out += bm.swap_out(seq)
            self._swapped_now.append(seq)
            self.num_swap_outs += 1
        else:
            bm.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._insert(self.waiting, seq)

    def evict_parked(self) -> None:
        """Parked conversations drop their KV (failed step, new weights); a resume recomputes it."""
        for request in self.parked.values():
            self.block_manager.free(request.seqs[0], register=False)

    def _drop_swapped(self) -> None:
        """Swapped sequences go back to plain recompute (their host KV is lost or stale)."""
        for seq in self.waiting:
            if self.block_manager.is_swapped(seq):
                self.block_manager.free(seq, register=False)

    @staticmethod
    def _insert(queue: list[Sequence], seq: Sequence) -> None:
        """Keep ``queue`` sorted by (priority, arrival, seq_id): O(1) for a newcomer (the usual case), else O(log n)."""
        key = _order(seq)
        if not queue or _order(queue[-1]) < key:
            queue.append(seq)
        else:
            queue.insert(bisect.bisect(queue, key, key=_order), seq)

    @staticmethod
    def _remove(queue: list[Sequence], seq: Sequence) -> bool:
        """Take ``seq`` out of the sorted ``queue`` (found by bisection, not a scan); False if not there."""
        i = bisect.bisect_left(queue, _order(seq), key=_order)
        if i < len(queue) and queue[i] is seq:
            del queue[i]
            return True
        return False

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)


def _order(seq: Sequence) -> tuple[int, int, int]:
    return seq.priority, seq.arrival, seq.seq_id
