"""What one client can do to everyone else (issue 20): huge prompts, slow stream readers, stalled sockets.

One server in a subprocess with small limits; each test checks the fault is refused or cut off quickly and
that ``/health`` and generation keep answering meanwhile.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.request
from urllib.parse import urlsplit

import pytest
import torch

from rollout.assets import materialize_default_model
from rollout.serve import connections, streaming
from tests.serve_helpers import Server

MAX_CONNECTIONS, HEADER_S, BODY_S = 24, 1.5, 2.0


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    cache = tmp_path_factory.mktemp("serve-cache")
    materialize_default_model(cache)
    srv = Server(f"model.cache_dir={cache}", "server.stream_buffer_tokens=256",
                 f"server.max_connections={MAX_CONNECTIONS}", f"server.header_timeout_s={HEADER_S}",
                 f"server.body_timeout_s={BODY_S}", "server.log_level=warning")
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


def _health_latency(server: Server, stop: threading.Event, worst: list[float]) -> None:
    while not stop.is_set():
        t0 = time.monotonic()
        with urllib.request.urlopen(server.url + "/health", timeout=30) as r:
            assert r.status == 200
        worst[0] = max(worst[0], time.monotonic() - t0)
        time.sleep(0.05)


def _metric(server: Server, name: str) -> float:
    text = server.get("/metrics")[1]
    return float(next(x for x in text.splitlines() if x.startswith(name + " ")).split()[1])


def _idle(server: Server, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _metric(server, "rollout_running_seqs") + _metric(server, "rollout_waiting_seqs") == 0:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "lorem ipsum " * ((4 << 20) // 12)}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "lorem ipsum " * ((4 << 20) // 12)}]}),
], ids=["completion", "chat"])
def test_a_4mib_prompt_is_refused_at_once_and_health_keeps_answering(server, path, body):
    """Before: tokenized on the event loop (11.9 s, /health blocked as long; 60 MiB got the server killed)."""
    stop, worst = threading.Event(), [0.0]
    watcher = threading.Thread(target=_health_latency, args=(server, stop, worst), daemon=True)
    watcher.start()
    try:
        t0 = time.monotonic()
        status, text = server.post(path, json.dumps(body))
        took = time.monotonic() - t0
    finally:
        stop.set()
        watcher.join(30)
    assert took < 3.0 and worst[0] < 1.0, (took, worst[0])
    err = json.loads(text)["error"]
    assert status == 400 and "max_chars_per_token" in err["message"] and err["code"] == "context_length_exceeded"
    status, text = server.post("/v1/completions", json.dumps({"prompt": "What is 2 + 3?", "max_tokens": 3}))
    assert status == 200 and len(json.loads(text)["choices"][0]["token_ids"]) == 3


def test_a_stream_nobody_reads_is_aborted_with_a_final_error_event(server):
    """Before: every step queued a full copy of the output for the reader, without limit (+461 MiB for 2
    streams); now a reader more than server.stream_buffer_tokens behind is cut off and its requests freed."""
    url = urlsplit(server.url)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: a small window
    sock.connect((url.hostname, url.port))
    body = json.dumps({"prompt": [1, 2, 3], "n": 64, "max_tokens": 400, "ignore_eos": True, "stream": True,
                       "logprobs": 0}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    try:
        time.sleep(1.0)
        assert _idle(server, 60), "the unread stream still holds its sequences"
        sock.settimeout(30)
        data = b""
        while not data.endswith(b"\r\n\r\n") and (chunk := sock.recv(1 << 16)):
            data += chunk
    finally:
        sock.close()
    events = [e for e in data.split(b"\n\n") if b"data: " in e]
    last = json.loads(events[-1].split(b"data: ", 1)[1])
    assert last["error"]["code"] == "slow_reader" and "stream_buffer_tokens" in last["error"]["message"]
    assert server.post("/v1/completions", json.dumps({"prompt": [1, 2], "max_tokens": 2}))[0] == 200


def _stalled(url, head: bytes, n: int) -> list[socket.socket]:
    socks = []
    for _ in range(n):
        s = socket.create_connection((url.hostname, url.port), timeout=10)
        s.sendall(head)
        socks.append(s)
    return socks


def _closed_by_server(s: socket.socket, timeout_s: float) -> bytes | None:
    """What the server sent before closing, or None if it kept the socket open for ``timeout_s``."""
    s.settimeout(timeout_s)
    data = b""
    try:
        while chunk := s.recv(4096):
            data += chunk
    except TimeoutError:
        return None
    except ConnectionResetError:
        pass
    return data


def test_stalled_sockets_are_capped_and_timed_out_and_logged_once_per_burst(server):
    """Before: no cap and no deadline for a request's head or body (300 stalled sockets under `ulimit -n 256`
    took every descriptor; asyncio then logged 93 MB in 22 s)."""
    url = urlsplit(server.url)
    heads = _stalled(url, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n", MAX_CONNECTIONS)
    bodies = _stalled(url, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{", 8)
    try:
        t0 = time.monotonic()
        refused = [_closed_by_server(s, 5) for s in bodies[-8:]]  # over the cap: 503 at once
        assert all(r is not None and r.startswith(b"HTTP/1.1 503") for r in refused), refused
        assert time.monotonic() - t0 < 5
        for s in heads:  # the head deadline closes them without an answer
            assert _closed_by_server(s, HEADER_S + 10) is not None
    finally:
        for s in heads + bodies:
            s.close()
    # a body that stops coming is cut off after server.body_timeout_s
    slow = _stalled(url, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{", 1)[0]
    try:
        t0 = time.monotonic()
        assert _closed_by_server(slow, BODY_S + 10) is not None and time.monotonic() - t0 > BODY_S * 0.8
    finally:
        slow.close()
    assert server.get("/health")[0] == 200
    log = "".join(server.lines)
    assert 1 <= log.count("refused connections over server.max_connections") <= 2, log[-2000:]
    assert log.count("did not send a request in time") <= 2, log[-2000:]


def test_the_connection_cap_stays_under_the_open_file_limit(monkeypatch):
    monkeypatch.setattr(connections.resource, "getrlimit", lambda _: (256, 256))
    cap, backlog = connections.connection_cap(1024)
    assert 1 <= cap < 256 - backlog and backlog <= 64
    monkeypatch.setattr(connections.resource, "getrlimit", lambda _: (1 << 20, 1 << 20))
    assert connections.connection_cap(1024) == (1024, 2048)


def test_incremental_detokenization_equals_the_whole_decode_and_stays_short(tmp_path):
    """Each step decodes a few tokens, not the whole output (before: 204 ms a step for 64 x 16K tokens)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(materialize_default_model(tmp_path))
    words = tok.encode("Streaming sends deltas: naïve café, 日本語, emoji 🎉 and 2 + 3 = 5.", add_special_tokens=False)
    g = torch.Generator().manual_seed(0)
    for ids in (words * 20, torch.randint(0, tok.vocab_size, (400,), generator=g).tolist()):
        s, text, longest = streaming._Choice(), "", 0
        for k in range(0, len(ids), 3):
            text += streaming._decode_new(streaming.decoder(tok), s, ids[k : k + 3])
            longest = max(longest, len(s.window))
        whole = tok.decode(ids, skip_special_tokens=True)
        assert whole.startswith(text) and len(whole) - len(text) <= 8 and longest <= streaming.MAX_UNREAD + 6


@pytest.mark.parametrize("step", [1, 2, 3, 4, 5])
def test_characters_split_over_tokens_landing_together_stream_whole(tmp_path, step):
    """Several multi-byte characters split over byte tokens in one batch: the streamed text is the whole decode
    (before: after 8 unread tokens a half character went out as U+FFFD and the next one was lost: 'café, 日本�')."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(materialize_default_model(tmp_path))
    for sentence in ("café, 日本語 🎉", "日本語🎉🎉🎉 ok", "naïve café, 日本語, emoji 🎉"):
        ids = tok.encode(sentence, add_special_tokens=False)
        s, text = streaming._Choice(), ""
        for k in range(0, len(ids), step):
            text += streaming._decode_new(streaming.decoder(tok), s, ids[k : k + step])
        assert text == tok.decode(ids, skip_special_tokens=True) == sentence
