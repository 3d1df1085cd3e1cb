"""The waiting and running queues stay sorted by (arrival, seq_id) at O(log n) per insert or removal.

Was: every insert rebuilt the whole queue's keys (32,768 queued sequences took 102 s to add)."""

from __future__ import annotations

import math

import rollout.engine.scheduler as scheduler_module
from tests.test_scheduler import Harness


def count_keys(monkeypatch) -> list[int]:
    calls = [0]
    order = scheduler_module._order

    def counted(seq):
        calls[0] += 1
        return order(seq)

    monkeypatch.setattr(scheduler_module, "_order", counted)
    return calls


def test_queueing_many_requests_costs_log_n_each(monkeypatch):
    n = 20_000
    h = Harness(max_num_seqs=4, num_blocks=64)
    calls = count_keys(monkeypatch)
    rids = [h.add([1, 3, 4]) for _ in range(n)]
    assert h.sched.num_waiting == n and calls[0] <= 2 * n  # newcomers append: O(1)
    calls[0] = 0
    h.step()
    for rid in rids[: n // 2]:  # aborts from the front, the running ones and the middle: found by bisection
        h.sched.abort(rid)
    assert calls[0] <= 4 * (n // 2) * (math.log2(n) + 2), calls[0]
    waiting = [(s.arrival, s.seq_id) for s in h.sched.waiting]
    assert waiting == sorted(waiting) and len(waiting) == n - n // 2


def test_out_of_order_reinsertion_keeps_arrival_order(monkeypatch):
    h = Harness(max_num_seqs=8, max_num_batched_tokens=64, num_blocks=64)
    for _ in range(12):
        h.add([1, 3, 4], n=2)
    h.step()
    h.step()
    moved = h.sched.recompute_running()  # running sequences go back among newer waiting ones
    assert moved == 8
    keys = [(s.arrival, s.seq_id) for s in h.sched.waiting]
    assert keys == sorted(keys) and len(keys) == 24
    h.check()
