"""Paged KV block manager: counts blocks, shares them by prefix hash and by fork, copies on write.

No torch here: the scheduler and this manager are tested on the CPU alone. The runner only sees block
tables and the (src, dst) block copies that ``append_slots`` returns.

Prefix cache (vLLM v1 style): a block full of known, computed tokens is registered under a chained hash
of (parent block's hash, its token ids). A freed block keeps its hash and stays a possible hit until the
allocator needs it; the allocator takes blocks that hold no hash first, then the least recently freed.

Swap (``num_host_blocks`` > 0): ``swap_out`` moves a sequence's own blocks (ref_count 1) to host blocks
(counts only; the runner copies the bytes) and ``swap_in`` brings them back into fresh device blocks, its
``num_computed_tokens`` kept. Its shared blocks (a group's prompt, a prefix hit) stay on the device, still
held by it: freeing one here would not free it, and copying it back would unshare it. So a GRPO group's
member swaps its own completion and resumes over the prompt blocks its siblings share.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from rollout.engine.sequence import PLACEHOLDER, Sequence

_HASH_BYTES = 16  # 128-bit digests: a collision of parent hashes is out of reach in practice


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None  # chained hash while registered in the prefix cache
    parent_hash: int | None = None  # kept with token_ids so a lookup verifies the full key, not just a digest
    token_ids: tuple[int, ...] = ()


def _root_hash(epoch: int) -> int:
    """Chain seed; a new one per prefix-cache epoch so blocks registered later by sequences that still hold
    KV from old weights can never be reached from a chain started after the reset."""
    digest = hashlib.blake2b(b"rollout-prefix-root" + epoch.to_bytes(8, "little"), digest_size=_HASH_BYTES)
    return int.from_bytes(digest.digest(), "little")


def chain_hash(parent: int, tokens: tuple[int, ...]) -> int:
    """The prefix cache's key of a full block: its parent block's key and its own token ids."""
    data = parent.to_bytes(_HASH_BYTES, "little") + array("q", tokens).tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=_HASH_BYTES).digest(), "little")


class BlockManager:
    """Owns the block pool; sequences hold block ids in ``block_table`` and hashes in ``block_hashes``."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 hash_fn: Callable[[int, tuple[int, ...]], int] = chain_hash, num_host_blocks: int = 0) -> None:
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {value!r}")
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_fn = hash_fn  # replaceable so tests can force digest collisions
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free_plain: deque[int] = deque(range(num_blocks))  # free, no hash: reused first
        self._free_cached: OrderedDict[int, None] = OrderedDict()  # free, hashed: least recently freed first
        self._hash_to_block: dict[int, int] = {}
        # Chain seed per admitted sequence (seq_id -> seed of the epoch its KV began in): a sequence that
        # computed KV under old weights keeps chaining from the old seed after a reset.
        self._seq_root: dict[int, int] = {}
        self._epoch = 0
        self._root = _root_hash(0)
        self.num_host_blocks = num_host_blocks
        self._free_host: deque[int] = deque(range(num_host_blocks))
        # seq_id -> its table while swapped, in order: (True, host block) for an own block's host copy,
        # (False, device block) for a shared block it still holds
        self._swapped: dict[int, list[tuple[bool, int]]] = {}

    # ---- counters -------------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_plain) + len(self._free_cached)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._hash_to_block)

    # ---- allocation -----------------------------------------------------------------------------------

    def allocate_prefix(self, seq: Sequence) -> None:
        """Give a block-less sequence the longest run of cached full blocks of its known tokens.

        The block holding the last known token is never a hit: that token must be computed so the step
        produces logits to sample from.
        """
        assert not seq.block_table and not seq.block_hashes, f"seq {seq.seq_id} already holds blocks"
        assert seq.num_known_tokens >= 1, f"seq {seq.seq_id} has no known token"
        self._seq_root[seq.seq_id] = self._root
        bs = self.block_size
        num_full = (seq.num_known_tokens - 1) // bs if self.enable_prefix_caching else 0
        if seq.prompt_lp_start >= 0:  # prompt logprobs need the logits from position prompt_lp_start - 1 on
            num_full = min(num_full, max(0, seq.prompt_lp_start - 1) // bs)
        parent = self._root
        for i in range(num_full):
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            h = self.hash_fn(parent, tokens)
            block_id = self._hash_to_block.get(h)
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.parent_hash != parent or block.token_ids != tokens:
                break  # digest collision: a different prefix owns this hash
            if block.ref_count == 0:
                del self._free_cached[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
            seq.block_hashes.append(h)
            parent = h
        seq.num_computed_tokens = seq.num_cached_tokens = len(seq.block_table) * bs

    # ---- swap ---------------------------------------------------------------------------------------------

    @property
    def num_free_host_blocks(self) -> int:
        return len(self._free_host)

    def is_swapped(self, seq: Sequence) -> bool:
        return seq.seq_id in self._swapped

    def num_own_blocks(self, seq: Sequence) -> int:
        """Blocks held by this sequence alone: what a swap-out would move and free."""
        return sum(self.blocks[b].ref_count == 1 for b in seq.block_table)

    def can_swap_out(self, seq: Sequence) -> bool:
        """At least one block of its own, and host room for all of them."""
        own = self.num_own_blocks(seq)
        return 0 < own <= len(self._free_host)

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]]:
        """Free the sequence's own device blocks into host blocks, keeping its shared ones; returns the
        (gpu_block, host_block) copies, which must run before any later write to those device blocks (the runner
        does them first)."""
        assert self.can_swap_out(seq), f"seq {seq.seq_id} cannot be swapped out"
        pairs, record = [], []
        for block_id in seq.block_table:
            block = self.blocks[block_id]
            if block.ref_count > 1:
                record.append((False, block_id))  # shared: stays, still held by this sequence
                continue
            block.ref_count = 0
            if block.hash is None:
                self._free_plain.append(block_id)
            else:
                self._free_cached[block_id] = None
            host = self._free_host.popleft()
            pairs.append((block_id, host))
            record.append((True, host))
        self._swapped[seq.seq_id] = record
        seq.block_table = []
        return pairs

    def num_swap_in_blocks(self, seq: Sequence) -> int:
        """Fresh device blocks a swap-in takes (its own blocks' host copies)."""
        return sum(on_host for on_host, _ in self._swapped[seq.seq_id])

    def swapped_table_len(self, seq: Sequence) -> int:
        """The swapped sequence's table length once back (own and shared blocks)."""
        return len(self._swapped[seq.seq_id])

    def swap_in(self, seq: Sequence) -> list[tuple[int, int]]:
        """Bring a swapped sequence back: fresh device blocks for its host copies, in table order between the
        shared blocks it kept; returns the (host_block, gpu_block) copies."""
        need = self.num_swap_in_blocks(seq)
        assert need <= self.num_free_blocks, f"seq {seq.seq_id}: swap-in needs {need} free blocks"
        record = self._swapped.pop(seq.seq_id)
        table, copies = [], []
        for on_host, block_id in record:
            if on_host:
                gpu = self._take_free_block()
                copies.append((block_id, gpu))
                self._free_host.append(block_id)
                table.append(gpu)
            else:
                table.append(block_id)
        seq.block_table = table
        return copies

    def _drop_swapped(self, seq: Sequence) -> list[int]:
        """Forget a swapped sequence's host copies (it finished, or its KV is no longer wanted); returns the
        shared device blocks it still holds, for the caller to release."""
        record = self._swapped.pop(seq.seq_id)
        self._free_host.extend(b for on_host, b in record if on_host)
        return [b for on_host, b in record if not on_host]

    def num_blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Fresh blocks ``append_slots`` would take, counting a copy-on-write block."""
        bs = self.block_size
        start = seq.num_computed_tokens
        end = start + num_new_tokens
        needed = max(0, -(-end // bs) - len(seq.block_table))
        return needed + int(self._needs_copy(seq, num_new_tokens))

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.num_blocks_needed(seq, num_new_tokens) <= self.num_free_blocks

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int]]:
        """Make room for positions [num_computed, num_computed + num_new); return KV block copies to do.

        Also registers blocks that became full of known, computed tokens since the last call (their KV is
        written by then, or is being written earlier on the same stream). ``num_computed_tokens`` is left
        for the scheduler to advance.
        """
        assert num_new_tokens >= 0, num_new_tokens
        bs = self.block_size
        start = seq.num_computed_tokens
        end = start + num_new_tokens
        assert end <= seq.num_tokens, f"seq {seq.seq_id}: slots up to {end} > {seq.num_tokens} tokens"
        assert seq.seq_id in self._seq_root, f"seq {seq.seq_id} was neither allocate_prefix'ed nor forked"
        table = seq.block_table
        copy = self._needs_copy(seq, num_new_tokens)
        num_new_blocks = max(0, -(-end // bs) - len(table))
        if num_new_blocks + copy > self.num_free_blocks:
            raise RuntimeError(
                f"seq {seq.seq_id} needs {num_new_blocks + copy} blocks, {self.num_free_blocks} free; "
                "callers check can_append first"
            )
        if self.enable_prefix_caching and len(seq.block_hashes) < min(start, seq.num_known_tokens) // bs:
            self._register_full_blocks(seq)
        copies: list[tuple[int, int]] = []
        if copy:
            idx = start // bs
            src = table[idx]
            self.blocks[src].ref_count -= 1
            assert self.blocks[src].ref_count >= 1, "a shared block lost its other holder"
            dst = self._take_free_block()
            table[idx] = dst
            copies.append((src, dst))
        for i in range(start // bs + 1, len(table)):
            assert self.blocks[table[i]].ref_count == 1, "a block past the write head is shared"
        for _ in range(num_new_blocks):
            table.append(self._take_free_block())
        return copies

    def fork(self, parent: Sequence, child: Sequence, num_tokens: int) -> None:
        """Share the parent's blocks covering the child's first ``num_tokens`` positions (n samples).

        The child then computes from ``num_tokens`` on; writing into a shared partial block copies it.
        """
        assert not child.block_table and not child.block_hashes, f"seq {child.seq_id} already holds blocks"
        assert 0 <= num_tokens <= parent.num_computed_tokens, (num_tokens, parent.num_computed_tokens)
        assert child.token_ids[:num_tokens] == parent.token_ids[:num_tokens], "fork of a different prefix"
        num_shared = -(-num_tokens // self.block_size)
        assert num_shared <= len(parent.block_table), (num_shared, len(parent.block_table))
        assert parent.seq_id in self._seq_root, f"parent seq {parent.seq_id} holds no allocation"
        self._seq_root[child.seq_id] = self._seq_root[parent.seq_id]
        child.block_table = parent.block_table[:num_shared]
        for block_id in child.block_table:
            assert self.blocks[block_id].ref_count >= 1
            self.blocks[block_id].ref_count += 1
        child.block_hashes = parent.block_hashes[: num_tokens // self.block_size]
        child.num_computed_tokens = child.num_cached_tokens = num_tokens

    def free(self, seq: Sequence, register: bool = True) -> None:
        """Drop the sequence's references; tail blocks go to the free list first, so they are reused
        before head blocks, which are the likelier prefix hits. Full computed blocks are registered first
        so a finished sequence's prompt and output stay reusable (every planned token was launched);
        ``register=False`` after a failed step, whose KV writes may not have happened. A swapped
        sequence's host copy is dropped too."""
        if seq.seq_id in self._swapped:
            seq.block_table = self._drop_swapped(seq)  # the shared blocks it kept: released below
            register = False
        if register and self.enable_prefix_caching and seq.seq_id in self._seq_root:
            self._register_full_blocks(seq)
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            assert block.ref_count >= 1, f"block {block_id} freed with ref_count {block.ref_count}"
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.hash is None:
                    self._free_plain.append(block_id)
                else:
                    self._free_cached[block_id] = None
        seq.block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0
        self._seq_root.pop(seq.seq_id, None)

    def reset_prefix_cache(self) -> None:
        """Forget every hash (the weights changed). Blocks in use stay in use; a new chain seed makes
        blocks that running sequences register later (their KV began under old weights) unreachable from
        chains started after the reset."""
        for block_id in self._hash_to_block.values():
            block = self.blocks[block_id]
            block.hash = block.parent_hash = None
            block.token_ids = ()
        self._free_plain.extend(self._free_cached)
        self._free_cached.clear()
        self._hash_to_block.clear()
        self._epoch += 1
        self._root = _root_hash(self._epoch)

    def check_invariants(self, seqs: Iterable[Sequence]) -> None:
        """Assert the pool's bookkeeping is consistent with ``seqs`` (every live sequence holding blocks):
        hash chains match each sequence's tokens, reference counts match holders, the free lists hold
        exactly the unreferenced blocks (hashed ones in the cached list), the hash index is exact, and every
        host block is either free or held by exactly one swapped, non-resident sequence.
        For tests and debugging; O(blocks + tokens)."""
        holders = [0] * self.num_blocks
        host_held = [b for record in self._swapped.values() for on_host, b in record if on_host]
        assert sorted(host_held + list(self._free_host)) == list(range(self.num_host_blocks)), "host pool leak"
        for seq in seqs:
            swapped = seq.seq_id in self._swapped
            assert not swapped or not seq.block_table, f"seq {seq.seq_id} swapped and resident"
            num_held = len(self._swapped[seq.seq_id]) if swapped else len(seq.block_table)
            kept = [b for on_host, b in self._swapped[seq.seq_id] if not on_host] if swapped else []
            assert len(seq.block_hashes) <= num_held, f"seq {seq.seq_id}: more hashes than blocks"
            assert num_held * self.block_size >= seq.num_computed_tokens, f"seq {seq.seq_id}"
            parent = self._seq_root.get(seq.seq_id)
            assert parent is not None or not seq.block_table, f"seq {seq.seq_id} holds blocks but no chain seed"
            for i, h in enumerate(seq.block_hashes):
                tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
                assert h == self.hash_fn(parent, tokens), f"seq {seq.seq_id}: block {i}'s hash is not its chain"
                parent = h
            for block_id in [*seq.block_table, *kept]:
                holders[block_id] += 1
        assert all(self.blocks[i].hash is None for i in self._free_plain), "a plain free block holds a hash"
        assert all(self.blocks[i].hash is not None for i in self._free_cached), "a cached free block lost its hash"
        free = list(self._free_plain) + list(self._free_cached)
        assert len(free) == len(set(free)) == self.num_free_blocks, "a block is free twice"
        free_set = set(free)
        for block in self.blocks:
            assert block.ref_count == holders[block.block_id], (block.block_id, block.ref_count)
            assert (block.block_id in free_set) == (block.ref_count == 0), f"block {block.block_id} free/used mismatch"
        for h, block_id in self._hash_to_block.items():
            block = self.blocks[block_id]
            assert block.hash == h and len(block.token_ids) == self.block_size, f"index entry of block {block_id}"
        assert all(b.hash is None or self._hash_to_block.get(b.hash) == b.block_id for b in self.blocks)
        assert self.enable_prefix_caching or not self._hash_to_block

    # ---- internals ------------------------------------------------------------------------------------

    def _needs_copy(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether the block the next write lands in is shared (a fork's partial prompt block)."""
        idx = seq.num_computed_tokens // self.block_size
        if num_new_tokens == 0 or idx >= len(seq.block_table):
            return False
        return self.blocks[seq.block_table[idx]].ref_count > 1

    def _take_free_block(self) -> int:
        if self._free_plain:
            block_id = self._free_plain.popleft()
        else:
            block_id, _ = self._free_cached.popitem(last=False)
            block = self.blocks[block_id]
            assert block.hash is not None and self._hash_to_block[block.hash] == block_id
            del self._hash_to_block[block.hash]
            block.hash = block.parent_hash = None
            block.token_ids = ()
        block = self.blocks[block_id]
        assert block.ref_count == 0, f"free block {block_id} has ref_count {block.ref_count}"
        block.ref_count = 1
        return block_id

    def _register_full_blocks(self, seq: Sequence) -> None:
        """Register blocks full of known, computed tokens (placeholders are only ever trailing)."""
        bs = self.block_size
        num_full = min(seq.num_computed_tokens, seq.num_known_tokens) // bs
        for i in range(len(seq.block_hashes), num_full):
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            assert PLACEHOLDER not in tokens, f"seq {seq.seq_id}: placeholder before num_known_tokens"
            parent = seq.block_hashes[-1] if seq.block_hashes else self._seq_root[seq.seq_id]
            h = self.hash_fn(parent, tokens)
            block = self.blocks[seq.block_table[i]]
            if block.hash is None and h not in self._hash_to_block:
                block.hash, block.parent_hash, block.token_ids = h, parent, tokens
                self._hash_to_block[h] = block.block_id
            else:
                # Already registered: by a sibling sharing this very block, or another block holds the
                # same content (computed twice concurrently) and stays the one lookups find.
                assert block.hash in (None, h), f"block {block.block_id} re-registered under another hash"
            seq.block_hashes.append(h)
