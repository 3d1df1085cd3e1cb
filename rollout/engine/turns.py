"""Multi-turn conversations on one engine sequence: the KV stays resident between turns.

A conversation is a single-sample request whose sequence has ``keep_kv`` set. When a turn ends (a stop, EOS or
its ``max_tokens``) the scheduler *parks* it instead of freeing it: the request comes back from ``step()`` like
any finished one, but its blocks (and the KV in them) are kept. ``resume`` appends the environment's reply to
the same sequence as given tokens (logprob 0.0, not sampled) and puts it back among the running sequences, so
the next step computes only the reply's tokens and generation continues from the resident KV: no turn
re-prefills the conversation before it. ``end`` frees a finished conversation.

A step that computes given tokens runs eagerly (decode graphs hold one token a sequence), so with
``engine.turn_prefill_hold_steps`` = K a resumed reply waits up to K steps for others to batch with it,
joining earlier any step that is not pure decode anyway.

Parked KV is dropped only when it must be: new weights (``update_weights`` recomputes running sequences, and
conversations between turns with them), a failed step, or ``make_room`` when parked conversations hold the
blocks the waiting ones need; a resume then recomputes the context, and ``EngineStats.num_prefill_tokens``
counts it.

Async mode: a turn parks while the step after its last sample is already in flight (its extra sample is
dropped). ``resume`` waits until that step has been collected, so the stale sample can never land in a
resumed conversation; it returns False until then and the caller retries after the next ``step()``.
"""

from __future__ import annotations

import dataclasses

from rollout.engine.sequence import SequenceStatus
from rollout.sampling_params import SamplingParams


class Conversations:
    """Start, continue and end multi-turn conversations on an in-process ``Engine`` (its step surface): the
    environment loop's ``rollout.envs.turns.Turns`` for an engine in this process."""

    def __init__(self, engine: object) -> None:
        self.engine = engine

    @property
    def capacity(self) -> int:
        """Tokens one conversation may hold, prompt included (``max_model_len`` and the KV capacity)."""
        return min(self.engine.max_model_len, self.engine.kv.num_tokens)

    def busy(self) -> bool:
        """True while the engine has turns (or another caller's requests) to step."""
        return self.engine.has_unfinished_requests()

    def step(self) -> list:
        """One engine step (``make_room`` first); the requests that finished, ours among them: a conversation's
        ``RequestOutput`` holds every token after its prompt, the environment's included (logprob 0.0)."""
        self.make_room()
        return self.engine.step()

    def abort(self, request_id: str) -> None:
        """End a conversation whatever its state: aborted if running, its KV freed."""
        self.engine.abort(request_id)
        self.end(request_id)

    def start(self, prompt_ids: list[int], params: SamplingParams, request_id: str) -> str:
        """Queue the first turn (``params.max_tokens`` is the turn's budget); its KV outlives the turn."""
        if params.n != 1:
            raise ValueError(f"a conversation has one sample (n=1), got n={params.n}; start n conversations")
        eng = self.engine
        with eng._lock:
            rid = eng.add_request(prompt_ids, params, request_id)
            eng.scheduler.requests[rid].seqs[0].keep_kv = True
        return rid

    def room(self, request_id: str) -> int:
        """Tokens the parked conversation may still grow by (``max_model_len`` and KV capacity)."""
        return self.capacity - self.engine.scheduler.parked[request_id].seqs[0].num_tokens

    def resume(self, request_id: str, given_ids: list[int], params: SamplingParams, max_new_tokens: int) -> bool:
        """Append ``given_ids`` (the environment's tokens) and generate up to ``max_new_tokens`` more.

        False (nothing changed) while the step in flight at the park is not collected yet: call again after
        the next ``step()``. The caller checks ``room`` first: the reply plus one token must fit.
        """
        eng = self.engine
        with eng._lock:
            sched = eng.scheduler
            request = sched.parked[request_id]
            seq = request.seqs[0]
            inflight = eng._inflight
            if inflight is not None and inflight.plan.step_id <= seq.park_step:
                return False
            room = min(eng.max_model_len, eng.kv.num_tokens) - seq.num_tokens - len(given_ids)
            if not given_ids or max_new_tokens < 1 or room < 1:
                raise ValueError(f"conversation {request_id!r}: {len(given_ids)} given tokens and {max_new_tokens} "
                                 f"new ones need >= 1 each and room for both ({room + len(given_ids)} tokens left)")
            bad = next((t for t in given_ids if not 0 <= t < eng.model.vocab_size), None)
            if bad is not None:
                raise ValueError(f"given token id {bad} is outside the vocabulary [0, {eng.model.vocab_size})")
            del sched.parked[request_id]
            version = seq.policy_versions[-1] if seq.policy_versions else eng.policy_version
            seq.token_ids += given_ids
            if seq.params.logprobs is not None:  # top logprobs stay one per output token (none at given ones)
                seq.top_logprobs += [[] for _ in given_ids]
            seq.logprobs += [0.0] * len(given_ids)
            seq.policy_versions += [version] * len(given_ids)
            n_out = seq.num_output_tokens
            budget = min(max_new_tokens, room)
            seq.params = request.params = dataclasses.replace(
                params, max_tokens=n_out + budget, min_tokens=n_out + min(params.min_tokens, budget))
            seq.finish_reason = seq.stop_reason = None
            sched.requests[request_id] = request
            sched.seqs[seq.seq_id] = seq
            if seq.block_table:  # resident KV: compute the reply next step, like a running prefill chunk
                seq.hold_until = sched._step_id + sched.limits.turn_prefill_hold_steps
                seq.status = SequenceStatus.RUNNING
                sched._insert(sched.running, seq)
            else:  # evicted or swapped: admitted again (recompute, or swap-in)
                seq.status = SequenceStatus.WAITING
                sched._insert(sched.waiting, seq)
            return True

    def end(self, request_id: str) -> None:
        """Free a parked conversation's KV (its full blocks stay in the prefix cache); unknown ids are ignored."""
        eng = self.engine
        with eng._lock:
            request = eng.scheduler.parked.pop(request_id, None)
            if request is not None:
                eng.block_manager.free(request.seqs[0])

    def make_room(self) -> int:
        """Call before each step. Parked KV is invisible to the scheduler's preemption, so when the running
        sequences' next tokens (or, with none running, the oldest waiting one) need more blocks than are free,
        drop parked KV, longest parked first, until they fit. Returns how many conversations lost their KV."""
        eng = self.engine
        with eng._lock:
            sched, bm = eng.scheduler, eng.block_manager
            if not sched.parked or bm.num_free_blocks >= 2 * len(sched.running) + 8:
                return 0  # the common case: plenty free
            need = sum(bm.num_blocks_needed(s, max(0, s.num_tokens - s.num_computed_tokens)) for s in sched.running)
            if not sched.running and sched.waiting:
                need += -(-sched.waiting[0].num_tokens // bm.block_size) + 1
            if bm.num_free_blocks >= need:
                return 0
            holders = sorted((r.seqs[0] for r in sched.parked.values() if r.seqs[0].block_table),
                             key=lambda s: s.park_step)
            dropped = 0
            for seq in holders:
                if bm.num_free_blocks >= need:
                    break
                bm.free(seq, register=True)
                dropped += 1
            return dropped

    @property
    def num_parked(self) -> int:
        return len(self.engine.scheduler.parked)
