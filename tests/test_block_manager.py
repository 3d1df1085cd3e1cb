"""Block manager: counting, prefix sharing, fork + copy-on-write, placeholders; a stateful model check."""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from rollout.engine.block_manager import BlockManager
from rollout.engine.sequence import PLACEHOLDER, Sequence
from rollout.sampling_params import SamplingParams

REPO = Path(__file__).resolve().parents[1]


def make_seq(seq_id: int, tokens: list[int], num_prompt: int | None = None) -> Sequence:
    return Sequence(
        seq_id=seq_id,
        request_id=f"r{seq_id}",
        index=0,
        token_ids=list(tokens),
        num_prompt_tokens=len(tokens) if num_prompt is None else num_prompt,
        params=SamplingParams(),
        arrival=seq_id,
    )


def prefill(bm: BlockManager, seq: Sequence) -> list[tuple[int, int]]:
    """What the scheduler does on admission: hits, then slots for the rest, then advance."""
    bm.allocate_prefix(seq)
    n = seq.num_tokens - seq.num_computed_tokens
    copies = bm.append_slots(seq, n)
    seq.num_computed_tokens += n
    return copies


def decode(bm: BlockManager, seq: Sequence, token: int) -> list[tuple[int, int]]:
    seq.token_ids.append(token)
    copies = bm.append_slots(seq, 1)
    seq.num_computed_tokens += 1
    return copies


def test_round_trip_frees_everything():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq(0, list(range(6)))
    assert prefill(bm, seq) == []
    assert len(seq.block_table) == 2 and bm.num_free_blocks == 6
    for t in range(100, 104):
        decode(bm, seq, t)
    assert seq.num_computed_tokens == 10 and len(seq.block_table) == 3
    assert bm.usage == pytest.approx(3 / 8)
    bm.free(seq)
    assert bm.num_free_blocks == 8 and bm.usage == 0.0
    assert seq.block_table == [] and seq.block_hashes == [] and seq.num_computed_tokens == 0


def test_invalid_sizes_raise():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(num_blocks=0, block_size=4)
    with pytest.raises(TypeError, match="block_size"):
        BlockManager(num_blocks=4, block_size=2.0)  # type: ignore[arg-type]


def test_prefix_sharing_hits_all_but_last_block():
    bm = BlockManager(num_blocks=16, block_size=4)
    prompt = list(range(12))  # three full blocks
    a = make_seq(0, prompt)
    prefill(bm, a)
    decode(bm, a, 99)  # registers a's three computed full blocks
    assert bm.num_cached_blocks == 3 and len(a.block_hashes) == 3
    b = make_seq(1, prompt)
    bm.allocate_prefix(b)
    assert b.block_table == a.block_table[:2]  # not the block with the last prompt token
    assert b.num_cached_tokens == b.num_computed_tokens == 8
    assert b.block_hashes == a.block_hashes[:2]
    assert [bm.blocks[i].ref_count for i in b.block_table] == [2, 2]
    assert bm.append_slots(b, 4) == []
    b.num_computed_tokens = 12
    assert b.block_table[2] != a.block_table[2]

    shared, a_table = list(b.block_table[:2]), list(a.block_table)
    bm.free(a)
    assert [bm.blocks[i].ref_count for i in shared] == [1, 1]
    assert b.block_table[:2] == shared

    bm.free(b)
    assert bm.num_free_blocks == 16
    c = make_seq(2, prompt + [7])
    bm.allocate_prefix(c)  # freed, registered blocks are still hits
    assert c.num_cached_tokens == 12 and c.block_table == a_table[:3]
    assert c.block_table[:2] == shared
    assert bm.num_free_blocks == 13


def test_divergent_prompts_share_only_common_blocks():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = make_seq(0, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    prefill(bm, a)
    decode(bm, a, 0)
    b = make_seq(1, [1, 2, 3, 4, 5, 6, 0, 8, 9])
    bm.allocate_prefix(b)
    assert b.num_cached_tokens == 4 and b.block_table == a.block_table[:1]


def test_fork_copy_on_write_partial_block():
    bm = BlockManager(num_blocks=16, block_size=4)
    prompt = list(range(10))  # blocks: [0..3] [4..7] [8, 9]
    parent = make_seq(0, prompt)
    prefill(bm, parent)
    parent_table = list(parent.block_table)
    child = make_seq(1, prompt)
    bm.fork(parent, child, len(prompt) - 1)
    assert child.block_table == parent_table and child.num_computed_tokens == 9
    assert [bm.blocks[i].ref_count for i in parent_table] == [2, 2, 2]
    assert bm.num_blocks_needed(child, 1) == 1
    copies = bm.append_slots(child, 1)
    assert len(copies) == 1
    src, dst = copies[0]
    assert src == parent_table[2] and child.block_table == parent_table[:2] + [dst]
    assert parent.block_table == parent_table
    assert [bm.blocks[i].ref_count for i in parent_table] == [2, 2, 1]
    assert bm.blocks[dst].ref_count == 1
    child.num_computed_tokens = 10
    assert decode(bm, child, 5) == []  # now its own block: no further copy
    bm.free(parent)
    bm.free(child)
    assert bm.num_free_blocks == 16


def test_fork_at_block_boundary_needs_no_copy():
    bm = BlockManager(num_blocks=16, block_size=4)
    prompt = list(range(9))  # prompt_len - 1 == 8 == 2 blocks
    parent = make_seq(0, prompt)
    prefill(bm, parent)
    child = make_seq(1, prompt)
    bm.fork(parent, child, 8)
    assert child.block_table == parent.block_table[:2]
    assert bm.append_slots(child, 1) == []
    assert child.block_table[2] != parent.block_table[2]
    assert [bm.blocks[i].ref_count for i in parent.block_table] == [2, 2, 1]


def test_fork_inherits_parent_hashes_of_full_blocks():
    bm = BlockManager(num_blocks=16, block_size=4)
    parent = make_seq(0, list(range(10)))
    prefill(bm, parent)
    for t in range(3):
        decode(bm, parent, t)
    assert len(parent.block_hashes) == 3
    child = make_seq(1, list(range(10)))
    bm.fork(parent, child, 9)
    assert child.block_hashes == parent.block_hashes[:2]  # the partial third block is not the child's


def test_hash_collision_is_a_miss_not_a_wrong_hit():
    bm = BlockManager(num_blocks=16, block_size=4, hash_fn=lambda parent, tokens: 0)
    a = make_seq(0, [1, 2, 3, 4, 5])
    prefill(bm, a)
    decode(bm, a, 6)
    assert bm.num_cached_blocks == 1
    b = make_seq(1, [9, 9, 9, 9, 5])
    bm.allocate_prefix(b)
    assert b.num_cached_tokens == 0
    c = make_seq(2, [1, 2, 3, 4, 5])
    bm.allocate_prefix(c)
    assert c.num_cached_tokens == 4


def test_reset_prefix_cache_drops_hits_keeps_blocks_in_use():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = make_seq(0, list(range(12)))
    prefill(bm, a)
    decode(bm, a, 1)
    held = list(a.block_table)
    bm.reset_prefix_cache()
    assert bm.num_cached_blocks == 0 and a.block_table == held
    assert all(bm.blocks[i].ref_count == 1 for i in held)
    b = make_seq(1, list(range(12)))
    bm.allocate_prefix(b)
    assert b.num_cached_tokens == 0 and b.block_table == []
    # a keeps going on KV from the old weights: what it registers now is unreachable for new chains.
    for t in range(7):
        decode(bm, a, t)
    bm.free(a)
    c = make_seq(2, list(range(12)) + [1, 0, 1, 2, 3])
    bm.allocate_prefix(c)
    assert c.num_cached_tokens == 0


def test_reset_turns_free_cached_blocks_into_plain_free_blocks():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = make_seq(0, [1, 2, 3, 4, 5])
    prefill(bm, a)
    decode(bm, a, 6)
    bm.free(a)
    bm.reset_prefix_cache()
    b = make_seq(1, [1, 2, 3, 4, 5, 6, 7, 8])
    prefill(bm, b)  # takes all four blocks, the formerly hashed ones included
    assert bm.num_free_blocks == 0 and b.num_cached_tokens == 0 and bm.usage == 1.0


def test_sequence_prefilled_before_reset_never_registers_for_new_chains():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = make_seq(0, list(range(9)))
    prefill(bm, a)  # KV of 9 tokens computed with the old weights; nothing registered yet
    assert bm.num_cached_blocks == 0
    bm.reset_prefix_cache()
    decode(bm, a, 9)  # registers a's two full blocks, chained from the old seed
    assert bm.num_cached_blocks == 2
    b = make_seq(1, list(range(10)))
    bm.allocate_prefix(b)
    assert b.num_cached_tokens == 0


def test_placeholder_blocks_are_never_registered():
    bm = BlockManager(num_blocks=16, block_size=4)
    seq = make_seq(0, [1, 2, 3, 4, 5, 6, 7])
    prefill(bm, seq)
    # Async: the next token is scheduled as a placeholder; it completes block 1 (positions 4..7).
    seq.token_ids.append(PLACEHOLDER)
    seq.num_inflight = 1
    bm.append_slots(seq, 1)
    seq.num_computed_tokens += 1
    seq.token_ids.append(PLACEHOLDER)
    seq.num_inflight = 2
    bm.append_slots(seq, 1)
    seq.num_computed_tokens += 1
    assert bm.num_cached_blocks == 1 and len(seq.block_hashes) == 1
    assert all(PLACEHOLDER not in b.token_ids for b in bm.blocks)
    seq.token_ids[7:9] = [8, 9]
    seq.num_inflight = 0
    seq.token_ids.append(10)
    bm.append_slots(seq, 1)
    assert bm.num_cached_blocks == 2 and bm.blocks[seq.block_table[1]].token_ids == (5, 6, 7, 8)


def test_allocate_prefix_ignores_placeholder_tail():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = make_seq(0, list(range(12)))
    prefill(bm, a)
    decode(bm, a, 12)
    b = make_seq(1, list(range(9)) + [PLACEHOLDER] * 3)
    b.num_inflight = 3
    bm.allocate_prefix(b)  # 9 known tokens: only the first 8 are hit candidates
    assert b.num_cached_tokens == 8


def test_can_append_false_when_out_of_blocks():
    bm = BlockManager(num_blocks=3, block_size=4)
    a = make_seq(0, list(range(8)))
    prefill(bm, a)
    b = make_seq(1, [9] * 8)
    bm.allocate_prefix(b)
    assert bm.num_blocks_needed(b, 8) == 2
    assert not bm.can_append(b, 8) and bm.can_append(b, 4)
    with pytest.raises(RuntimeError, match="can_append"):
        bm.append_slots(b, 8)
    assert bm.num_free_blocks == 1  # the failed call took nothing


def test_prefix_caching_off_never_hits():
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=False)
    a = make_seq(0, list(range(12)))
    prefill(bm, a)
    decode(bm, a, 1)
    b = make_seq(1, list(range(12)))
    bm.allocate_prefix(b)
    assert b.num_cached_tokens == 0 and bm.num_cached_blocks == 0


def test_allocator_prefers_unhashed_then_least_recently_freed():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = make_seq(0, [1, 2, 3, 4, 5])
    prefill(bm, a)
    decode(bm, a, 6)  # registers blocks 0 and 1 of a
    hashed = a.block_table[:2]
    bm.free(a)
    assert bm.num_cached_blocks == 3  # free() registers the last full block too
    b = make_seq(1, [7, 7, 7, 7, 7])
    prefill(bm, b)  # needs 3 blocks: the never-hashed one, then the least recently freed hashed ones (tail first)
    assert hashed[1] in b.block_table and hashed[0] not in b.block_table
    assert bm.num_cached_blocks == 1
    c = make_seq(2, [1, 2, 9])
    bm.allocate_prefix(c)
    assert c.block_table == [hashed[0]]  # the head block survived: tail blocks were freed first


def test_import_does_not_pull_torch():
    code = "import sys, rollout.engine.block_manager; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)


# ---- stateful model check ------------------------------------------------------------------------------

BLOCK_SIZE = 4  # > 2, so a forked child's first sampled token lands in the shared partial block
NUM_BLOCKS = 16
MAX_PROMPT = 13
TOKENS = st.integers(0, 1)  # a tiny alphabet so prefixes repeat
KV = tuple[int, tuple[int, ...]]  # (weight version, token prefix) a position's KV was computed from


class BlockManagerMachine(RuleBasedStateMachine):
    """Random admit / step / fork / free / reset, with a model of the KV cache contents.

    ``kv[block][offset]`` holds (weight version, token prefix) written by the position's computation; every
    computed position of every live sequence must read back its own prefix, which catches wrong hits,
    missing copies on write and writes into shared blocks. Hits must never return KV of old weights.
    """

    caching = True

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(NUM_BLOCKS, BLOCK_SIZE, enable_prefix_caching=self.caching)
        self.kv: list[list[KV | None]] = [[None] * BLOCK_SIZE for _ in range(NUM_BLOCKS)]
        self.live: list[Sequence] = []
        self.prompts: list[list[int]] = []
        self.ids = itertools.count()
        self.version = 0

    def _compute(self, seq: Sequence, n: int) -> bool:
        """Schedule n more tokens if blocks allow; apply copies and write KV like the runner would."""
        if not self.bm.can_append(seq, n):
            return False
        before = self.bm.num_free_blocks
        need = self.bm.num_blocks_needed(seq, n)
        for src, dst in self.bm.append_slots(seq, n):
            event("copy on write")
            self.kv[dst] = list(self.kv[src])
        assert self.bm.num_free_blocks == before - need
        for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
            block = seq.block_table[pos // BLOCK_SIZE]
            self.kv[block][pos % BLOCK_SIZE] = (self.version, tuple(seq.token_ids[: pos + 1]))
        seq.num_computed_tokens += n
        return True

    def _drop(self, seq: Sequence) -> None:
        self.bm.free(seq)
        self.live.remove(seq)

    @rule(
        base=st.integers(0, 3),
        cut=st.integers(0, MAX_PROMPT),
        tail=st.lists(TOKENS, max_size=6),
        chunk=st.integers(1, MAX_PROMPT),
    )
    def admit(self, base, cut, tail, chunk):
        """A new prompt, often extending a prefix of an earlier one so that hits happen."""
        prefix = self.prompts[-1 - base % len(self.prompts)][:cut] if self.prompts else []
        prompt = (prefix + tail)[:MAX_PROMPT] or [0]
        self.prompts.append(prompt)
        seq = make_seq(next(self.ids), prompt)
        self.bm.allocate_prefix(seq)
        if seq.num_cached_tokens:
            event("prefix hit")
        assert seq.num_computed_tokens == seq.num_cached_tokens < seq.num_tokens
        assert seq.num_cached_tokens % BLOCK_SIZE == 0
        for pos in range(seq.num_cached_tokens):
            version, _ = self.kv[seq.block_table[pos // BLOCK_SIZE]][pos % BLOCK_SIZE]
            assert version == self.version, "a hit returned KV computed with old weights"
        self.live.append(seq)
        if not self._compute(seq, min(chunk, seq.num_tokens - seq.num_computed_tokens)):
            self._drop(seq)

    @precondition(lambda self: self.live)
    @rule(moves=st.lists(st.tuples(st.integers(0, 4), TOKENS, st.booleans()), min_size=6, max_size=6))
    def step(self, moves):
        """One scheduler step: each live sequence computes 0-4 more tokens, sampling one when caught up."""
        for seq, (chunk, token, placeholder) in zip(list(self.live), moves):
            if seq.num_computed_tokens == seq.num_tokens:  # caught up: the last step sampled a token
                placeholder = placeholder or seq.num_inflight > 0  # placeholders are only ever trailing
                seq.token_ids.append(PLACEHOLDER if placeholder else token)
                seq.num_inflight += placeholder
            n = min(chunk, seq.num_tokens - seq.num_computed_tokens)
            if not self._compute(seq, n):
                event("preempted")
                self._drop(seq)

    @precondition(lambda self: any(s.num_inflight for s in self.live))
    @rule(pick=st.integers(0, 99), values=st.lists(TOKENS, min_size=4, max_size=4))
    def resolve(self, pick, values):
        """The sampled values of the placeholders arrive; the carry-over wrote them on the device too."""
        pending = [s for s in self.live if s.num_inflight]
        seq = pending[pick % len(pending)]
        first = seq.num_known_tokens
        for i in range(first, seq.num_tokens):
            seq.token_ids[i] = values[i % 4]
        seq.num_inflight = 0
        for pos in range(first, seq.num_computed_tokens):
            block = seq.block_table[pos // BLOCK_SIZE]
            version, _ = self.kv[block][pos % BLOCK_SIZE]
            self.kv[block][pos % BLOCK_SIZE] = (version, tuple(seq.token_ids[: pos + 1]))

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 99))
    def fork(self, pick):
        parent = self.live[pick % len(self.live)]
        n = parent.num_prompt_tokens - 1
        if parent.num_computed_tokens < n:
            return
        child = make_seq(next(self.ids), parent.prompt_token_ids)
        self.bm.fork(parent, child, n)
        self.live.append(child)
        if not self._compute(child, 1):
            self._drop(child)

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 99))
    def finish(self, pick):
        """A sequence finishes; a later prompt may extend its text (multi-turn), reusing its freed blocks."""
        seq = self.live[pick % len(self.live)]
        self.prompts.append(seq.token_ids[: seq.num_known_tokens])
        self._drop(seq)

    @rule(roll=st.integers(0, 3))
    def reset(self, roll):
        """New weights, now and then (a rarer rule, or hits would seldom survive long enough to test)."""
        if roll:
            return
        self.version += 1
        self.bm.reset_prefix_cache()

    @invariant()
    def consistent(self):
        bm = self.bm
        bm.check_invariants(self.live)
        for seq in self.live:  # and every computed position reads the KV of its own prefix
            for pos in range(seq.num_computed_tokens):
                _, prefix = self.kv[seq.block_table[pos // BLOCK_SIZE]][pos % BLOCK_SIZE]
                assert prefix == tuple(seq.token_ids[: pos + 1]), f"seq {seq.seq_id} reads wrong KV at {pos}"
        for block in bm.blocks:
            if block.hash is not None:
                for offset, token in enumerate(block.token_ids):
                    _, prefix = self.kv[block.block_id][offset]
                    assert prefix[-1] == token and len(prefix) % BLOCK_SIZE == (offset + 1) % BLOCK_SIZE
        if not bm.enable_prefix_caching:
            assert bm.num_cached_blocks == 0

    def teardown(self):
        for seq in list(self.live):
            self._drop(seq)
        assert self.bm.num_free_blocks == NUM_BLOCKS and self.bm.usage == 0.0


class BlockManagerNoCachingMachine(BlockManagerMachine):
    caching = False


STATEFUL = settings(max_examples=150, stateful_step_count=40, deadline=None, derandomize=True)
TestBlockManagerStateful = BlockManagerMachine.TestCase
TestBlockManagerStateful.settings = STATEFUL
TestBlockManagerNoCachingStateful = BlockManagerNoCachingMachine.TestCase
TestBlockManagerNoCachingStateful.settings = settings(STATEFUL, max_examples=50)
