"""A step failure fails only its requests; a dead engine loop is never mistaken for a live one: its requests
fail with the reason, the server's /health answers 503 only then, and a pool replica gives up (exits)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from rollout import SamplingParams
from rollout.engine.async_engine import AsyncEngine
from rollout.pool.replica import Replica
from rollout.serve.app import build_app
from rollout.serve.config import ServeConfig
from tests.engine_helpers import make_engine
from tests.test_engine_faults import FailingRunner
from tests.tiny_models import make_tiny_hf_model

TIMEOUT_S = 60


@pytest.fixture(scope="module")
def hf():
    return make_tiny_hf_model("llama")


def _long(max_tokens: int = 200) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def _kill(loop: AsyncEngine) -> None:
    """Break the loop thread outside a step (a bug in its own bookkeeping) while a stream runs."""
    def boom(request_id, since=None):
        raise AssertionError("injected loop bug")

    loop.engine.partial_output = boom
    loop.submit([1, 2, 3], _long(), on_partial=lambda out: None)
    loop._thread.join(TIMEOUT_S)
    assert not loop._thread.is_alive()


@pytest.mark.parametrize("abort_breaks", [False, True])
def test_a_dead_loop_fails_what_it_held_and_refuses_more(hf, abort_breaks):
    eng = make_engine(hf, block_size=4)
    loop = AsyncEngine(eng).start()
    held = loop.submit([4, 5, 6], _long())
    assert loop.alive
    if abort_breaks:  # the engine is broken too: cleaning up after the death raises, the futures still fail
        eng.abort = lambda request_id: 1 / 0
    _kill(loop)
    assert not loop.alive and isinstance(loop.error, AssertionError)
    with pytest.raises(RuntimeError, match="engine loop died: AssertionError"):
        held.result(TIMEOUT_S)
    with pytest.raises(RuntimeError, match="engine loop died"):
        loop.submit([1, 2, 3])
    with pytest.raises(RuntimeError, match="engine loop died"):
        loop.call(eng.get_stats).result(TIMEOUT_S)
    assert loop.num_queued_seqs() == 0


def test_health_is_503_only_while_the_loop_is_dead(hf):
    eng = make_engine(hf, block_size=4)
    app = build_app(eng, ServeConfig(), "tiny")
    with TestClient(app) as client:
        assert client.get("/health").status_code == 200
        eng.runner = FailingRunner(eng.runner, fail_at=1, where="execute", exc=RuntimeError("injected step fault"))
        r = client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4})
        assert r.status_code == 503 and "injected step fault" in r.json()["error"]["message"]
        assert client.get("/health").status_code == 200  # a failed step: the loop serves on
        assert client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4}).status_code == 200
        _kill(app.state.server.loop)
        r = client.get("/health")
        assert r.status_code == 503 and "injected loop bug" in r.json()["error"]["message"]


def test_a_replica_with_a_dead_loop_refuses_work(hf):
    """Outside Ray it raises; inside a Ray actor it exits, so the pool replaces it like any dead actor."""
    import asyncio

    replica = Replica(lambda: make_engine(hf, block_size=4))
    assert replica.ready()["max_num_seqs"] >= 1
    _kill(replica.loop)
    with pytest.raises(RuntimeError, match="engine loop is not running"):
        replica.ready()
    with pytest.raises(RuntimeError, match="engine loop is not running"):
        asyncio.run(replica.run("r0", [1, 2, 3], _long(4)))
