"""Connection guards around uvicorn's h11 protocol: nothing a client does with sockets exhausts the server.

- A cap on open connections (``server.max_connections``, held under the open-file limit): one past it is
  answered 503 and closed at once, so stalled sockets can never use up the file descriptors (asyncio logs
  thousands of tracebacks a second once ``accept`` fails with EMFILE).
- Deadlines for a request's head (``server.header_timeout_s``, from the connection's start or the next
  request's first byte) and body (``server.body_timeout_s``, after the head): slowloris; an idle
  keep-alive connection is closed after ``server.keep_alive_s``; a head over ``server.max_header_kib`` is
  refused by h11.
- Refusals and timeouts are logged once per burst (``Burst``), never once per connection.
"""

from __future__ import annotations

import asyncio
import logging
import os
import resource
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("rollout.serve")

FD_SPARE = 32  # descriptors kept free beyond those open at start and the accept batch: checkpoints, logs...
_BODY = b'{"error":{"message":"too many open connections (server.max_connections)","type":"service_unavailable",' \
        b'"param":null,"code":503}}'
REFUSED = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
           b"retry-after: 1\r\ncontent-length: %d\r\n\r\n%s" % (len(_BODY), _BODY))


def connection_cap(max_connections: int) -> tuple[int, int]:
    """(open connections allowed, listen backlog) within the open-file limit, raised to the hard limit first.

    asyncio accepts up to ``backlog`` sockets in one go before any is handed to the protocol, so the
    backlog (at most 2048) is kept free too: the guard then closes extra connections before ``accept``
    could fail with EMFILE.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = max_connections + _open_fds() + FD_SPARE + 2048
    if hard == resource.RLIM_INFINITY or hard > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want if hard == resource.RLIM_INFINITY else hard, hard))
            soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        except (ValueError, OSError):
            pass
    backlog = max(16, min(2048, soft // 4))
    reserve = _open_fds() + FD_SPARE + backlog
    cap = max(1, soft - reserve)
    if cap < max_connections:
        log.warning("server.max_connections=%d is more than the open-file limit (%d, %d kept for other files and "
                    "accepts) allows; capping open connections at %d (raise `ulimit -n` for more)",
                    max_connections, soft, reserve, cap)
    return min(max_connections, cap), backlog


def _open_fds() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:  # not Linux: a guess
        return 64


class Burst:
    """Counts repeated events and logs one line per ``window_s`` with how many there were."""

    def __init__(self, what: str, window_s: float = 10.0) -> None:
        self.what, self.window_s = what, window_s
        self.count, self.total, self._flush = 0, 0, None

    def add(self, loop: asyncio.AbstractEventLoop) -> None:
        self.count += 1
        self.total += 1
        if self._flush is None:  # the first of a burst is logged at once, the rest when the window closes
            self._log()
            self._flush = loop.call_later(self.window_s, self._close)

    def _log(self) -> None:
        log.warning("%s: %d (%d since start)", self.what, self.count, self.total)
        self.count = 0

    def _close(self) -> None:
        self._flush = None
        if self.count:
            self._log()


def guarded_protocol(max_connections: int, header_timeout_s: float, body_timeout_s: float) -> type[H11Protocol]:
    """An ``H11Protocol`` with the guards; one class per server, so its counters belong to that server."""
    refused = Burst(f"refused connections over server.max_connections={max_connections}")
    timed_out = Burst("closed connections that did not send a request in time (server.header_timeout_s / "
                      "server.body_timeout_s)")

    class Guarded(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None
        _refused = False
        _reading_body = False

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            if len(self.connections) >= max_connections:
                self._refused = True
                refused.add(self.loop)
                transport.write(REFUSED)
                transport.close()
                return
            super().connection_made(transport)
            self._arm(header_timeout_s)

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            if not self._refused:
                super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return
            if self._deadline is None and self.conn.their_state is h11.IDLE:
                self._arm(header_timeout_s)  # the next request on a kept-alive connection starts
            super().data_received(data)

        def handle_events(self) -> None:
            super().handle_events()
            if self.conn.their_state is h11.SEND_BODY and not self._reading_body:
                self._reading_body = True  # the head is in; now the body has its own deadline
                self._arm(body_timeout_s)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._reading_body = False
            self._disarm()  # idle now: uvicorn's keep-alive timeout closes it; the next byte re-arms

        def _arm(self, seconds: float) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(seconds, self._expired)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expired(self) -> None:
            self._deadline = None
            if self.conn.their_state in (h11.IDLE, h11.SEND_BODY) and not self.transport.is_closing():
                timed_out.add(self.loop)
                self.transport.close()

    return Guarded


def quiet_accept_errors(loop: asyncio.AbstractEventLoop) -> None:
    """One log line per burst for asyncio's "accept() out of system resource" (it would log a traceback per
    retry, thousands a second, once the process is out of file descriptors)."""
    burst = Burst("socket.accept() out of system resource (open files: see `ulimit -n`)")

    def handler(lp: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if "out of system resource" in str(context.get("message", "")):
            burst.add(lp)
        else:
            lp.default_exception_handler(context)

    loop.set_exception_handler(handler)
