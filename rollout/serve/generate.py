"""``/v1/completions`` and ``/v1/chat/completions``: queue into the engine loop, await or stream the results."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from rollout.serve import templates
from rollout.serve.errors import APIError
from rollout.serve.params import to_sampling_params
from rollout.serve.protocol import ChatCompletionRequest, CompletionRequest
from rollout.serve.responses import Render, chat_body, completion_body
from rollout.serve.state import ServerState, state
from rollout.serve.streaming import StreamChunks, StreamFeed, stream_events

router = APIRouter()


@router.post("/v1/completions")
async def completions(req: CompletionRequest, request: Request) -> Any:
    st = state(request)
    st.check_model(req.model)
    echo_only = bool(req.echo) and req.max_tokens == 0  # score the prompt only: one token, dropped
    params = to_sampling_params(req, st.defaults, st.max_n, max_tokens=1 if echo_only else None)
    ids = await st.prompt_ids(req.prompts(), params, req.truncate_prompt_tokens)
    render = Render(st.engine.tokenizer, req.return_tokens_as_token_ids)
    if req.stream:
        _stream_refuses(req, echo=req.echo)
        return _stream(st, req, ids, params, render, chat=False)
    outs = await _generate(st, request, ids, params, req.priority or 0)
    return await st.text(lambda: JSONResponse(completion_body(req, outs, st.model_name, render, echo_only)))


@router.post("/v1/chat/completions")
async def chat_completions(req: ChatCompletionRequest, request: Request) -> Any:
    st = state(request)
    st.check_model(req.model)
    asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    floor = max(1, req.min_tokens or st.defaults.min_tokens)  # until the prompt's length is known
    params = to_sampling_params(req, st.defaults, st.max_n, max_tokens=asked if asked is not None else floor)
    st.check_chars(sum(_chars(m.content) for m in req.messages) + len(json.dumps(req.tools or [])), "messages",
                   "messages")
    ids = await st.prompt_ids([await _chat_prompt(st, req)], params, req.truncate_prompt_tokens)
    if asked is None:  # vLLM's default for chat: the rest of the context (not the legacy 16)
        room = min(st.engine.max_model_len, st.engine.kv.num_tokens) - len(ids[0])
        params = dataclasses.replace(params, max_tokens=max(room, floor))
    render = Render(st.engine.tokenizer, req.return_tokens_as_token_ids)
    if req.stream:
        _stream_refuses(req)
        return _stream(st, req, ids, params, render, chat=True)
    outs = await _generate(st, request, ids, params, req.priority or 0)
    return await st.text(lambda: JSONResponse(chat_body(req, outs[0], st.model_name, render)))


def _stream_refuses(req: Any, **fields: Any) -> None:
    """What streams do not carry yet: 400 naming it rather than a stream that silently lacks it."""
    fields["prompt_logprobs"] = req.prompt_logprobs
    for key, value in fields.items():
        if value not in (None, False, 0):
            raise APIError(400, f"{key}={value!r} is not supported with stream=true yet; allowed: "
                                f"{'0' if 'logprobs' in key else 'false'} (or a non-streamed request)", param=key)


def _chars(content: Any) -> int:
    return len(content) if isinstance(content, str) else sum(len(p.text or "") for p in content or ())


async def _chat_prompt(st: ServerState, req: ChatCompletionRequest) -> list[int]:
    tok = st.engine.tokenizer
    if tok is None:
        raise APIError(400, "chat needs a tokenizer with a chat template; this model has none (use /v1/completions "
                            "with token ids)")
    if req.chat_template is not None:
        return await _request_template(st, req)
    if req.chat_template is None and getattr(tok, "chat_template", None) is None:
        raise APIError(400, "the tokenizer has no chat template; pass chat_template or use /v1/completions")
    try:  # the model's own template, in a text worker (never on the event loop)
        encoded = await st.text(lambda: tok.apply_chat_template(
            [m.as_template_dict() for m in req.messages], tools=req.tools or None, chat_template=req.chat_template,
            add_generation_prompt=req.add_generation_prompt and not req.continue_final_message,
            continue_final_message=req.continue_final_message, tokenize=True, return_dict=True,
            **(req.chat_template_kwargs or {})))
    except APIError:
        raise
    except Exception as e:  # noqa: BLE001 - a template error is the request's fault (bad roles, kwargs...)
        raise APIError(400, f"the chat template failed on these messages: {e}", param="messages") from None
    return list(encoded["input_ids"])


async def _request_template(st: ServerState, req: ChatCompletionRequest) -> list[int]:
    """A request's own template: refused unless the server allows it, then rendered sandboxed (templates.py)."""
    if not st.settings.allow_request_chat_template:
        raise APIError(400, "chat_template in a request is not allowed on this server (it runs the request's code); "
                            "omit it to use the model's template, or start the server with "
                            "server.allow_request_chat_template=true", param="chat_template")
    tok = st.engine.tokenizer
    messages = [{k: v for k, v in m.as_template_dict().items() if v is not None} for m in req.messages]
    text = await templates.render(
        req.chat_template, messages, dict(tok.special_tokens_map), tools=req.tools or None,
        add_generation_prompt=req.add_generation_prompt and not req.continue_final_message,
        continue_final_message=req.continue_final_message, **(req.chat_template_kwargs or {}))
    return list(await asyncio.to_thread(lambda: tok(text, add_special_tokens=False)["input_ids"]))


def submit(st: ServerState, ids: list[list[int]], params: Any, stream: StreamFeed | None = None, priority: int = 0,
           rids: list[str] | None = None) -> tuple[list[str], list[asyncio.Future]]:
    """Queue every prompt (``params``: one for all, or one per prompt; ``rids``: the request ids, else new
    ones); awaitable futures of their outputs, or (``stream``) their outputs fed to it. ``priority``: vLLM's,
    lower is served first. Nothing stays queued when one is refused (400, or 503 with the loop down)."""
    each = params if isinstance(params, list) else [params] * len(ids)
    st.check_room(sum(p.n for p in each))  # no await between this check and the submits: it holds
    aloop = asyncio.get_running_loop()
    rids = list(rids) if rids is not None else [uuid.uuid4().hex for _ in ids]
    futs: list[asyncio.Future] = []
    try:
        for i, (prompt, p, rid) in enumerate(zip(ids, each, rids)):
            if stream is None:
                futs.append(asyncio.wrap_future(st.loop.submit(prompt, p, rid, priority=priority), loop=aloop))
            else:
                st.loop.submit(prompt, p, rid, on_partial=stream.partial(i), priority=priority
                               ).add_done_callback(stream.final(i))
    except (TypeError, ValueError) as e:
        abort(st, rids)
        raise APIError(400, str(e)) from None
    except RuntimeError as e:
        abort(st, rids)
        raise APIError(503, str(e)) from None
    return rids, futs


def abort(st: ServerState, rids: list[str]) -> None:
    for rid in rids:
        st.loop.abort(rid)


async def outputs(request: Request, st: ServerState, rids: list[str], futs: list[asyncio.Future]) -> list[Any]:
    """The submitted requests' outputs; a client that goes away aborts them (499)."""
    results = asyncio.ensure_future(asyncio.gather(*futs))
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait([results, gone], return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not results.done():  # the client went away: free the engine's slots
        results.cancel()
        abort(st, rids)
        raise APIError(499, "client disconnected")
    try:
        return results.result()
    except asyncio.CancelledError:  # aborted in the loop (SGLang's /abort_request answers abort instead)
        raise APIError(499, "request aborted") from None
    except (TypeError, ValueError) as e:  # the engine refused it after all (its checks ran here first)
        raise APIError(400, str(e)) from None
    except RuntimeError as e:
        raise APIError(503, f"generation failed: {e}") from None


async def _generate(st: ServerState, request: Request, ids: list[list[int]], params: Any, priority: int = 0
                    ) -> list[Any]:
    return await outputs(request, st, *submit(st, ids, params, None, priority))


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _stream(st: ServerState, req: Any, ids: list[list[int]], params: Any, render: Render, chat: bool
            ) -> StreamingResponse:
    chunks = StreamChunks(req, len(ids), params.n, st.model_name, render, chat)
    feed = StreamFeed(st.poster(), st.settings.stream_buffer_tokens, chunks)
    rids, _ = submit(st, ids, params, feed, req.priority or 0)
    feed.on_overflow = lambda: abort(st, rids)
    events = stream_events(req, feed, len(ids))
    return StreamingResponse(events, media_type="text/event-stream")
