"""The Ray pool on the CPU: 2 replicas of the tiny Llama, one Ray session for the whole file.

Ray's start and each actor's imports take tens of seconds on a small box, so one pool serves every
test, in order: parity with one engine, a gloo weight broadcast, then a replica killed mid-round
(its replacement must catch up to the broadcast weights before taking work), then sleep / wake_up (pushes
while asleep, a replica killed while asleep). The session has room for a second pool of 2, which
rollout-train-ppo pool.replicas=2 builds for itself (last test).
"""

from __future__ import annotations

import re

import pytest
import torch

from rollout import SamplingParams
from rollout.pool import EngineFactory, build_rollout
from rollout.pool.dispatch import Dispatcher, Slot
from tests.engine_helpers import assert_matches_hf, random_prompts
from tests.tiny_models import make_tiny_hf_model, save_tiny_checkpoint

OPTIONS = dict(max_model_len=128, num_blocks=64)


def _params(k: int, max_tokens: int = 12) -> list[SamplingParams]:
    return [SamplingParams(n=1 + i % 3, max_tokens=4 + (i * 5) % max_tokens, seed=100 + i, ignore_eos=True)
            for i in range(k)]


def _tokens(outs) -> list[list[list[int]]]:
    return [[list(c.token_ids) for c in sorted(o.outputs, key=lambda c: c.index)] for o in outs]


# ---- dispatch: pure bookkeeping, no Ray ------------------------------------------------------------
def test_dispatch_never_splits_a_group_and_pulls_work_as_replicas_free_up() -> None:
    slots = {0: Slot(capacity=4), 1: Slot(capacity=4)}
    d = Dispatcher([3, 3, 3, 8], slots)
    assert d.next_assignment() == (0, 0)
    assert d.next_assignment() == (1, 1)
    assert d.next_assignment() is None  # 1 free slot each: group 2 (n=3) waits, whole
    assert d.finish(0, 0)
    assert d.next_assignment() == (2, 0)
    assert d.finish(1, 1)
    assert d.next_assignment() == (3, 1)  # n=8 > capacity: runs alone on an idle replica
    assert d.fail(0) == [2] and list(d.queue) == [2] and not slots[0].active
    assert d.next_assignment() is None  # replica 1 is full, replica 0 is dead
    assert d.finish(3, 1) and d.next_assignment() == (2, 1) and d.finish(2, 1)
    assert d.finished and not d.finish(2, 1)  # a late duplicate is refused


def test_one_replica_is_the_in_process_engine(tiny_ckpt) -> None:
    from rollout import Engine

    engine = build_rollout(1, EngineFactory(str(tiny_ckpt), dtype="float32", device="cpu", options=OPTIONS))
    assert isinstance(engine, Engine)
    with pytest.raises(ValueError, match="replicas"):
        build_rollout(0, lambda: None)


# ---- the pool -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("pool") / "tiny-llama"
    save_tiny_checkpoint(make_tiny_hf_model("llama", seed=0), path)
    return path


@pytest.fixture(scope="module")
def pool(tiny_ckpt):
    ray = pytest.importorskip("ray", reason="the pool needs Ray (pip install ray; see requirements.lock)")
    from rollout.pool import ray_setup
    from rollout.pool.pool import RolloutPool

    factory = EngineFactory(str(tiny_ckpt), dtype="float32", device="cpu", options=OPTIONS)
    try:
        ray_setup.init("local", num_cpus=4)  # room for this pool's 2 replicas and a script's 2
        p = RolloutPool(2, factory, max_inflight_seqs=4, torch_threads=1, transfer_timeout_s=60,
                        start_timeout_s=240)
    except Exception as e:  # noqa: BLE001 - no Ray on this box is a skip, not a failure
        if ray.is_initialized():
            ray.shutdown()
        pytest.skip(f"Ray could not start a local pool here: {e!r}")
    yield p
    p.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def reference(tiny_ckpt):
    return EngineFactory(str(tiny_ckpt), dtype="float32", device="cpu", options=OPTIONS)()


def test_pool_outputs_equal_one_engine(pool, reference) -> None:
    prompts = random_prompts(10, 256, hi=20, seed=3)
    params = _params(len(prompts))
    want = reference.generate(prompts, params)
    got = pool.generate(prompts, params)
    assert _tokens(got) == _tokens(want)
    for g, w in zip(got, want):
        for a, b in zip(sorted(g.outputs, key=lambda c: c.index), sorted(w.outputs, key=lambda c: c.index)):
            assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)
    r = pool.last_round
    assert r["groups"] == 10 and all(v > 0 for v in r["groups_per_replica"].values()), r  # both replicas worked
    assert r["generated_tokens"] == sum(len(t) for o in _tokens(want) for t in o)
    seen = sorted(i for i, _ in pool.generate_iter(prompts[:4], params[:4]))
    assert seen == [0, 1, 2, 3]
    s = pool.stats()
    assert len(s["replicas"]) == 2 and all(r["tokens_per_s"] > 0 for r in s["replicas"])
    assert s["pool"]["tokens_per_s"] > 0 and 0.0 <= s["pool"]["kv_cache_usage"] <= 1.0
    with pytest.raises(ValueError, match="prompt 1"):
        pool.generate([[1, 2], [1] * 200], SamplingParams(max_tokens=4))


def test_gloo_broadcast_reaches_every_replica(pool) -> None:
    trainer = make_tiny_hf_model("llama", seed=7)
    assert pool.update_weights(trainer.named_parameters(), version=7) == 7
    assert [r["policy_version"] for r in pool.stats()["replicas"]] == [7, 7]
    prompt, greedy = [5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for i, m in enumerate(pool.members):  # ask each replica directly: both must hold the trainer's weights
        out = pool.ray.get(m.actor.run.remote(f"check-{i}", prompt, greedy))
        assert_matches_hf(trainer, prompt, out.outputs[0], temperature=0.0, atol=1e-4)
        assert set(out.outputs[0].policy_versions) == {7}
    bad = [(n, t[:1] if n.endswith("q_proj.weight") else t) for n, t in trainer.named_parameters()]
    with pytest.raises(ValueError, match="q_proj"):
        pool.update_weights(bad, version=8)
    assert [r["policy_version"] for r in pool.stats()["replicas"]] == [7, 7]  # refused: nothing changed


def test_the_pool_refuses_a_bad_version_before_any_byte_moves(pool) -> None:
    """The version rule is Engine.update_weights' (each replica's engine decides, in its metadata verdict):
    out of [current, 2**63), not an int, or a bool is a ValueError naming the value; nothing changes."""
    assert pool.policy_version == 7  # test_gloo_broadcast_reaches_every_replica's push
    other = make_tiny_hf_model("llama", seed=11).named_parameters()
    pairs = [(n, t.detach()) for n, t in other]
    for bad in (2**63, -1, True, 1.5, 6):
        with pytest.raises(ValueError, match=re.escape("in [7, 2**63)") + ".*" + re.escape(f"got {bad!r}")):
            pool.update_weights(pairs, version=bad)
    assert pool.policy_version == 7 and [r["policy_version"] for r in pool.stats()["replicas"]] == [7, 7]
    prompt, greedy = [5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for i, m in enumerate(pool.members):  # each replica still serves the seed-7 weights
        out = pool.ray.get(m.actor.run.remote(f"version-{i}", prompt, greedy))
        assert_matches_hf(make_tiny_hf_model("llama", seed=7), prompt, out.outputs[0], temperature=0.0, atol=1e-4)


def test_killed_replica_loses_no_group(pool, reference) -> None:
    reference.update_weights(make_tiny_hf_model("llama", seed=7).named_parameters(), version=7)  # as pushed
    prompts = random_prompts(16, 256, hi=16, seed=5)
    params = _params(len(prompts), max_tokens=16)
    victim = pool.members[0].actor
    got: dict[int, object] = {}
    for i, out in pool.generate_iter(prompts, params):
        assert i not in got, f"group {i} came back twice"
        got[i] = out
        if len(got) == 1:
            pool.ray.kill(victim, no_restart=True)
    assert sorted(got) == list(range(len(prompts)))
    r = pool.last_round
    assert [f["replica"] for f in r["failures"]] == [0] and r["resubmitted_groups"], r
    assert _tokens([got[i] for i in range(len(prompts))]) == _tokens(reference.generate(prompts, params))
    pool.wait_ready()  # the replacement started, copied a survivor's weights, and is active
    assert pool.members[0].actor != victim
    assert [r["policy_version"] for r in pool.stats()["replicas"]] == [7, 7]
    again = pool.generate(prompts[:6], params[:6])  # and the regenerated tokens equal the first run's
    assert _tokens(again) == _tokens([got[i] for i in range(6)])
    assert pool.update_weights(make_tiny_hf_model("llama", seed=8).named_parameters()) == 8  # a new group


def test_a_replica_whose_engine_loop_died_is_replaced(pool, reference) -> None:
    """The actor still answers, but its AsyncEngine thread is gone: it exits, and the pool replaces it."""
    version = pool.policy_version
    reference.update_weights([(n, t.detach()) for n, t in pool_weights(version)], version=version)
    victim = pool.members[1].actor
    pool.ray.get(victim.__ray_call__.remote(lambda replica: replica.loop.close()))
    prompts = random_prompts(8, 256, hi=16, seed=6)
    params = _params(len(prompts), max_tokens=16)
    assert _tokens(pool.generate(prompts, params)) == _tokens(reference.generate(prompts, params))
    pool.wait_ready()
    assert pool.members[1].actor != victim
    assert [r["policy_version"] for r in pool.stats()["replicas"]] == [version, version]


def pool_weights(version: int):
    """The weights the earlier tests pushed last (``test_killed_replica_loses_no_group``: seed 8)."""
    assert version == 8, version
    return make_tiny_hf_model("llama", seed=8).named_parameters()


def test_trl_rollout_over_the_pool(pool) -> None:
    from types import SimpleNamespace

    from tests.engine_helpers import hf_logprobs
    from trainer_hooks.trl import TRLRollout

    model = make_tiny_hf_model("llama", seed=9)
    tok = lambda text: {"input_ids": [[ord(ch) % 256 for ch in t] for t in text]}  # noqa: E731 - ids only
    args = SimpleNamespace(temperature=1.0, top_p=1.0, top_k=0, min_p=None, max_completion_length=5,
                           generation_kwargs=None, repetition_penalty=1.0)
    trainer = SimpleNamespace(model=model, processing_class=tok, state=SimpleNamespace(global_step=9),
                              accelerator=SimpleNamespace(unwrap_model=lambda m: m), args=args, eos_token_ids=[],
                              chat_template_kwargs={}, tools=None, chat_template=None)
    prompts = ["1 + 1 =", "1 + 1 =", "7 * 8 =", "7 * 8 =", "7 * 8 =", "2 + 2 ="]
    rows = TRLRollout(pool)(prompts, trainer)  # pushes the trainer's weights (version 9) to every replica
    assert rows["policy_version"] == [9] * 6 and pool.policy_version == 9
    for p, c, lps in zip(rows["prompt_ids"], rows["completion_ids"], rows["logprobs"]):
        ref = hf_logprobs(model, p, c, 1.0)[torch.arange(len(c)), torch.tensor(c)]
        assert torch.allclose(torch.tensor(lps), ref, atol=1e-4)


def test_the_pool_steps_for_the_job_as_an_engine_does(pool) -> None:
    from rollout import SteppedBackend

    assert isinstance(pool, SteppedBackend)
    view = pool
    prompts = random_prompts(5, 256, hi=12, seed=11)
    params = _params(5)
    ids = [view.add_request(p, sp, f"job-{i}") for i, (p, sp) in enumerate(zip(prompts, params))]
    before = view.get_stats()
    got = {}
    while view.has_unfinished_requests():
        for out in view.step():
            got[out.request_id] = out
    assert sorted(got) == sorted(ids) and not view.has_unfinished_requests()
    assert view.add_request(prompts[0], params[0], "next-round") == "next-round"  # as the job's next round does
    assert [o.request_id for o in view.step()] == ["next-round"] and not view.has_unfinished_requests()
    assert _tokens([got[i] for i in ids]) == _tokens(pool.generate(prompts, params))
    after = view.get_stats()
    assert after.num_generated_tokens > before.num_generated_tokens and after.policy_version == pool.policy_version


def test_job_actor_over_the_pool_logs_per_replica_metrics(pool) -> None:
    from types import SimpleNamespace

    from rollout.job.data import Prompt
    from rollout.job.rounds import RoundDriver

    prompts = random_prompts(4, 256, hi=12, seed=12)
    dataset = SimpleNamespace(tokenizer=None, get=lambda g: Prompt(g % 4, "", tuple(prompts[g % 4]), None))
    actor = RoundDriver(pool, dataset, SamplingParams(n=2, max_tokens=5, ignore_eos=True), num_prompts=4)
    m = actor.run_round().metrics
    assert m["pool/alive"] == 2 and m["num_samples"] == 8
    for i in (0, 1):
        assert m[f"pool/replica_{i}/alive"] == 1 and m[f"pool/replica_{i}/round_tokens_per_s"] >= 0
        assert m[f"pool/replica_{i}/kv_cache_usage"] >= 0 and f"pool/replica_{i}/tokens_per_s" in m
    assert m["ttft_mean_s"] > 0 and m["prefix_cache_hit_rate"] is not None


def test_a_replica_found_dead_at_a_push_is_replaced_and_the_push_lands_everywhere(pool) -> None:
    pool.ray.kill(pool.members[1].actor, no_restart=True)  # dies between rounds, unnoticed
    trainer = make_tiny_hf_model("llama", seed=10)
    assert pool.update_weights(trainer.named_parameters(), version=10) == 10
    assert pool.failures[-1]["replica"] == 1
    assert [r["policy_version"] for r in pool.stats()["replicas"]] == [10, 10]
    prompt, greedy = [9, 8, 7], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    out = pool.ray.get(pool.members[1].actor.run.remote("check-new", prompt, greedy))
    assert_matches_hf(trainer, prompt, out.outputs[0], temperature=0.0, atol=1e-4)


# ---- sleep / wake_up: a co-located trainer's memory --------------------------------------------------
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _sleep_state(pool) -> list[tuple[bool, int]]:
    """(the engine says it sleeps, the level the pool holds it at), per replica."""
    return [(r["sleeping"], r["sleep_level"]) for r in pool.stats()["replicas"]]


def _each_matches(pool, trainer, version: int, tag: str) -> None:
    """Each replica, asked directly, serves ``trainer``'s weights (logprobs within 1e-4) at ``version``."""
    prompt = [3, 1, 4, 1, 5]
    for i, m in enumerate(pool.members):
        out = pool.ray.get(m.actor.run.remote(f"{tag}-{i}", prompt, GREEDY)).outputs[0]
        assert_matches_hf(trainer, prompt, out, temperature=0.0, atol=1e-4)
        assert set(out.policy_versions) == {version}


def test_sleep_wake_round_trip_and_no_work_while_asleep(pool) -> None:
    pool.update_weights(make_tiny_hf_model("llama", seed=20).named_parameters())
    assert all(r["weight_staging_bytes"] > 0 for r in pool.stats()["replicas"])  # kept between broadcasts
    prompts = random_prompts(6, 256, hi=12, seed=21)
    params = _params(len(prompts))
    before = pool.generate(prompts, params)
    assert pool.sleep(level=1) > 0 and pool.is_sleeping and pool.sleeping_replicas == [0, 1]
    stats = pool.stats()
    assert stats["pool"]["sleeping"] == [0, 1] and all(r["weight_staging_bytes"] == 0 for r in stats["replicas"])
    assert _sleep_state(pool) == [(True, 1)] * 2
    assert pool.sleep(level=2) == 0 and _sleep_state(pool) == [(True, 1)] * 2  # asleep already, as Engine.sleep
    with pytest.raises(RuntimeError, match=r"replicas \[0, 1\] are asleep .*call wake_up\(\) before generate"):
        pool.generate(prompts, params)
    with pytest.raises(RuntimeError, match="replica 1 is asleep"):  # a replica refuses work itself, and lives
        pool.ray.get(pool.members[1].actor.run.remote("asleep", prompts[0], params[0]))
    pool.wake_up(replicas=[1])
    assert pool.sleeping_replicas == [0] and _sleep_state(pool) == [(True, 1), (False, 0)]
    with pytest.raises(RuntimeError, match=r"replicas \[0\] are asleep"):  # no round on part of the pool
        pool.generate(prompts, params)
    pool.wake_up()
    assert not pool.is_sleeping and _sleep_state(pool) == [(False, 0)] * 2
    after = pool.generate(prompts, params)
    assert _tokens(after) == _tokens(before)
    for a, b in zip(after, before):
        for x, y in zip(sorted(a.outputs, key=lambda c: c.index), sorted(b.outputs, key=lambda c: c.index)):
            assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-5)
    assert all(v > 0 for v in pool.last_round["groups_per_replica"].values())  # both woken replicas worked
    with pytest.raises(ValueError, match="sleep level must be 1 or 2, got 3"):
        pool.sleep(level=3)
    with pytest.raises(ValueError, match=r"replica indices in 0\.\.1"):
        pool.sleep(replicas=[2])
    assert not pool.is_sleeping


@pytest.mark.parametrize("level", [1, 2])
def test_push_while_asleep_is_served_after_wake(pool, level) -> None:
    pool.sleep(level=level)
    trainer = make_tiny_hf_model("llama", seed=20 + level)
    version = pool.update_weights(trainer.named_parameters())
    stats = pool.stats()["replicas"]
    assert [r["policy_version"] for r in stats] == [version] * 2 and _sleep_state(pool) == [(True, level)] * 2
    assert all(r["weight_staging_bytes"] == 0 for r in stats)  # the broadcast's staging buffer went again
    pool.wake_up()
    _each_matches(pool, trainer, version, f"woken-{level}")


def test_replica_killed_while_asleep_comes_back_asleep_with_current_weights(pool) -> None:
    pool.sleep(level=2)
    victim = pool.members[0].actor
    pool.ray.kill(victim, no_restart=True)
    trainer = make_tiny_hf_model("llama", seed=30)
    version = pool.update_weights(trainer.named_parameters())  # finds it dead: replaced, caught up, asleep, pushed
    assert pool.failures[-1]["replica"] == 0 and pool.members[0].actor != victim
    assert _sleep_state(pool) == [(True, 2)] * 2
    assert [r["policy_version"] for r in pool.stats()["replicas"]] == [version] * 2
    pool.wake_up()
    _each_matches(pool, trainer, version, "reborn")


def test_train_ppo_script_over_a_pool(pool, tmp_path) -> None:
    """rollout-train-ppo pool.replicas=2 (its own 2 replicas, in this file's Ray session), replica 0 co-located
    (weights by shared memory) and asleep through each update (train.sleep_level=1): after every push each
    replica is at the trainer's version and samples with the policy's logprobs; per-replica metrics."""
    import json
    import math

    from rollout.cli import train_ppo
    from tests.script_helpers import compose
    from trainer_hooks.ppo import Sequences, token_logprobs

    checks, pools = [], []

    def after_push(ppo) -> None:
        p, prompt = ppo.engine, [1, 4, 40, 41, 42]
        stats = p.stats()["replicas"]
        versions = [r["policy_version"] for r in stats]
        asleep = [r["index"] for r in stats if r["sleeping"]]  # the co-located replica only, pushed while asleep
        p.wake_up()
        gaps = []
        for i, m in enumerate(p.members):  # each replica directly, not whichever the pool picks
            c = p.ray.get(m.actor.run.remote(f"ppo-{ppo.version}-{i}", prompt, SamplingParams(max_tokens=4, seed=i)))
            c = c.outputs[0]
            with torch.no_grad():
                want = token_logprobs(ppo.policy, Sequences.build([prompt], [list(c.token_ids)], ppo.pad_id), 1.0)
            gaps.append((want[0, : len(c.token_ids)] - torch.tensor(c.logprobs)).abs().max().item())
        if asleep:
            p.sleep(1)  # as the update left it: the pool's sleep_replicas, [0]
        checks.append((ppo.version, versions, gaps, asleep))
        pools.append(p)

    out = train_ppo.run(compose(
        "train_ppo", f"output_dir={tmp_path}", f"model.cache_dir={tmp_path / 'cache'}", "pool.replicas=2",
        "pool.gpus_per_replica=0", "pool.colocate_with_trainer=true", "train.sleep_level=1", "train.steps=2",
        "sampling.n=2", "sampling.max_tokens=4", "data.num_prompts=2", "train.ppo.ppo_epochs=1",
        "train.ppo.num_minibatches=2", "logger.wandb.mode=disabled",
    ), on_push=after_push)
    assert [v for v, *_ in checks] == list(range(5))  # the first sync, then one push per optimizer step
    assert all(versions == [v, v] and max(gaps) <= 1e-4 for v, versions, gaps, _ in checks), checks
    assert [asleep for *_, asleep in checks] == [[]] + [[0]] * 4, checks  # awake at the first sync only
    assert pools[0] is not pool and pools[0].members == []  # the script's own pool, shut down at the end
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2]
    for x in lines:
        assert all(math.isfinite(x[k]) for k in ("ppo/policy_loss", "ppo/value_loss", "reward")), x
        assert x["rollout/logprob_gap_max"] <= 1e-4 and x["rollout/policy_version"] == 2 * (x["step"] - 1)
        assert x["rollout/pool/alive"] == 2 and x["rollout/generated_tokens"] > 0
        assert all(x[f"rollout/pool/replica_{i}/alive"] == 1 for i in (0, 1))
        assert sum(x[f"rollout/pool/replica_{i}/round_tokens_per_s"] for i in (0, 1)) > 0


def test_a_refused_push_returns_only_once_every_replica_is_done_with_it() -> None:
    """A replica posts its refusal verdict and only then returns from its receive call (freeing its receiver):
    the sender must wait for that, or its next push meets the replica still inside this one ('a weight transfer
    is already in progress', seen in CI). Fake Ray: each answer finishes only while the sender waits for it."""
    from types import SimpleNamespace

    from rollout.pool.transfer import PoolTransfer

    class TaskError(Exception):
        def __init__(self, cause: BaseException) -> None:
            self.cause = cause

        def as_instanceof_cause(self) -> BaseException:
            return self.cause

    class Answer:
        done = False

    class FakeRay:
        exceptions = SimpleNamespace(RayActorError=RuntimeError, RayTaskError=TaskError)

        def wait(self, refs, num_returns, timeout):
            if timeout:  # the replica finishes its call while someone waits for it
                for r in refs:
                    r.done = True
            ready = [r for r in refs if r.done]
            return ready, [r for r in refs if not r.done]

        def get(self, ref):
            raise TaskError(ValueError("version must be an int in [7, 2**63), got True"))

    transfer = PoolTransfer(SimpleNamespace(ray=FakeRay(), members=[]), timeout_s=5.0)
    answers = [Answer(), Answer()]
    with pytest.raises(ValueError, match="got True"):
        transfer.refused(answers)
    assert all(a.done for a in answers)
