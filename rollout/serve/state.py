"""What every route needs: the engine, its loop thread, the weight receiver and the server's settings."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from rollout.engine.async_engine import AsyncEngine
from rollout.engine.validation import check_lengths, to_token_ids
from rollout.serve.config import ServerConfig
from rollout.serve.errors import APIError
from rollout.settings.schema import SamplingConfig
from rollout.weights.receiver import WeightReceiver


@dataclass
class ServerState:
    engine: Any
    loop: AsyncEngine
    model_name: str
    defaults: SamplingConfig
    max_n: int
    model_path: str | None = None
    settings: ServerConfig = field(default_factory=ServerConfig)  # the ``server`` group
    max_prompts: int = 1024  # server.max_prompts_per_request
    max_queued: int = 16384  # server.max_queued_sequences
    receiver: WeightReceiver = field(init=False)
    counters: dict[str, float] = field(default_factory=lambda: {"weight_updates": 0, "last_update_s": 0.0})

    def __post_init__(self) -> None:
        # pushes are applied in the engine loop thread, at a step boundary
        self.receiver = WeightReceiver(self.engine, run=lambda fn: self.loop.call(fn).result())

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"model {model!r} is not served here; this server serves {self.model_name!r} "
                                "(see GET /v1/models)", param="model", code="model_not_found")

    def prompt_ids(self, prompts: list[Any], params: Any) -> list[list[int]]:
        """Token ids for every prompt, all checked before any is queued (400 naming the prompt)."""
        if len(prompts) > self.max_prompts:
            raise APIError(400, f"{len(prompts)} prompts in one request; allowed: at most {self.max_prompts} "
                                "(server.max_prompts_per_request)", param="prompt")
        e = self.engine
        out = []
        for i, p in enumerate(prompts):
            try:
                ids = to_token_ids(p, e.tokenizer, e.model.vocab_size)
                check_lengths(len(ids), params, e.max_model_len, e.kv.num_tokens, e.model.vocab_size)
            except (TypeError, ValueError) as err:
                where = f"prompt {i}: " if len(prompts) > 1 else ""
                code = "context_length_exceeded" if "max_model_len" in str(err) else None
                raise APIError(400, f"{where}{err}", param="prompt", code=code) from None
            out.append(ids)
        return out

    def check_room(self, num_seqs: int) -> None:
        """400 for a request larger than the whole queue, 429 (retry later) while the queue is too full for it."""
        cap, held = self.max_queued, self.loop.num_queued_seqs()
        if num_seqs > cap:
            raise APIError(400, f"the request asks for {num_seqs} sequences (prompts x n); allowed: at most {cap} "
                                "(server.max_queued_sequences)", param="n")
        if held + num_seqs > cap:
            raise APIError(429, f"the server holds {held} sequences and this request adds {num_seqs}, over its cap "
                                f"of {cap} (server.max_queued_sequences); retry later", headers={"Retry-After": "1"})

    async def run(self, fn: Any) -> Any:
        """Run ``fn`` in the engine loop thread at a step boundary and await its result."""
        return await asyncio.wrap_future(self.loop.call(fn))


def state(request: Request) -> ServerState:
    return request.app.state.server
