"""Every entry point over every backend: {main job, GRPO, PPO, async GRPO, partial mode} x {in-process
``Engine``, ``RolloutPool`` of 2 CPU replicas, ``RolloutClient`` to a local server}.

Where a combination is supported it runs a few steps on the embedded model (float32, CPU) and must give the
in-process engine's rows; where it is not, the entry point refuses the backend at its door naming what it
accepts. One Ray session and one server serve the whole file (they take tens of seconds to start).
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pyarrow.parquet as pq
import pytest
import torch

from rollout import ContinuousBackend, Engine, RolloutBackend, SamplingParams, SteppedBackend
from rollout.assets import materialize_default_model
from rollout.job.main import run
from rollout.pool import EngineFactory
from tests.script_helpers import compose
from tests.serve_helpers import Server

OPTIONS = dict(max_model_len=256, num_blocks=96, block_size=16, max_num_seqs=16)
N = 2  # samples per group


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    path = tmp_path_factory.mktemp("matrix-cache")
    materialize_default_model(path)
    return path


@pytest.fixture(scope="module")
def model_dir(cache):
    return materialize_default_model(cache)


@pytest.fixture(scope="module")
def backends(cache, model_dir):
    """name -> backend, all on the same checkpoint in float32."""
    from rollout.pool import ray_setup
    from rollout.pool.pool import RolloutPool
    from trainer_hooks.client import RolloutClient

    server = Server(f"model.cache_dir={cache}", "model.dtype=float32",
                    *(f"engine.{k}={v}" for k, v in OPTIONS.items()))
    engine = Engine.from_pretrained(str(model_dir), dtype="float32", device="cpu", **OPTIONS)
    ray = ray_setup.init("local", num_cpus=6)  # room for this pool and the one the main job builds
    pool = RolloutPool(2, EngineFactory(str(model_dir), "float32", "cpu", None, OPTIONS), gpus_per_replica=0)
    client = RolloutClient(server.wait_ready().url)
    try:
        yield {"engine": engine, "pool": pool, "client": client}
    finally:
        client.close()
        pool.close()
        server.stop()
        ray.shutdown()


def _rows(outs):
    return [[(list(c.token_ids), [round(x, 4) for x in c.logprobs]) for c in sorted(o.outputs, key=lambda c: c.index)]
            for o in outs]


def _close(a, b, atol=1e-4):
    """Same tokens, logprobs within ``atol`` (float32 through different batch shapes)."""
    assert len(a) == len(b)
    for ra, rb in zip(a, b):
        for (ta, la), (tb, lb) in zip(ra, rb):
            assert ta == tb
            assert torch.allclose(torch.tensor(la), torch.tensor(lb), atol=atol)


def test_each_backend_is_a_rollout_backend(backends):
    engine, pool, client = backends["engine"], backends["pool"], backends["client"]
    assert all(isinstance(b, RolloutBackend) for b in backends.values())
    assert isinstance(engine, ContinuousBackend) and isinstance(pool, SteppedBackend)
    assert not isinstance(pool, ContinuousBackend) and not isinstance(client, SteppedBackend)
    assert engine.limits == client.limits  # the server runs the same engine settings
    assert pool.limits.replicas == 2 and pool.limits.max_model_len == engine.limits.max_model_len
    for b in backends.values():
        assert b.describe() and b.policy_version == 0 and not b.is_sleeping


def test_generate_is_the_same_everywhere(backends):
    prompts = [[5 + i, 17, 40 + 3 * i, 9] for i in range(5)]
    params = SamplingParams(n=N, temperature=0.0, max_tokens=6, ignore_eos=True)
    ref = _rows(backends["engine"].generate(prompts, params))
    for name in ("pool", "client"):
        _close(_rows(backends[name].generate(prompts, params)), ref)


# ---- PPO: rollout, one update (push), rollout again (first: versions start at 0 and never go back) ----------
def test_ppo_is_the_same_everywhere(backends, model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer_hooks.ppo import PPOConfig, ValueModel
    from trainer_hooks.ppo_loop import EnginePPO

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    rows = [{"prompt": f"What is {i} + {i + 1}?"} for i in range(3)]
    reward = lambda completions, **_: [float(len(c)) for c in completions]  # noqa: E731
    got = {}
    for name, backend in backends.items():
        torch.manual_seed(1)
        policy = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        ref = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        value = ValueModel.from_pretrained(str(model_dir), dtype=torch.float32)
        ppo = EnginePPO(backend, policy, value, ref, tok, reward, PPOConfig(),
                        SamplingParams(n=N, temperature=1.0, max_tokens=5, seed=11, ignore_eos=True))
        ppo.step(rows)  # rollout, update, push
        batch = ppo.rollout(rows)
        got[name] = (batch.seqs.completion_ids.tolist(), batch.behaviour_logp, batch.versions)
    for name in ("pool", "client"):
        assert got[name][0] == got["engine"][0] and got[name][2] == got["engine"][2]
        assert torch.allclose(got[name][1], got["engine"][1], atol=1e-4)


# ---- GRPO: TRLRollout, with a weight push per step --------------------------------------------------------
def _trainer(tok, model, step):
    args = SimpleNamespace(temperature=0.0, top_p=1.0, top_k=0, min_p=None, max_completion_length=6,
                           generation_kwargs=None, repetition_penalty=1.0, num_generations=N, seed=0)
    return SimpleNamespace(model=model, processing_class=tok, state=SimpleNamespace(global_step=step),
                           accelerator=SimpleNamespace(unwrap_model=lambda m: m), args=args,
                           eos_token_ids=[tok.eos_token_id], chat_template_kwargs={}, tools=None, chat_template=None,
                           num_generations=N)


def test_grpo_rollouts_and_pushes_are_the_same_everywhere(backends, model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer_hooks.trl import TRLRollout

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    prompts = [p for p in ("What is 2 + 3?", "What is 10 + 7?") for _ in range(N)]
    got = {}
    for name, backend in backends.items():
        torch.manual_seed(0)
        with torch.no_grad():
            for p in model.parameters():  # a "trained" policy: the same perturbation for every backend
                p.add_(torch.randn_like(p) * 0.02)
        rollout = TRLRollout(backend)
        rows = rollout(prompts, _trainer(tok, model, step=10))
        assert rows["policy_version"] == [10] * len(prompts) and backend.policy_version == 10
        got[name] = rows
        with torch.no_grad():  # undo, so the next backend starts from the checkpoint's weights again
            torch.manual_seed(0)
            for p in model.parameters():
                p.sub_(torch.randn_like(p) * 0.02)
    for name in ("pool", "client"):
        assert got[name]["completion_ids"] == got["engine"]["completion_ids"]
        for a, b in zip(got[name]["logprobs"], got["engine"]["logprobs"]):
            assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-4)


# ---- where a backend cannot serve an entry point: refused at the door ---------------------------------------
def test_partial_mode_and_async_grpo_need_the_in_process_engine(backends):
    from trainer_hooks.async_grpo import EngineRolloutWorker
    from trainer_hooks.trl import TRLRollout

    for name in ("pool", "client"):
        with pytest.raises(TypeError, match=r"TRLRollout\(mode='partial'\) needs an in-process Engine"):
            TRLRollout(backends[name], mode="partial")
        with pytest.raises(TypeError, match="async GRPO rollout worker needs an in-process Engine"):
            EngineRolloutWorker(backends[name], SimpleNamespace(column_names=["prompt"], __len__=lambda: 1), [],
                                None, SimpleNamespace(num_generations=N))


def test_the_main_job_drives_only_stepped_backends(backends):
    from rollout.job.rounds import RoundDriver

    with pytest.raises(TypeError, match=r"the main job \(rollout.mode=drain\) needs an Engine or a RolloutPool"):
        RoundDriver(backends["client"], None, SamplingParams(), num_prompts=1)
    with pytest.raises(TypeError, match=r"the main job \(rollout.mode=partial\) needs an in-process Engine"):
        RoundDriver(backends["pool"], None, SamplingParams(), num_prompts=1, mode="partial")


# ---- the main job: pool.replicas=2 writes pool.replicas=1's rows ------------------------------------------
def _job_rows(cache, out, *overrides):
    cfg = compose("config", f"output_dir={out}", f"model.cache_dir={cache}", "logger.wandb.mode=disabled",
                  "sampling.temperature=0", "sampling.max_tokens=6", f"sampling.n={N}", "data.num_prompts=4",
                  "rollout.rounds=2", "model.dtype=float32", *overrides)
    run(cfg)
    table = pq.read_table(out / "trajectories").to_pylist()
    return sorted((r["round"], r["group_id"], r["sample_index"], r["completion_ids"],
                   [round(x, 4) for x in r["logprobs"]], r["policy_version"]) for r in table)


def test_main_job_over_a_pool_writes_the_engines_rows(backends, cache, tmp_path):
    one = _job_rows(cache, tmp_path / "one")
    two = _job_rows(cache, tmp_path / "two", "pool.replicas=2", "pool.gpus_per_replica=0")
    assert one == two and len(one) == 2 * 4 * N
    with pytest.raises(ValueError, match="rollout.mode='partial' is invalid: must be drain with pool.replicas=2"):
        _job_rows(cache, tmp_path / "three", "pool.replicas=2", "pool.gpus_per_replica=0", "rollout.mode=partial")


def test_a_pool_asking_for_gpus_ray_lacks_fails_at_once(backends, model_dir):
    from rollout.pool.pool import RolloutPool

    t0 = time.monotonic()
    with pytest.raises(ValueError, match=r"pool.gpus_per_replica=1 x pool.replicas=2 needs 2 GPUs"):
        RolloutPool(2, EngineFactory(str(model_dir), "float32", "cpu", None, OPTIONS), gpus_per_replica=1)
    assert time.monotonic() - t0 < 10
