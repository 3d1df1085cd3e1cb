"""Preemption by swap (``swap_space_gib``) and by recompute: outputs identical to solo runs, groups keep
sharing their prompt blocks, the host pool's bookkeeping holds, and the admission watermark (float32, CPU)."""

from __future__ import annotations

import itertools

import pytest

from rollout import SamplingParams
from rollout.config import EngineConfig
from rollout.engine.block_manager import BlockManager
from rollout.engine.scheduler import SWAP_MIN_BLOCKS, Scheduler, SchedulerLimits
from rollout.engine.sequence import Request, Sequence, SequenceStatus
from tests.engine_helpers import assert_matches_hf, make_engine, random_prompts
from tests.test_scheduler import fake_result
from tests.tiny_models import make_tiny_hf_model


# ---- scheduler and block manager, fake outputs ------------------------------------------------------
class SwapHarness:
    """Drives the scheduler like the engine does, sync or async (schedule N+1 before applying N)."""

    def __init__(self, num_blocks, num_host_blocks, block_size=4, max_num_seqs=4, async_mode=False,
                 prefix_caching=True):
        self.bm = BlockManager(num_blocks, block_size, prefix_caching, num_host_blocks=num_host_blocks)
        self.sched = Scheduler(SchedulerLimits(max_num_seqs, 64), self.bm)
        self.ids, self.arrivals = itertools.count(), itertools.count()
        self.async_mode = async_mode
        self.pending = None
        self.plans = []

    def add(self, prompt, n=1, max_tokens=12):
        sp = SamplingParams(n=n, max_tokens=max_tokens, ignore_eos=True)
        rid = f"r{next(self.arrivals)}"
        seqs = []
        for i in range(n):
            seqs.append(Sequence(next(self.ids), rid, i, list(prompt), len(prompt), sp, int(rid[1:]),
                                 parent=seqs[0] if seqs else None))
        self.sched.add(Request(rid, list(prompt), sp, seqs))
        return seqs

    def step(self):
        """A token is a function of (sequence, output position), so a resumed sequence is checkable."""
        plan = self.sched.schedule()
        if plan is not None:
            self.plans.append(plan)
        done, previous = plan, plan
        if self.async_mode:
            previous, self.pending = self.pending, plan
        if previous is not None:
            self.sched.update_from_output(previous, fake_result(previous, lambda sp: 1000 * sp.seq_id + sp.sample_pos))
        self.bm.check_invariants(self.sched.running + self.sched.waiting)
        return done

    def run(self, limit=200):
        for _ in range(limit):
            if not self.sched.has_unfinished() and self.pending is None:
                return
            self.step()
        raise AssertionError("did not finish")


@pytest.mark.parametrize("async_mode", [False, True])
def test_long_victim_is_swapped_and_resumes_without_recompute(async_mode):
    h = SwapHarness(num_blocks=10, num_host_blocks=16, async_mode=async_mode)
    old = h.add([1] * 9, max_tokens=14)[0]
    new = h.add([3] * 9, max_tokens=14)[0]
    h.run()
    assert h.sched.num_swap_outs >= 1 and h.sched.num_swap_ins == h.sched.num_swap_outs
    outs = [p for p in h.plans if p.swap_out]
    ins = [p for p in h.plans if p.swap_in]
    assert outs and ins and sum(len(p.swap_out) for p in h.plans) == h.sched.num_swapped_out_blocks
    # the resumed sequence starts where it stopped: its plans never go back to an earlier position
    starts = [sp.start_pos for p in h.plans for sp in p.seqs if sp.seq_id == new.seq_id]
    assert starts == sorted(set(starts)) and new.num_preemptions >= 1
    for seq in (old, new):
        assert seq.output_token_ids == [1000 * seq.seq_id + i for i in range(14)]
    assert h.bm.num_free_blocks == 10 and h.bm.num_free_host_blocks == 16


def test_short_victim_or_no_host_room_is_recomputed():
    h = SwapHarness(num_blocks=10, num_host_blocks=0, prefix_caching=False)
    h.add([1] * 9, max_tokens=14)
    new = h.add([3] * 9, max_tokens=14)[0]
    h.run()
    assert h.sched.num_preemptions >= 1 and h.sched.num_swap_outs == 0
    starts = [sp.start_pos for p in h.plans for sp in p.seqs if sp.seq_id == new.seq_id]
    assert starts.count(0) >= 2  # recomputed from the start
    # a victim below SWAP_MIN_BLOCKS of computed context recomputes even with host room
    h = SwapHarness(num_blocks=3, num_host_blocks=16, max_num_seqs=2)
    h.add([1] * 3, max_tokens=8)
    h.add([3] * 3, max_tokens=8)
    h.run()
    assert SWAP_MIN_BLOCKS * 4 > 3 and h.sched.num_preemptions >= 1 and h.sched.num_swap_outs == 0


@pytest.mark.parametrize("async_mode", [False, True])
def test_groups_keep_sharing_prompt_blocks_and_swap_only_their_own(async_mode):
    h = SwapHarness(num_blocks=14, num_host_blocks=32, async_mode=async_mode)
    group = h.add([5] * 9, n=3, max_tokens=10)
    solo = h.add([6] * 9, max_tokens=10)[0]
    while h.sched.has_unfinished() or h.pending is not None:
        h.step()
        running = [s for s in group if s.status is SequenceStatus.RUNNING and len(s.block_table) >= 2]
        swapped = [s for s in group if h.bm.is_swapped(s)]
        assert len({tuple(s.block_table[:2]) for s in running}) <= 1, "a group's prompt blocks were unshared"
        holders = len(running) + len(swapped)  # a swapped member keeps its hold on the shared prompt blocks
        assert all(h.bm.blocks[b].ref_count == holders for b in (running[0].block_table[:2] if running else []))
    assert h.sched.num_preemptions >= 1
    for seq in [*group, solo]:
        assert seq.output_token_ids == [1000 * seq.seq_id + i for i in range(10)]


@pytest.mark.parametrize("async_mode", [False, True])
def test_group_member_swaps_its_own_blocks_and_resumes_over_the_shared_prompt(async_mode):
    """GRPO's shape: n samples share the prompt's blocks. A preempted member moves only its own blocks to the
    host (the shared ones stay, held) and resumes where it stopped; before, sharing ruled swap out entirely."""
    h = SwapHarness(num_blocks=13, num_host_blocks=32, async_mode=async_mode)
    group = h.add([5] * 8, n=3, max_tokens=14)  # 2 shared prompt blocks, then 4 own blocks each
    seen = set()
    while h.sched.has_unfinished() or h.pending is not None:
        h.step()
        for s in group:
            if h.bm.is_swapped(s):
                seen.add(s.seq_id)
                assert h.bm.num_swap_in_blocks(s) < h.bm.swapped_table_len(s)  # the shared blocks were kept
    assert seen and h.sched.num_swap_outs >= 1 and h.sched.num_swap_ins == h.sched.num_swap_outs
    for seq in group:
        starts = [sp.start_pos for p in h.plans for sp in p.seqs if sp.seq_id == seq.seq_id]
        assert starts == sorted(set(starts)), f"seq {seq.seq_id} recomputed"  # resumed, never went back
        assert seq.output_token_ids == [1000 * seq.seq_id + i for i in range(14)]
    assert h.bm.num_free_blocks == 13 and h.bm.num_free_host_blocks == 32


def test_block_manager_partial_swap_keeps_shared_blocks_in_table_order():
    bm = BlockManager(16, 4, True, num_host_blocks=8)
    sp = SamplingParams(n=2, max_tokens=8, ignore_eos=True)
    parent = Sequence(0, "r", 0, [7] * 8, 8, sp, 0)
    child = Sequence(1, "r", 1, [7] * 8, 8, sp, 0, parent=parent)
    bm.allocate_prefix(parent)
    bm.append_slots(parent, 8)
    parent.num_computed_tokens = 8
    bm.fork(parent, child, 8)
    for seq in (parent, child):  # 8 tokens of output each: 2 own blocks
        seq.token_ids += [1] * 8
        bm.append_slots(seq, 8)
        seq.num_computed_tokens = 16
    shared = parent.block_table[:2]
    assert child.block_table[:2] == shared and bm.num_own_blocks(child) == 2
    own = child.block_table[2:]
    copies = bm.swap_out(child)
    assert [g for g, _ in copies] == own and all(bm.blocks[b].ref_count == 2 for b in shared)
    assert bm.num_swap_in_blocks(child) == 2 and bm.swapped_table_len(child) == 4
    bm.check_invariants([parent, child])
    back = bm.swap_in(child)
    assert [h for h, _ in back] == [h for _, h in copies]
    assert child.block_table[:2] == shared and child.block_table[2:] == [g for _, g in back]
    bm.check_invariants([parent, child])
    bm.swap_out(child)
    bm.free(child)  # finished while swapped: its host copies and its hold on the shared blocks both go
    assert all(bm.blocks[b].ref_count == 1 for b in shared) and bm.num_free_host_blocks == 8
    bm.check_invariants([parent])


def _until_swapped(h, seq, limit=40):
    for _ in range(limit):
        if h.bm.is_swapped(seq):
            return
        h.step()
    raise AssertionError(f"seq {seq.seq_id} was never swapped")


def test_abort_and_rollback_free_host_blocks():
    for end in ("rollback", "abort"):
        h = SwapHarness(num_blocks=10, num_host_blocks=16)
        h.add([1] * 9, max_tokens=14)
        new = h.add([3] * 9, max_tokens=14)[0]
        _until_swapped(h, new)
        if end == "rollback":
            h.sched.rollback()
            assert not h.bm.is_swapped(new) and new.num_computed_tokens == 0
        else:
            h.sched.abort(new.request_id)
        assert h.bm.num_free_host_blocks == 16
        h.bm.check_invariants(h.sched.running + h.sched.waiting)
        h.run()
        assert h.bm.num_free_blocks == 10


def test_admission_watermark_keeps_a_block_per_running_sequence_at_a_boundary():
    # One running sequence at 7 computed of 8 slots: its next two tokens cross a block, so a waiting
    # prompt that would take every free block waits instead of being preempted two steps later.
    h = SwapHarness(num_blocks=4, num_host_blocks=0, max_num_seqs=2)
    h.add([1] * 6, max_tokens=20)
    h.step()
    h.step()  # 7 computed, 2 blocks held, 2 free
    h.add([3] * 7, max_tokens=4)  # needs 2 blocks: would leave 0 for the running sequence's next block
    plan = h.step()
    assert len(plan.seqs) == 1 and h.sched.num_waiting == 1


def test_swap_space_gib_is_validated():
    assert EngineConfig().swap_space_gib == 0.0
    with pytest.raises(ValueError, match="swap_space_gib"):
        EngineConfig(swap_space_gib=-1.0)
    with pytest.raises(TypeError, match="swap_space_gib"):
        EngineConfig(swap_space_gib="1")
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(swap_space_gib=1.0, tensor_parallel_size=2)


# ---- the engine: identical outputs --------------------------------------------------------------
def _tokens(outs):
    return [[(c.token_ids, c.logprobs) for c in o.outputs] for o in outs]


@pytest.mark.parametrize("async_mode", [False, True])
def test_swap_and_recompute_give_solo_outputs(async_mode):
    hf = make_tiny_hf_model("llama")
    prompts = random_prompts(6, hf.config.vocab_size, lo=10, hi=40, seed=11)
    params = [SamplingParams(temperature=0.9, max_tokens=12 + 4 * (i % 3), seed=50 + i, ignore_eos=True,
                             n=2 if i == 0 else 1) for i in range(len(prompts))]
    alone = make_engine(hf, block_size=4)
    ref = [alone.generate([p], [sp])[0] for p, sp in zip(prompts, params)]
    tight = dict(block_size=4, max_num_seqs=4, num_blocks=24, max_num_batched_tokens=64, async_mode=async_mode)
    for swap in (0.0, 0.01):
        engine = make_engine(hf, swap_space_gib=swap, **tight)
        outs = engine.generate(prompts, params)
        stats = engine.get_stats()
        assert stats.num_preemptions > 0
        if swap:
            assert stats.num_swap_outs > 0 and stats.num_swap_ins == stats.num_swap_outs
            assert stats.swapped_out_bytes == stats.num_swapped_out_blocks * engine.kv.block_bytes > 0
        else:
            assert stats.num_swap_outs == stats.num_swapped_out_blocks == stats.num_swap_ins == 0
        assert [[c.token_ids for c in o.outputs] for o in outs] == [[c.token_ids for c in o.outputs] for o in ref]
        for a, b in zip(_tokens(outs), _tokens(ref)):
            for (_, lp_a), (_, lp_b) in zip(a, b):
                assert lp_a == pytest.approx(lp_b, abs=1e-5)
        assert_matches_hf(hf, prompts[1], outs[1].outputs[0], temperature=0.9)
        assert engine.block_manager.num_free_blocks == engine.num_blocks
        assert engine.block_manager.num_free_host_blocks == engine.kv.num_host_blocks


def test_groups_under_pressure_swap_and_match_solo_runs():
    """n=4 groups in a cache that cannot hold them (the engine end to end; the scheduler tests above pin down
    which blocks move): every sample equals its run alone, tokens and logprobs, and the pools end empty."""
    hf = make_tiny_hf_model("llama")
    prompts = random_prompts(3, hf.config.vocab_size, lo=16, hi=17, seed=5)
    params = [SamplingParams(temperature=0.9, max_tokens=24, seed=7 + i, ignore_eos=True, n=4) for i in range(3)]
    alone = make_engine(hf, block_size=4)
    ref = [alone.generate([p], [sp])[0] for p, sp in zip(prompts, params)]
    engine = make_engine(hf, swap_space_gib=0.01, block_size=4, max_num_seqs=12, num_blocks=40,
                         max_num_batched_tokens=64)
    outs = engine.generate(prompts, params)
    stats = engine.get_stats()
    assert stats.num_preemptions > 0 and stats.num_swap_outs > 0 and stats.num_swap_ins == stats.num_swap_outs
    assert [[c.token_ids for c in o.outputs] for o in outs] == [[c.token_ids for c in o.outputs] for o in ref]
    for a, b in zip(_tokens(outs), _tokens(ref)):
        for (_, lp_a), (_, lp_b) in zip(a, b):
            assert lp_a == pytest.approx(lp_b, abs=1e-5)
    assert engine.block_manager.num_free_blocks == engine.num_blocks
    assert engine.block_manager.num_free_host_blocks == engine.kv.num_host_blocks


@pytest.mark.parametrize("end", ["rollback", "abort", "recompute_running"])
def test_swapped_group_member_releases_host_and_shared_blocks(end):
    """A group member swapped out (holding the shared prompt blocks) then rolled back, aborted or sent to
    recompute: its host blocks and its hold on the shared blocks both go, and the rest still finish."""
    h = SwapHarness(num_blocks=13, num_host_blocks=32)
    group = h.add([5] * 8, n=3, max_tokens=14)
    for _ in range(60):
        if any(h.bm.is_swapped(s) for s in group):
            break
        h.step()
    victim = next(s for s in group if h.bm.is_swapped(s))
    if end == "rollback":
        h.sched.rollback()
    elif end == "abort":
        h.sched.abort(victim.request_id)
    else:
        h.sched.recompute_running()
    assert not h.bm.is_swapped(victim) and h.bm.num_free_host_blocks == 32
    h.bm.check_invariants(h.sched.running + h.sched.waiting)
    h.run()
    assert h.bm.num_free_blocks == 13 and h.bm.num_free_host_blocks == 32
