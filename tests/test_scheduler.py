"""The scheduler alone, driven with fake runner outputs (as vLLM tests its scheduler): admission under both
limits, chunked prefill, preemption order, abort, the decode fast path, stops and rollback. No torch."""

from __future__ import annotations

import itertools

from rollout.engine.block_manager import BlockManager
from rollout.engine.plan import BatchPlan, SampleResult
from rollout.engine.scheduler import Scheduler, SchedulerLimits
from rollout.engine.sequence import PLACEHOLDER, Request, Sequence, SequenceStatus
from rollout.sampling_params import SamplingParams

EOS = 2


class Harness:
    def __init__(self, max_num_seqs=8, max_num_batched_tokens=64, num_blocks=64, block_size=4, detokenize=None):
        self.bm = BlockManager(num_blocks, block_size)
        self.sched = Scheduler(SchedulerLimits(max_num_seqs, max_num_batched_tokens), self.bm, detokenize)
        self.ids = itertools.count()
        self.arrivals = itertools.count()

    def add(self, prompt, n=1, **params):
        params.setdefault("max_tokens", 8)
        sp = SamplingParams(n=n, **params)
        rid = f"r{next(self.arrivals)}"
        arrival = int(rid[1:])
        stop_ids = tuple(sorted(sp.stop_set | (frozenset() if sp.ignore_eos else {EOS})))
        seqs = []
        for i in range(n):
            seqs.append(Sequence(next(self.ids), rid, i, list(prompt), len(prompt), sp, arrival,
                                 parent=seqs[0] if seqs else None, stop_ids=stop_ids))
        self.sched.add(Request(rid, list(prompt), sp, seqs))
        return rid

    def step(self, token=7) -> tuple[BatchPlan, list[Request]]:
        """schedule -> fake runner (every sample is ``token``) -> update, synchronously."""
        plan = self.sched.schedule(policy_version=3)
        assert plan is not None
        result = fake_result(plan, token)
        return plan, self.sched.update_from_output(plan, result)

    def check(self):
        self.bm.check_invariants(self.sched.running + self.sched.waiting)


def fake_result(plan: BatchPlan, token) -> SampleResult:
    toks = [token(sp) if callable(token) else token for sp in plan.sample_seqs]
    return SampleResult(plan.step_id, toks, [-0.5] * len(toks))


def test_admission_respects_max_num_seqs_fifo():
    h = Harness(max_num_seqs=2)
    rids = [h.add([1, 3, 4]) for _ in range(3)]
    plan, _ = h.step()
    assert [sp.seq_id for sp in plan.seqs] == [0, 1] and h.sched.num_waiting == 1
    plan, _ = h.step()
    assert len(plan.seqs) == 2 and all(len(sp.input_ids) == 1 for sp in plan.seqs)  # decodes, no room for r2
    assert h.sched.requests[rids[2]].seqs[0].status is SequenceStatus.WAITING
    h.check()


def test_token_budget_chunks_a_long_prefill_and_decodes_go_first():
    h = Harness(max_num_batched_tokens=8)
    h.add([5] * 3)
    long = h.add([6] * 20)
    plan, _ = h.step()
    assert [len(sp.input_ids) for sp in plan.seqs] == [3, 5]  # the budget cuts the second prompt
    assert [sp.sample for sp in plan.seqs] == [True, False]  # a partial prefill samples nothing
    plan, _ = h.step()
    assert [len(sp.input_ids) for sp in plan.seqs] == [1, 7]  # the running decode first, then the next chunk
    assert plan.seqs[1].start_pos == 5 and plan.num_prompt_tokens == 7
    plan, _ = h.step()
    assert [len(sp.input_ids) for sp in plan.seqs] == [1, 7] and plan.seqs[1].start_pos == 12
    plan, _ = h.step()
    assert plan.seqs[1].sample and plan.seqs[1].start_pos == 19  # the last prompt token samples
    assert h.sched.requests[long].seqs[0].num_output_tokens == 1
    h.check()


def test_preemption_takes_the_newest_and_it_resumes_with_its_tokens():
    h = Harness(num_blocks=6, block_size=4, max_num_seqs=4)
    old = h.add([1] * 7, max_tokens=12, ignore_eos=True)  # 2 blocks each now, 5 each at the end: 6 in all
    new = h.add([3] * 7, max_tokens=12, ignore_eos=True)
    for _ in range(8):
        h.step()
        if h.sched.num_preemptions:
            break
    assert h.sched.num_preemptions == 1
    victim = h.sched.requests[new].seqs[0]
    assert h.sched.requests[old].seqs[0].status is SequenceStatus.RUNNING
    assert victim.num_preemptions >= 1 and victim.num_output_tokens >= 1  # kept its tokens, lost its KV
    finished = {}
    for _ in range(60):
        if not h.sched.has_unfinished():
            break
        _, done = h.step()
        finished.update((r.request_id, r) for r in done)
        h.check()
    assert {r: len(finished[r].seqs[0].output_token_ids) for r in (old, new)} == {old: 12, new: 12}
    assert h.bm.num_free_blocks == 6


def test_abort_frees_everything_and_late_samples_are_dropped():
    h = Harness()
    rid = h.add([1, 3, 4], n=3)
    keep = h.add([5, 6])
    plan = h.sched.schedule()  # launched (async), not yet collected
    request = h.sched.abort(rid)
    assert request is not None and all(s.finish_reason == "abort" for s in request.seqs)
    assert rid not in h.sched.requests and h.sched.abort(rid) is None
    done = h.sched.update_from_output(plan, fake_result(plan, 9))
    assert done == [] and all(s.output_token_ids == [] for s in request.seqs)  # the late tokens never land
    assert h.sched.requests[keep].seqs[0].output_token_ids == [9]
    h.check()


def test_decode_fast_path_needs_no_block_work():
    h = Harness(block_size=8)
    h.add([1, 3, 4], max_tokens=4, ignore_eos=True)
    h.step()
    free = h.bm.num_free_blocks
    plan, _ = h.step()
    assert plan.decode_only and plan.block_copies == [] and h.bm.num_free_blocks == free


def test_async_carry_is_a_flag_and_versions_come_from_the_plan():
    h = Harness()
    rid = h.add([1, 3, 4], max_tokens=3, ignore_eos=True)
    first = h.sched.schedule(policy_version=5)
    second = h.sched.schedule(policy_version=6)  # scheduled before the first step's sample landed
    assert second.seqs[0].carry and second.seqs[0].input_ids == [PLACEHOLDER]
    h.sched.update_from_output(first, fake_result(first, 11))
    h.sched.update_from_output(second, fake_result(second, 12))
    seq = h.sched.requests[rid].seqs[0]
    assert seq.output_token_ids == [11, 12] and seq.policy_versions == [5, 6]


def test_stops_eos_stop_ids_strings_min_tokens_and_length():
    h = Harness(detokenize=lambda ids: "".join(chr(ord("a") + i % 26) for i in ids))
    eos = h.add([1], max_tokens=5)
    early = h.add([1], max_tokens=5, min_tokens=2)
    stop_id = h.add([1], max_tokens=5, stop_token_ids=[EOS + 1])
    text = h.add([1], max_tokens=5, stop=["dd"])
    length = h.add([1], max_tokens=2, ignore_eos=True)
    tokens = {eos: [EOS], early: [EOS, 5, EOS], stop_id: [4, EOS + 1], text: [3, 3], length: [EOS, EOS]}
    seqs = {rid: h.sched.requests[rid].seqs[0] for rid in tokens}
    by_seq = {seqs[rid].seq_id: toks for rid, toks in tokens.items()}
    finished = {}
    while h.sched.has_unfinished():
        _, done = h.step(lambda sp: by_seq[sp.seq_id][sp.sample_pos])
        finished.update((r.request_id, r.seqs[0]) for r in done)
    got = {rid: (s.output_token_ids, s.finish_reason, s.stop_reason) for rid, s in finished.items()}
    assert got == {eos: ([EOS], "stop", None), early: ([EOS, 5, EOS], "stop", None),
                   stop_id: ([4, EOS + 1], "stop", EOS + 1), text: ([3, 3], "stop", "dd"),
                   length: ([EOS, EOS], "length", None)}


def test_rollback_drops_placeholders_and_recomputes_from_known_tokens():
    h = Harness()
    a = h.add([1, 3, 4, 5, 6], n=2, ignore_eos=True)
    h.step()
    h.step()
    h.sched.schedule()  # a step in flight ...
    h.sched.schedule()  # ... and the next one: both lost
    assert h.sched.rollback() == 2
    seqs = h.sched.requests[a].seqs
    assert all(s.num_inflight == 0 and s.status is SequenceStatus.WAITING and s.block_table == [] for s in seqs)
    # sample 1 forked the prompt one step after sample 0 computed it, so it has one token fewer
    assert [s.output_token_ids for s in seqs] == [[7, 7], [7]] and all(PLACEHOLDER not in s.token_ids for s in seqs)
    assert h.bm.num_free_blocks == h.bm.num_blocks and h.bm.num_cached_blocks == 0
    plan, _ = h.step()  # recomputed: the whole known context is the input again
    assert [(sp.seq_id, len(sp.input_ids), sp.start_pos) for sp in plan.seqs] == [(seqs[0].seq_id, 7, 0)]
    h.check()
