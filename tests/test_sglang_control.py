"""SGLang control routes on an in-process server (tiny random Llama, ids only): ``/abort_request`` by
``rid`` answers the aborted caller as SGLang does, and a weight-update group nobody answers fails fast.

Requests replayed from SGLang's ``io_struct`` (``GenerateReqInput.rid``, ``AbortReq``) and slime's
``init_weights_update_group`` payload."""

from __future__ import annotations

import json
import threading
import time

import pytest
from fastapi.testclient import TestClient

from rollout.serve.app import build_app
from rollout.serve.config import ServeConfig
from tests.engine_helpers import make_engine
from tests.tiny_models import make_tiny_hf_model


@pytest.fixture(scope="module")
def client():
    eng = make_engine(make_tiny_hf_model("llama", seed=0), block_size=4, num_blocks=256, max_model_len=512)
    with TestClient(build_app(eng, ServeConfig(), "tiny")) as c:
        yield c


def _running(client, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if client.get("/get_server_info").json()["internal_states"][0]["num_running_reqs"]:
            return
        time.sleep(0.02)
    raise AssertionError("the request never started")


LONG = {"max_new_tokens": 400, "ignore_eos": True, "temperature": 0}


@pytest.mark.parametrize("stream", [False, True])
def test_abort_request_by_rid_answers_with_finish_reason_abort(client, stream):
    answers = {}
    body = {"input_ids": [5, 6, 7, 8, 9], "sampling_params": LONG, "rid": f"slime-{stream}", "stream": stream}
    caller = threading.Thread(target=lambda: answers.setdefault("r", client.post("/generate", json=body)))
    caller.start()
    _running(client)
    assert client.post("/abort_request", json={"rid": f"slime-{stream}"}).json() == {"success": True}
    caller.join(60)
    r = answers["r"]
    assert r.status_code == 200, r.text
    if stream:
        events = [x[6:] for x in r.text.split("\n\n") if x.startswith("data: ")]
        assert events[-1] == "[DONE]"
        item = json.loads(events[-2])
    else:
        item = r.json()
    meta = item["meta_info"]
    assert meta["finish_reason"]["type"] == "abort" and meta["id"] == f"slime-{stream}"
    assert len(item["output_ids"]) == meta["completion_tokens"] < 400  # the tokens so far, kept
    assert client.get("/get_server_info").json()["internal_states"][0]["num_running_reqs"] == 0


def test_init_weights_update_group_with_nobody_at_the_rendezvous_fails_within_seconds(client):
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    body = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
            "group_name": "slime-pp_0", "backend": "gloo"}  # slime's payload (gloo: a CPU engine)
    t0 = time.monotonic()
    r = client.post("/init_weights_update_group", json=body)
    elapsed = time.monotonic() - t0
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert f"127.0.0.1:{port}" in message and "slime-pp_0" in message and "nobody is listening" in message
    assert elapsed < 10, f"took {elapsed:.1f} s (server.max_weight_timeout_s is 120 s)"
    assert client.post("/generate", json={"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}}
                       ).status_code == 200  # the server serves on


def test_abort_request_while_paused_answers_once_generation_continues(client):
    answers = {}
    body = {"input_ids": [5, 6, 7], "sampling_params": LONG, "rid": "paused-1"}
    caller = threading.Thread(target=lambda: answers.setdefault("r", client.post("/generate", json=body)))
    caller.start()
    _running(client)
    assert client.post("/pause_generation", json={"mode": "in_place"}).status_code == 200
    assert client.post("/abort_request", json={"rid": "paused-1"}).json() == {"success": True}
    caller.join(1.0)
    assert caller.is_alive()  # paused: nothing steps, not even to hand the aborted output over
    assert client.post("/continue_generation", json={}).status_code == 200
    caller.join(60)
    item = answers["r"].json()
    assert item["meta_info"]["finish_reason"]["type"] == "abort" and 0 < len(item["output_ids"]) < 400


def test_init_weight_transfer_with_nobody_at_the_address_fails_within_seconds(client):
    """Ours and TRL/vLLM's init (``/init_weight_transfer_engine``) too: before, ~35 s (TCPStore retries)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    body = {"master_address": "127.0.0.1", "master_port": port, "world_size": 2, "rank_offset": 1,
            "backend": "gloo", "timeout_s": 60}
    t0 = time.monotonic()
    r = client.post("/init_weight_transfer", json=body)
    elapsed = time.monotonic() - t0
    assert r.status_code == 400 and f"127.0.0.1:{port}" in r.json()["error"]["message"], r.text
    assert elapsed < 10, f"took {elapsed:.1f} s"


def test_release_and_resume_memory_occupation(client):
    """SGLang's sleep / wake (slime colocated): 409 while a request runs, bytes freed when idle, serving after."""
    done = threading.Event()
    threading.Thread(target=lambda: (client.post("/generate", json={"input_ids": [5, 6], "sampling_params": LONG}),
                                     done.set()), daemon=True).start()
    _running(client)
    r = client.post("/release_memory_occupation", json={})
    assert r.status_code == 409 and "/pause_generation" in r.json()["error"]["message"], r.text
    assert client.post("/pause_generation", json={"mode": "abort"}).status_code == 200 and done.wait(30)
    r = client.post("/release_memory_occupation", json={})
    assert r.status_code == 200 and r.json()["released_bytes"] > 0, r.text
    assert client.post("/resume_memory_occupation", json={}).status_code == 200
    assert client.post("/continue_generation", json={}).status_code == 200
    assert client.post("/generate", json={"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}}
                       ).status_code == 200


@pytest.mark.parametrize("body", [None, b"", b"{", b"\xff\xfe", b"[1]", b'{"rid": 5}'])
def test_abort_request_with_a_bad_body_is_a_400_and_the_server_serves_on(body):
    """An empty, truncated or non-UTF-8 body was a 500 (the JSON error escaped the handler); now a 400 naming what
    is allowed, and the next request is served."""
    app = build_app(make_engine(make_tiny_hf_model("llama"), block_size=4), ServeConfig(), "tiny")
    with TestClient(app, raise_server_exceptions=False) as c:
        r = c.post("/abort_request", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400, (r.status_code, r.text)
        assert "rid" in r.json()["error"]["message"] or "JSON" in r.json()["error"]["message"], r.text
        assert c.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2}).status_code == 200
