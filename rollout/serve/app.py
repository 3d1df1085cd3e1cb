"""The FastAPI app around one engine, and ``serve`` to run it under uvicorn."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from rollout.engine.async_engine import AsyncEngine
from rollout.serve import admin, auth, connections, errors, generate, metrics, sglang, sglang_admin, templates
from rollout.serve.config import ServeConfig
from rollout.serve.state import ServerState, state
from rollout.serve.stats_log import log_stats
from rollout.serve.trl_server import router as trl_router


def build_app(engine: Any, config: ServeConfig, model_name: str, model_path: str | None = None) -> FastAPI:
    """The app; its lifespan starts the engine loop thread and stops it on shutdown."""
    loop = AsyncEngine(engine, stream_interval_s=config.server.stream_interval_s)
    st = ServerState(engine, loop, model_name, config.sampling, config.server.max_n or engine.config.max_num_seqs,
                     model_path, settings=config.server)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        connections.quiet_accept_errors(asyncio.get_running_loop())
        loop.start()
        if config.server.allow_request_chat_template:
            await asyncio.to_thread(templates.warm)  # the fork server imports jinja once, now
        logger = asyncio.ensure_future(log_stats(st, config.server.log_stats_s)) \
            if config.server.log_stats_s else None
        try:
            yield
        finally:
            if logger is not None:
                logger.cancel()
            loop.close()
            st.receiver.close()
            st.text_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="rollout", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = st
    app.add_middleware(errors.BodyLimit, max_bytes=config.server.max_body_mib << 20)
    if key := auth.api_key(config.server.api_key):
        app.add_middleware(auth.BearerAuth, key=key)  # added last: runs first, before the body is read
    errors.install(app)
    app.include_router(generate.router)
    app.include_router(sglang.router)
    app.include_router(trl_router)
    app.include_router(admin.status)
    if config.server.admin:
        app.include_router(admin.router)
        app.include_router(sglang_admin.router)

    @app.get("/health")
    async def health() -> Any:
        if not loop.alive:  # unhealthy only while the engine loop cannot serve (a failed step does not count)
            return errors.error_response(503, f"the engine loop is not running ({loop.error!r})")
        return JSONResponse({})

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        s = state(request)
        card = {"id": s.model_name, "object": "model", "created": int(time.time()), "owned_by": "rollout",
                "root": s.model_path or s.model_name, "max_model_len": s.engine.max_model_len,
                "policy_version": s.engine.policy_version, "limits": dataclasses.asdict(s.engine.limits)}
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def prometheus(request: Request) -> PlainTextResponse:
        s = state(request)
        stats = await s.run(s.engine.get_stats)
        return PlainTextResponse(metrics.render(stats, s), media_type="text/plain; version=0.0.4")

    return app


def serve(engine: Any, config: ServeConfig, model_name: str, model_path: str | None = None) -> None:
    """Bind, print the address (``server.port=0`` picks a free port), then serve until interrupted."""
    import uvicorn

    app = build_app(engine, config, model_name, model_path)
    family = socket.AF_INET6 if ":" in config.server.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((config.server.host, config.server.port))
    sock.listen(2048)  # connections queue from now on, so the address printed is usable at once
    host, port = sock.getsockname()[:2]
    if warning := auth.exposure_warning(config.server.host, auth.api_key(config.server.api_key)):
        print(warning, flush=True)
    print(f"rollout server: serving {model_name} on http://{host}:{port} (engine on {engine.device})", flush=True)
    c = config.server
    cap, backlog = connections.connection_cap(c.max_connections)
    protocol = connections.guarded_protocol(cap, c.header_timeout_s, c.body_timeout_s)
    server = uvicorn.Server(uvicorn.Config(app, log_level=c.log_level, timeout_keep_alive=c.keep_alive_s,
                                           h11_max_incomplete_event_size=c.max_header_kib << 10, http=protocol,
                                           backlog=backlog, lifespan="on"))
    server.run(sockets=[sock])
