"""bench/pool_bench.py's kill round (issue 24: "a replica killed mid-round loses no group") against a fake pool: the
victim is killed once the first group is back, and the record says whether every group came back once and whole."""

from __future__ import annotations

import types

import pytest

from rollout import SamplingParams
from tests.script_helpers import load_bench


class FakePool:
    """Yields groups in order; after a kill, the victim's groups (odd indices) come back late, as requeued work does.
    ``drop`` / ``dup`` / ``short`` break the round the way a faulty pool would."""

    def __init__(self, params, drop=(), dup=(), short=()):
        self.params, self.drop, self.dup, self.short = params, set(drop), set(dup), set(short)
        self.members = [types.SimpleNamespace(actor=f"actor-{i}") for i in range(2)]
        self.killed, self.waited = [], 0
        self.ray = types.SimpleNamespace(kill=self._kill)
        self.last_round = {}

    def _kill(self, actor, no_restart):
        assert no_restart
        self.killed.append(actor)

    def _out(self, i):
        p = self.params[i]
        k = p.max_tokens - (1 if i in self.short else 0)
        return types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=[1] * k) for _ in range(p.n)])

    def generate_iter(self, prompts, params):
        order = [0] + [i for i in range(1, len(prompts)) if i % 2 == 0] + [i for i in range(len(prompts)) if i % 2]
        for i in order:
            if i in self.drop:
                continue
            yield i, self._out(i)
            if i in self.dup:
                yield i, self._out(i)
        resubmitted = [i for i in range(len(prompts)) if i % 2] if self.killed else []
        self.last_round = {"failures": [{"replica": 1, "resubmitted": resubmitted}] if self.killed else [],
                           "resubmitted_groups": resubmitted}

    def wait_ready(self):
        self.waited += 1
        self.members[1] = types.SimpleNamespace(actor="actor-1-replacement")


@pytest.fixture(scope="module")
def pool_bench():
    return load_bench("pool_bench")


def _params(k):
    return [SamplingParams(n=1 + i % 3, max_tokens=4 + i, ignore_eos=True) for i in range(k)]


def test_kill_round_passes_when_every_group_comes_back_once_and_whole(pool_bench):
    params = _params(6)
    pool = FakePool(params)
    rec = pool_bench.kill_round(pool, [[1, 2]] * 6, params)
    assert pool.killed == ["actor-1"] and pool.waited == 1
    assert rec["ok"] and rec["killed"] and rec["replaced"] and rec["returned"] == 6
    assert rec["failed_replicas"] == [1] and rec["resubmitted_groups"] == [1, 3, 5]
    assert rec["generated_tokens"] == sum(p.n * p.max_tokens for p in params)
    assert not rec["missing"] and not rec["returned_twice"] and not rec["wrong_length"]


@pytest.mark.parametrize("fault, key, want", [("drop", "missing", [3]), ("dup", "returned_twice", [5]),
                                               ("short", "wrong_length", [2])])
def test_kill_round_fails_a_lost_repeated_or_cut_group(pool_bench, fault, key, want):
    params = _params(6)
    rec = pool_bench.kill_round(FakePool(params, **{fault: want}), [[1, 2]] * 6, params)
    assert not rec["ok"] and rec[key] == want
