"""The server as something a hostile client reaches: the key, the admin surface, weight sources, request
templates, checkpoint paths (README "Security"). Two servers: ``locked`` (a key, a weights root, request
templates allowed, a short join cap) and ``plain`` (no key, ``server.admin=false``, templates refused)."""

from __future__ import annotations

import datetime
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from rollout.assets import materialize_default_model
from rollout.serve.auth import exposure_warning, weight_source
from rollout.serve.errors import APIError
from tests.script_helpers import ROOT
from tests.serve_helpers import Server
from trainer_hooks.client import RolloutClient, ServerError

KEY = "s3cret-key"
# 80 bytes that would loop 10^10 times; they write nothing, so only the time limit stops them (with `{{ i }}` in
# the loop a fast box hit the memory limit first and the test failed)
LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    cache = tmp_path_factory.mktemp("serve-cache")
    model_dir = materialize_default_model(cache)
    root = tmp_path_factory.mktemp("weights-root")
    locked = Server(f"model.cache_dir={cache}", f"server.api_key={KEY}", f"server.weights_root={root}",
                    "server.allow_request_chat_template=true", "server.max_weight_timeout_s=3")
    plain = Server(f"model.cache_dir={cache}", "server.admin=false")
    try:
        locked.wait_ready()
        plain.wait_ready()
        yield SimpleNamespace(locked=locked, plain=plain, root=root, model_dir=model_dir,
                              outside=tmp_path_factory.mktemp("outside"))
    finally:
        locked.stop()
        plain.stop()


def _call(server: Server, method: str, path: str, body=None, key: str | None = None, auth: str | None = None,
          timeout: float = 60) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"}
    if key is not None or auth is not None:
        headers["Authorization"] = auth if auth is not None else f"Bearer {key}"
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(server.url + path, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            text = r.read().decode()
            return r.status, json.loads(text) if text.startswith(("{", "[")) else {"text": text}
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read().decode())


ROUTES = [("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
          ("POST", "/pause"), ("POST", "/resume"), ("POST", "/sleep"), ("POST", "/init_weight_transfer"),
          ("POST", "/update_weights_from_disk"), ("GET", "/policy_version"), ("POST", "/health"), ("GET", "/nowhere"),
          ("POST", "/generate"), ("GET", "/get_model_info"), ("GET", "/server_info"), ("GET", "/flush_cache"),
          ("POST", "/init_weights_update_group"), ("POST", "/update_weights_from_distributed")]


@pytest.mark.parametrize("method, path", ROUTES)
def test_every_route_but_health_needs_the_key(env, method, path):
    for auth in (None, "Bearer wrong", f"Basic {KEY}", KEY, "Bearer "):
        status, body = _call(env.locked, method, path, {} if method == "POST" else None, auth=auth)
        assert status == 401, (auth, status, body)
        assert body["error"]["type"] == "authentication_error" and "Bearer" in body["error"]["message"]
    assert _call(env.locked, "GET", "/health")[0] == 200


def test_the_key_opens_every_route_and_the_client_sends_it(env, monkeypatch):
    assert _call(env.locked, "GET", "/v1/models", key=KEY)[0] == 200
    status, body = _call(env.locked, "POST", "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 2}, key=KEY)
    assert status == 200 and body["usage"]["completion_tokens"] == 2
    with pytest.raises(ServerError, match="401"):
        RolloutClient(env.locked.url, timeout_s=30, api_key="wrong").policy_version  # noqa: B018
    assert RolloutClient(env.locked.url, timeout_s=30, api_key=KEY).policy_version == 0
    monkeypatch.setenv("ROLLOUT_API_KEY", KEY)
    assert len(RolloutClient(env.locked.url, timeout_s=30).generate([[5, 6, 7]])[0].outputs[0].token_ids) == 16


def test_admin_off_removes_the_admin_routes(env):
    for path in ("/pause", "/resume", "/sleep", "/wake_up", "/reset_prefix_cache", "/init_weight_transfer",
                 "/update_weights", "/update_weights_from_disk", "/flush_cache", "/pause_generation",
                 "/continue_generation", "/init_weights_update_group", "/update_weights_from_distributed",
                 "/destroy_weights_update_group", "/release_memory_occupation", "/resume_memory_occupation"):
        status, body = _call(env.plain, "POST", path, {})
        assert status == 404 and body["error"]["type"] == "not_found_error", path
    for path in ("/policy_version", "/is_paused", "/is_sleeping", "/v1/models", "/get_model_info",
                 "/get_server_info"):  # reading stays
        assert _call(env.plain, "GET", path)[0] == 200, path
    info = _call(env.plain, "GET", "/server_info?config_format=json")[1]
    assert info["vllm_config"]["weight_transfer_config"] is None  # TRL stops before any weight call


def test_exposure_warning():
    assert exposure_warning("0.0.0.0", None) and "server.api_key" in exposure_warning("0.0.0.0", None)
    assert exposure_warning("::", None) and exposure_warning("10.1.2.3", None)
    assert exposure_warning("0.0.0.0", "k") is None
    assert exposure_warning("127.0.0.1", None) is None and exposure_warning("localhost", None) is None


def test_weight_sources():
    assert weight_source("localhost", "10.0.0.5", ("loopback", "client")) == "127.0.0.1"
    assert weight_source("10.0.0.5", "10.0.0.5", ("loopback", "client")) == "10.0.0.5"
    assert weight_source("10.1.2.3", None, ("10.0.0.0/8",)) == "10.1.2.3"
    for address, sources in (("10.0.0.6", ("loopback", "client")), ("127.0.0.1", ("client",)),
                             ("no.such.host.invalid", ("loopback",)), ("8.8.8.8", ("10.0.0.0/8",))):
        with pytest.raises(APIError, match="server.weight_sources") as e:
            weight_source(address, "10.0.0.5", sources)
        assert e.value.status == 403


def _init(server: Server, address: str, port: int, timeout_s: float = 600, key: str = KEY) -> tuple[int, dict]:
    info = {"master_address": address, "master_port": port, "world_size": 2, "backend": "gloo", "timeout_s": timeout_s}
    return _call(server, "POST", "/init_weight_transfer", info, key=key, timeout=120)


def test_init_weight_transfer_reaches_only_allowed_sources_and_echoes_nothing(env):
    status, body = _init(env.locked, "192.0.2.1", 29500)  # neither loopback nor this test's own address
    assert status == 403 and "server.weight_sources" in body["error"]["message"]
    port = int(env.locked.url.rsplit(":", 1)[1])  # the server's own HTTP port: it answers bytes, not a store
    t0 = time.monotonic()
    status, body = _init(env.locked, "127.0.0.1", port)
    assert status == 400 and time.monotonic() - t0 < 30
    message = body["error"]["message"]
    assert "1347703880" not in message and "Got" not in message and "HTTP" not in message, message


def test_an_idle_join_cannot_lock_out_the_trainer(env):
    """A store whose owner never forms the group holds the receiver at most server.max_weight_timeout_s (3 s)."""
    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, timeout=datetime.timedelta(seconds=60),
                          wait_for_workers=False)
    answers: list = []
    attacker = threading.Thread(target=lambda: answers.append(_init(env.locked, "127.0.0.1", store.port, 600)))
    t0 = time.monotonic()
    attacker.start()
    time.sleep(0.5)
    assert _init(env.locked, "127.0.0.1", store.port)[0] == 409  # the real trainer is refused while it waits
    attacker.join(60)
    assert answers and answers[0][0] == 400 and time.monotonic() - t0 < 20, answers
    client = RolloutClient(env.locked.url, timeout_s=60, api_key=KEY)
    model = torch.nn.Linear(2, 2)  # any push: refused by name, but only after the group formed
    with pytest.raises(ServerError, match="weight update rejected"):
        client.push_weights([("bogus.weight", model.weight.detach())])
    client.close()


def test_request_templates_are_refused_unless_allowed(env):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "chat_template": "{{ 'x' }}"}
    status, answer = _call(env.plain, "POST", "/v1/chat/completions", body)
    assert status == 400 and "server.allow_request_chat_template" in answer["error"]["message"]


def test_allowed_templates_render_in_a_bounded_worker(env):
    body = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 1,
            "chat_template": "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"}
    status, answer = _call(env.locked, "POST", "/v1/chat/completions", {**body, "return_token_ids": True}, key=KEY)
    assert status == 200, answer
    tok = _tokenizer(env)
    assert answer["prompt_token_ids"] == tok("<user>hello there", add_special_tokens=False)["input_ids"]
    slow: list = []
    t0 = time.monotonic()
    worker = threading.Thread(target=lambda: slow.append(_call(env.locked, "POST", "/v1/chat/completions",
                                                               {**body, "chat_template": LOOPS}, key=KEY)))
    worker.start()
    while worker.is_alive():
        t = time.monotonic()
        assert _call(env.locked, "GET", "/health")[0] == 200
        assert time.monotonic() - t < 1.0
        time.sleep(0.05)
    assert time.monotonic() - t0 < 3.0
    assert slow[0][0] == 400 and "did not finish" in slow[0][1]["error"]["message"]
    status, answer = _call(env.locked, "POST", "/v1/chat/completions",
                           {**body, "chat_template": "{{ 'x' * 5000000 }}"}, key=KEY)
    assert status == 400 and "characters" in answer["error"]["message"]
    status, answer = _call(env.locked, "POST", "/v1/chat/completions",
                           {**body, "chat_template": "{{ raise_exception('no') }}"}, key=KEY)
    assert status == 400 and "no" in answer["error"]["message"]


def _tokenizer(env):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(env.model_dir)


def _bad_checkpoints(env) -> dict[str, str]:
    good = next(env.model_dir.glob("*.safetensors")).read_bytes()
    made = {}
    for name, data in {"random": os.urandom(4096), "truncated": good[: len(good) // 2], "empty": b""}.items():
        d = env.root / name
        d.mkdir()
        (d / "model.safetensors").write_bytes(data)
        made[name] = "safetensors"
    d = env.root / "bad_index"
    d.mkdir()
    (d / "model.safetensors").write_bytes(good)
    (d / "model.safetensors.index.json").write_text("{not json")
    made["bad_index"] = "index"
    d = env.root / "fifo"
    d.mkdir()
    os.mkfifo(d / "model.safetensors")
    made["fifo"] = "regular file"
    (env.root / "a_file").write_text("x")
    made["a_file"] = "readable checkpoint directory"
    made["missing"] = "readable checkpoint directory"
    return made


def test_bad_checkpoints_are_json_4xx_and_fifos_are_never_opened(env):
    for name, needle in _bad_checkpoints(env).items():
        t0 = time.monotonic()
        status, body = _call(env.locked, "POST", "/update_weights_from_disk", {"path": str(env.root / name)}, key=KEY,
                             timeout=30)
        assert status == 400 and needle in body["error"]["message"], (name, body)
        assert time.monotonic() - t0 < 10
    status, body = _call(env.locked, "POST", "/update_weights_from_disk", {"path": "x" * 10_000}, key=KEY)
    assert status == 422 and body["error"]["param"] == "path"
    assert _call(env.locked, "GET", "/health")[0] == 200


def test_weights_root_confines_paths(env):
    shutil.copytree(env.model_dir, env.outside / "ckpt")
    (env.root / "link").symlink_to(env.outside / "ckpt")
    for path in (env.outside / "ckpt", env.root / "link", env.root / ".." / env.outside.name / "ckpt",
                 env.outside / "nowhere"):
        status, body = _call(env.locked, "POST", "/update_weights_from_disk", {"path": str(path)}, key=KEY)
        assert status == 403 and "server.weights_root" in body["error"]["message"], (path, body)
    inside = env.root / "good"
    shutil.copytree(env.model_dir, inside)
    status, body = _call(env.locked, "POST", "/update_weights_from_disk", {"path": str(inside), "version": 1}, key=KEY)
    assert status == 200 and body["policy_version"] == 1, body


HANG = """
import json, sys, threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
class H(BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        body = json.dumps({"error": {"message": "a weight transfer is already in progress"}}).encode()
        self.send_response(409); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
threading.Thread(target=srv.serve_forever, daemon=True).start()
from trainer_hooks.client import RolloutClient, ServerError
client = RolloutClient(f"http://127.0.0.1:{srv.server_address[1]}", timeout_s=120)
try:
    client.push_weights([("w", __import__("torch").ones(2))])
except ServerError as e:
    print("raised", e.status, flush=True)
"""


def test_client_exits_promptly_after_a_409_on_joining():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", HANG], cwd=ROOT, env=env, capture_output=True, text=True, timeout=100)
    assert "raised 409" in out.stdout, out.stdout + out.stderr
    assert time.monotonic() - t0 < 60 and out.returncode == 0


