"""The main job with an environment over a Ray pool (``rollout.env=... pool.replicas=2``, drain mode).

One job over a 2-replica pool (its own Ray session, shut down at the end of the module) serves the checks: its rows
against the in-process job's (greedy), and where each conversation's turns ran (one replica, prefix-cache hits from
turn 2 on). ``Affinity`` (the routing) is pure bookkeeping, checked without Ray.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from rollout.job import setup
from rollout.pool.dispatch import Affinity
from tests import script_helpers

ENV = ["rollout.env=tests.env_fixtures:ThreeTurns", "rollout.max_turns=4", "rollout.max_turn_tokens=5",
       "sampling.max_tokens=5", "sampling.temperature=0", "logger.progress=false", "logger.wandb.mode=disabled",
       "rollout.rounds=1", "data.num_prompts=3", "sampling.n=2"]
POOL = ["pool.replicas=2", "pool.gpus_per_replica=0"]


def test_affinity_keeps_a_key_on_its_replica_and_balances_new_ones() -> None:
    a = Affinity(max_keys=2)
    assert a.pick("c0", [0, 1]) == 0 and a.pick("c1", [0, 1]) == 1  # the least busy, ties to the lowest index
    assert a.pick("c0", [0, 1]) == 0 and a.pick("c1", [0, 1]) == 1  # sticky, though replica 0 is as busy
    a.done(0)
    a.done(0)
    assert a.pick(None, [0, 1]) == 0 and "None" not in a.keys and len(a.keys) == 2  # no key: not remembered
    assert a.pick("c1", [0]) == 0 and a.keys["c1"] == 0  # its replica takes no work: routed afresh, remembered
    a.done(1)  # replica 1 holds 1 request now, replica 0 two
    assert a.pick("c2", [0, 1]) == 1 and list(a.keys) == ["c1", "c2"]  # the least recently used key forgotten
    with pytest.raises(ValueError, match="no replica"):
        a.pick("c3", [])


def run_job(out: Path, cache: Path, *overrides: str) -> list[dict]:
    return script_helpers.run_job(out, cache, *ENV, *overrides)


@pytest.fixture(scope="module")
def pool_job(cache_dir: Path, tmp_path_factory):
    """The job over a 2-replica pool: its rows, the pool it built and every turn's output (request id, cached
    tokens, tokens before the turn)."""
    ray = pytest.importorskip("ray", reason="the pool needs Ray (pip install ray; see requirements.lock)")
    from rollout.envs.remote_turns import RemoteTurns

    pools, turns = [], []
    load_pool, step = setup.load_pool, RemoteTurns.step

    def capture_pool(*args, **kwargs):
        pools.append(load_pool(*args, **kwargs))
        return pools[-1]

    def recording_step(self):
        outs = step(self)
        turns.extend((o.request_id, o.num_cached_tokens, len(o.prompt_token_ids) + len(o.outputs[0].token_ids))
                     for o in outs if hasattr(o, "num_cached_tokens"))
        return outs

    mp = pytest.MonkeyPatch()
    mp.setattr(setup, "load_pool", capture_pool)
    mp.setattr(RemoteTurns, "step", recording_step)
    out = tmp_path_factory.mktemp("pool-job")
    try:
        rows = run_job(out, cache_dir, *POOL)
        yield rows, pools[0], turns, out
    finally:
        mp.undo()
        for p in pools:
            p.shutdown()
        if ray.is_initialized():
            ray.shutdown()


def test_job_over_a_pool_writes_the_in_process_jobs_multi_turn_rows(pool_job, cache_dir: Path, tmp_path: Path) -> None:
    rows, pool, _, out = pool_job
    assert len(rows) == 6 and sorted((r["group_id"], r["sample_index"]) for r in rows) == [
        (g, j) for g in range(3) for j in range(2)]
    for r in rows:
        mask, ids, lps = r["env_mask"], r["completion_ids"], r["logprobs"]
        assert len(mask) == len(ids) == len(lps) == len(r["policy_versions"])
        turns = sum(1 for i, m in enumerate(mask) if m == 1 and (i == 0 or mask[i - 1] == 0))
        assert r["num_turns"] == turns == 3 and r["reward"] == 3.0 and r["env_error"] is None
        assert all(lp == 0.0 for lp, m in zip(lps, mask) if m == 0) and 0 in mask
        assert any(lp != 0.0 for lp, m in zip(lps, mask) if m == 1)
        assert set(r["policy_versions"]) == {0} and r["policy_version"] == 0
    want = run_job(tmp_path / "engine", cache_dir)  # the same job on the in-process engine
    key = lambda r: (r["group_id"], r["sample_index"])
    for a, b in zip(sorted(rows, key=key), sorted(want, key=key)):
        assert (a["prompt_ids"], a["completion_ids"], a["env_mask"]) == (b["prompt_ids"], b["completion_ids"],
                                                                          b["env_mask"])


def test_every_turn_of_a_conversation_runs_on_one_replica_from_its_prefix_cache(pool_job) -> None:
    rows, pool, turns, _ = pool_job
    conv_ids = {f"round0-group{r['group_id']}-{r['sample_index']}" for r in rows}
    routed = {k: v for k, v in pool._affinity.keys.items() if k in conv_ids}
    assert set(routed) == conv_ids and set(routed.values()) == {0, 1}, routed  # both replicas served conversations
    by_conv: dict[str, list[tuple[int, int]]] = {}
    for rid, cached, length in turns:
        by_conv.setdefault(rid, []).append((cached, length))
    assert set(by_conv) == conv_ids and all(len(t) == 3 for t in by_conv.values()), by_conv
    block = 16  # the engine's default block size: every full block of the previous turn's sequence is cached
    for rid, t in by_conv.items():
        for (_, before), (cached, _) in zip(t, t[1:]):
            assert cached >= before // block * block > 0, (rid, t)


def test_partial_mode_with_an_environment_over_a_pool_is_refused_by_name(cache_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"rollout.mode='partial'.*pool.replicas=2.*rollout.env='tests.env_fixtures:"
                                         r"ThreeTurns'"):
        run_job(tmp_path / "p", cache_dir, *POOL, "rollout.mode=partial")


def test_a_turn_whose_replica_died_is_sent_again_with_the_same_tokens(pool_job) -> None:
    """A replica that died unnoticed (between rounds): a submitted request to it is resent to the other one
    after the replacement starts, with the tokens the live replica gives (the seed is fixed at submit)."""
    from rollout import SamplingParams

    _, pool, _, _ = pool_job
    pool.wait_ready()
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=6, ignore_eos=True)
    prompt = [5, 6, 7, 8, 9]
    want = pool.submit(prompt, params, "alive").result(timeout=120).outputs[0].token_ids
    key, victim = "doomed", pool._affinity.pick("doomed", [0])  # the key's replica: 0
    pool._request_done(victim)
    actor, failures = pool.members[victim].actor, len(pool.failures)
    pool.ray.kill(actor, no_restart=True)
    out = pool.submit(prompt, params, key).result(timeout=180)
    assert list(out.outputs[0].token_ids) == list(want)
    assert [f["replica"] for f in pool.failures[failures:]] == [victim]
    pool.wait_ready()
    assert pool.members[victim].actor is not actor
