"""Which replica takes the next group: pure bookkeeping, no Ray, no torch.

A group (one request with ``n`` samples) is never split. It goes to the live replica with the most
free sequence slots, and only while that replica has room (or nothing in flight at all, so a group
larger than any replica's capacity still runs somewhere); otherwise it waits in the queue until a
group finishes. Replicas therefore pull work as they free up: a replica stuck on long samples keeps
its batch full while the others drain the queue. The pool hands groups out longest-first (by
``max_tokens``), so the longest samples start early instead of becoming one replica's lonely tail.

A request sent on its own (``RolloutPool.submit``: an environment conversation's turn) goes where
``Affinity`` says: the replica its routing key went to before, so that replica's prefix cache serves the
earlier turns, else the active replica with the fewest such requests in flight.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field


@dataclass
class Slot:
    capacity: int  # sequences the replica may hold in flight
    load: int = 0  # sequences in flight now
    groups: set[int] = field(default_factory=set)  # indices of the groups in flight here
    active: bool = True  # False while dead or catching up: takes no work


class Dispatcher:
    def __init__(self, sizes: list[int], slots: dict[int, Slot], order: list[int] | None = None) -> None:
        self.sizes = sizes  # samples per group, by group index
        self.slots = slots
        self.queue: deque[int] = deque(range(len(sizes)) if order is None else order)
        self.done: set[int] = set()

    def next_assignment(self) -> tuple[int, int] | None:
        """(group, replica) for the queue's head, or None when no live replica has room for it."""
        if not self.queue:
            return None
        g = self.queue[0]
        best, best_free = None, None
        for i, s in self.slots.items():
            if not s.active:
                continue
            free = s.capacity - s.load
            if (s.load == 0 or free >= self.sizes[g]) and (best_free is None or free > best_free):
                best, best_free = i, free
        if best is None:
            return None
        self.queue.popleft()
        s = self.slots[best]
        s.load += self.sizes[g]
        s.groups.add(g)
        return g, best

    def finish(self, group: int, replica: int) -> bool:
        """Record a result; False if the group was already done (a duplicate, dropped by the caller)."""
        s = self.slots[replica]
        if group in s.groups:
            s.groups.discard(group)
            s.load -= self.sizes[group]
        if group in self.done:
            return False
        self.done.add(group)
        return True

    def fail(self, replica: int) -> list[int]:
        """A replica died: its unfinished groups go back to the front of the queue."""
        s = self.slots[replica]
        lost = sorted(g for g in s.groups if g not in self.done)
        s.groups.clear()
        s.load = 0
        s.active = False
        self.queue.extendleft(reversed(lost))
        return lost

    @property
    def finished(self) -> bool:
        return len(self.done) == len(self.sizes)


class Affinity:
    """Sticky routing of single requests by key: a key keeps its replica while that replica takes work.

    A new key (or one whose replica is inactive) goes to the active replica with the fewest requests in
    flight (ties: the lowest index); a request without a key too, and it is not remembered. The
    ``max_keys`` most recently used keys are remembered (an older conversation's next turn is merely
    routed afresh)."""

    def __init__(self, max_keys: int = 1 << 16) -> None:
        self.max_keys = max_keys
        self.keys: OrderedDict[str, int] = OrderedDict()
        self.load: dict[int, int] = {}  # replica -> requests in flight

    def pick(self, key: str | None, active: list[int]) -> int:
        if not active:
            raise ValueError("no replica takes work")
        i = self.keys.get(key) if key is not None else None
        if i not in active:
            i = min(active, key=lambda r: (self.load.get(r, 0), r))
        if key is not None:
            self.keys[key] = i
            self.keys.move_to_end(key)
            while len(self.keys) > self.max_keys:
                self.keys.popitem(last=False)
        self.load[i] = self.load.get(i, 0) + 1
        return i

    def done(self, replica: int) -> None:
        """A request picked for ``replica`` came back (or failed)."""
        self.load[replica] = max(self.load.get(replica, 0) - 1, 0)
