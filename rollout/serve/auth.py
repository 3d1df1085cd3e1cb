"""Who may call the server, and where its admin routes may reach (README "Security").

``BearerAuth``: with a key (``server.api_key`` or ``$ROLLOUT_API_KEY``) every route but ``GET /health``
needs ``Authorization: Bearer <key>``, compared in constant time; 401 otherwise. ``weight_source``: the
address ``/init_weight_transfer`` may connect to, resolved once (the group connects to that IP, so a DNS
answer cannot change between the check and the connection) and checked against ``server.weight_sources``.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import socket
from typing import Any

from rollout.serve.errors import APIError, error_response

ENV_KEY = "ROLLOUT_API_KEY"
WORDS = ("loopback", "client")  # the loopback addresses; the address the request came from
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")


def api_key(configured: str | None) -> str | None:
    """The key in force: the config's, else the environment's, else none (no authentication)."""
    return configured or os.environ.get(ENV_KEY) or None


def exposure_warning(host: str, key: str | None) -> str | None:
    """The start-up warning for a server anyone on the network can call."""
    if key or _is_loopback_host(host):
        return None
    return (f"WARNING: rollout server on {host} without an API key: anyone who reaches this port can generate, "
            f"replace the weights and pause the engine. Set server.api_key (or ${ENV_KEY}), server.admin=false, "
            "or bind 127.0.0.1 (README: Security)")


def _is_loopback_host(host: str) -> bool:
    try:
        return host in LOOPBACK_HOSTS or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class BearerAuth:
    """ASGI middleware: 401 (OpenAI-shaped) for a request without the key; ``GET /health`` is always open."""

    def __init__(self, app: Any, key: str) -> None:
        self.app, self.key = app, key.encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or (scope["method"] == "GET" and scope["path"] == "/health"):
            await self.app(scope, receive, send)
            return
        given = dict(scope.get("headers") or ()).get(b"authorization", b"")
        scheme, _, token = given.partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key):
            await self.app(scope, receive, send)
            return
        reason = "no API key given" if not given else "the API key is not valid"
        response = error_response(401, f"{reason}: send 'Authorization: Bearer <key>' (server.api_key)",
                                  code="invalid_api_key")
        response.headers["WWW-Authenticate"] = "Bearer"
        await response(scope, receive, send)


def check_sources(sources: object) -> None:
    """``server.weight_sources``: a list of IPs, CIDR networks, 'loopback' and 'client'."""
    allowed = "a list of IP addresses, CIDR networks (10.0.0.0/8), 'loopback' and 'client'"
    if not isinstance(sources, (tuple, list)):
        raise ValueError(f"server.weight_sources={sources!r} is invalid: must be {allowed}")
    for s in sources:
        if s in WORDS:
            continue
        try:
            ipaddress.ip_network(s, strict=False)
        except (TypeError, ValueError):
            raise ValueError(f"server.weight_sources entry {s!r} is invalid: must be {allowed}") from None


def weight_source(master_address: str, client: str | None, sources: tuple[str, ...]) -> str:
    """The IP to connect to for ``master_address``; 403 unless every address it names is allowed."""
    refused = APIError(403, f"master_address {master_address!r} is not an allowed weight source; allowed: "
                            f"{list(sources)} (server.weight_sources)", param="master_address")
    try:
        infos = socket.getaddrinfo(master_address, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError, ValueError):
        raise refused from None
    ips = [_ip(info[4][0]) for info in infos]
    if not ips or not all(_allowed(ip, client, sources) for ip in ips):
        raise refused
    return str(ips[0])


def _allowed(ip: ipaddress.IPv4Address | ipaddress.IPv6Address, client: str | None, sources: tuple[str, ...]) -> bool:
    for s in sources:
        if s == "loopback" and ip.is_loopback:
            return True
        if s == "client":
            if client is not None and _valid(client) and ip == _ip(client):
                return True
        elif s not in WORDS and ip in ipaddress.ip_network(s, strict=False):
            return True
    return False


def _valid(address: str) -> bool:
    try:
        _ip(address)
        return True
    except ValueError:
        return False


def _ip(address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    ip = ipaddress.ip_address(address.split("%")[0])
    mapped = getattr(ip, "ipv4_mapped", None)  # ::ffff:10.0.0.1 is 10.0.0.1
    return mapped or ip
