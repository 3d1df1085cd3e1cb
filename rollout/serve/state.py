"""What every route needs: the engine, its loop thread, the weight receiver, the text workers and the settings.

Text work (tokenizing, chat templates, detokenizing, rendering bodies) runs in ``text_pool`` threads, never
on the event loop, so one huge prompt cannot stall ``/health`` or the other streams; a string prompt is
refused by its length before any of it is tokenized.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from rollout.engine.async_engine import AsyncEngine
from rollout.engine.validation import check_lengths, to_token_ids
from rollout.serve.config import ServerConfig
from rollout.serve.errors import APIError
from rollout.serve.streaming import LoopPoster
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
    receiver: WeightReceiver = field(init=False)
    text_pool: ThreadPoolExecutor = field(init=False)
    counters: dict[str, float] = field(default_factory=lambda: {"weight_updates": 0, "last_update_s": 0.0})
    _poster: LoopPoster | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        # pushes are applied in the engine loop thread, at a step boundary
        self.receiver = WeightReceiver(self.engine, run=lambda fn: self.loop.call(fn).result())
        self.text_pool = ThreadPoolExecutor(self.settings.text_workers, thread_name_prefix="rollout-text")

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"model {model!r} is not served here; this server serves {self.model_name!r} "
                                "(see GET /v1/models)", param="model", code="model_not_found")

    def check_chars(self, num_chars: int, what: str = "prompt", param: str = "prompt") -> None:
        """400 for text that cannot fit ``max_model_len`` even at ``max_chars_per_token`` (before tokenizing)."""
        limit = self.engine.max_model_len * self.settings.max_chars_per_token
        if num_chars > limit:
            raise APIError(400, f"{what} is {num_chars} characters; allowed: at most {limit} (max_model_len "
                                f"{self.engine.max_model_len} x server.max_chars_per_token "
                                f"{self.settings.max_chars_per_token})", param=param,
                           code="context_length_exceeded")

    async def prompt_ids(self, prompts: list[Any], params: Any, truncate: int | None = None) -> list[list[int]]:
        """Token ids for every prompt, all checked before any is queued (400 naming the prompt); strings are
        bounded by length first, then tokenized in the text workers. ``truncate`` (vLLM's
        ``truncate_prompt_tokens``) keeps each prompt's last that many tokens."""
        if len(prompts) > self.settings.max_prompts_per_request:
            raise APIError(400, f"{len(prompts)} prompts in one request; allowed: at most "
                                f"{self.settings.max_prompts_per_request} (server.max_prompts_per_request)",
                           param="prompt")
        for i, p in enumerate(prompts):
            if isinstance(p, str) and truncate is None:
                self.check_chars(len(p), f"prompt {i}" if len(prompts) > 1 else "prompt")
        return await self.text(self._encode, prompts, params, truncate)

    def _encode(self, prompts: list[Any], params: Any, truncate: int | None = None) -> list[list[int]]:
        e = self.engine
        out = []
        for i, p in enumerate(prompts):
            try:
                ids = to_token_ids(p, e.tokenizer, e.model.vocab_size)
                ids = ids[-truncate:] if truncate else ids
                check_lengths(len(ids), params, e.max_model_len, e.kv.num_tokens, e.model.vocab_size)
            except (TypeError, ValueError) as err:
                where = f"prompt {i}: " if len(prompts) > 1 else ""
                code = "context_length_exceeded" if "max_model_len" in str(err) else None
                raise APIError(400, f"{where}{err}", param="prompt", code=code) from None
            out.append(ids)
        return out

    def check_room(self, num_seqs: int) -> None:
        """400 for a request larger than the whole queue, 429 (retry later) while the queue is too full for it."""
        cap, held = self.settings.max_queued_sequences, self.loop.num_queued_seqs()
        if num_seqs > cap:
            raise APIError(400, f"the request asks for {num_seqs} sequences (prompts x n); allowed: at most {cap} "
                                "(server.max_queued_sequences)", param="n")
        if held + num_seqs > cap:
            raise APIError(429, f"the server holds {held} sequences and this request adds {num_seqs}, over its cap "
                                f"of {cap} (server.max_queued_sequences); retry later", headers={"Retry-After": "1"})

    def poster(self) -> LoopPoster:
        """Posts streams' events onto the event loop (one wake-up per batch); made on the running loop."""
        if self._poster is None:
            self._poster = LoopPoster(asyncio.get_running_loop())
            self.loop.on_stream_batch(self._poster.flush)
        return self._poster

    async def text(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` in a text worker (tokenizer, template, detokenizer, body rendering) and await it."""
        return await asyncio.get_running_loop().run_in_executor(self.text_pool, fn, *args)

    async def pause(self, abort: bool) -> int:
        """Stop stepping at the next step boundary; ``abort`` ends the pending requests (how many)."""

        def do() -> int:
            self.loop.set_paused(True)
            return self.loop.abort_all() if abort else 0

        return await self.run(do)

    async def resume(self) -> None:
        await self.run(lambda: self.loop.set_paused(False))

    async def sleep(self, level: int, pause_route: str) -> int:
        """The engine's KV (and at level 2 its weights) and the weight staging buffer released: bytes freed.
        400 for a bad level, 409 while requests are pending (``pause_route`` ends them)."""
        try:
            released = await self.run(lambda: self.engine.sleep(level))
        except ValueError as e:
            raise APIError(400, str(e), param="level") from None
        except RuntimeError as e:
            raise APIError(409, f"{e} ({pause_route} does that)") from None
        return released + await asyncio.to_thread(self.receiver.release_staging)

    async def run(self, fn: Any) -> Any:
        """Run ``fn`` in the engine loop thread at a step boundary and await its result."""
        return await asyncio.wrap_future(self.loop.call(fn))


def state(request: Request) -> ServerState:
    return request.app.state.server
