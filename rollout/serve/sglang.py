"""SGLang's native API (0.5.x shapes), for slime, AReaL and anything else written against ``sglang.launch_server``.

``POST /generate`` takes ``text`` or ``input_ids`` (one prompt or a batch) with SGLang's ``sampling_params``
and returns ``text``, ``output_ids`` and ``meta_info`` (finish reason ``{type, matched}``, token counts,
logprobs as ``[logprob, token_id, null]``, the weight version). The control and weight routes are in
sglang_admin.py.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from rollout.serve.errors import APIError, json_body
from rollout.serve.generate import abort as _abort
from rollout.serve.generate import outputs, submit
from rollout.serve.params import make_params
from rollout.serve.sglang_protocol import GenerateRequest, sampling_base, sampling_extras
from rollout.serve.state import ServerState, state

router = APIRouter()  # generation, read-only info, abort (the control and weight routes: sglang_admin.py)


@router.post("/generate")
async def generate(req: GenerateRequest, request: Request) -> Any:
    st = state(request)
    prompts, single = req.prompts()
    raw = req.sampling_params if isinstance(req.sampling_params, list) else [req.sampling_params] * len(prompts)
    if len(raw) != len(prompts):
        raise APIError(400, f"sampling_params has {len(raw)} entries for {len(prompts)} prompts",
                       param="sampling_params")
    params = [_params(st, req, sp or {}) for sp in raw]
    ids = [(await st.prompt_ids([p], sp))[0] for p, sp in zip(prompts, params)]
    rids = req.rids(len(ids))
    if req.stream:
        return _stream(st, req, ids, params, rids)
    t0 = time.perf_counter()
    outs = await _run(st, request, ids, params, rids)
    body = await st.text(lambda: [_item(st, req, o, c, time.perf_counter() - t0) for o in outs
                                  for c in sorted(o.outputs, key=lambda c: c.index)])
    return JSONResponse(body[0] if single and len(body) == 1 else body)


def _params(st: ServerState, req: GenerateRequest, sp: dict[str, Any]) -> Any:
    top = req.top_logprobs_num if req.return_logprob else 0
    wants_input = req.return_logprob and req.logprob_start_len is not None and req.logprob_start_len >= 0
    base = sampling_base(sp, st.defaults)
    if isinstance(base["n"], int) and st.max_n < base["n"]:
        raise APIError(400, f"n={base['n']} is too large; allowed: 1 .. {st.max_n} (server.max_n)", param="n")
    return make_params(base, sampling_extras(sp, top or None, top if wants_input else None))


async def _run(st: ServerState, request: Request, ids: list[list[int]], params: list[Any], rids: list[str]
               ) -> list[Any]:
    return await outputs(request, st, *submit(st, ids, params, rids=rids))


def _triples(ids: list[int], lps: list[Any], tok: Any, with_text: bool) -> list[list[Any]]:
    text = (lambda t: tok.decode([t])) if with_text and tok is not None else (lambda t: None)
    return [[lp, int(t), text(t)] for t, lp in zip(ids, lps)]


def _tops(tops: Any, n: int, tok: Any, with_text: bool) -> list[Any]:
    tops = tops or [None] * n
    return [None if t is None else _triples([a for a, _ in t], [lp for _, lp in t], tok, with_text) for t in tops]


def _item(st: ServerState, req: GenerateRequest, out: Any, c: Any, seconds: float) -> dict[str, Any]:
    tok = st.engine.tokenizer
    if c.finish_reason == "length":
        finish = {"type": "length", "length": len(c.token_ids)}
    elif c.finish_reason == "stop":
        matched = c.stop_reason if c.stop_reason is not None else (c.token_ids[-1] if c.token_ids else None)
        finish = {"type": "stop", "matched": matched}
    else:
        finish = {"type": "abort", "message": "aborted"} if c.finish_reason else None
    meta: dict[str, Any] = {
        "id": out.request_id if len(out.outputs) == 1 else f"{out.request_id}-{c.index}",
        "finish_reason": finish, "prompt_tokens": len(out.prompt_token_ids), "completion_tokens": len(c.token_ids),
        "cached_tokens": int(getattr(out, "num_cached_tokens", 0) or 0), "e2e_latency": seconds,
        "weight_version": str(c.policy_versions[-1] if c.policy_versions else st.engine.policy_version),
        "policy_versions": list(c.policy_versions),
    }
    if req.return_logprob:
        text = bool(req.return_text_in_logprobs)
        meta["output_token_logprobs"] = _triples(c.token_ids, c.logprobs, tok, text)
        start = req.logprob_start_len if req.logprob_start_len is not None else -1
        p_lps = getattr(out, "prompt_logprobs", None)
        if start >= 0 and p_lps is not None:
            meta["input_token_logprobs"] = _triples(out.prompt_token_ids[start:], p_lps[start:], tok, text)
        else:
            meta["input_token_logprobs"] = []
        if req.top_logprobs_num:
            meta["output_top_logprobs"] = _tops(getattr(c, "top_logprobs", None), len(c.token_ids), tok, text)
            p_tops = getattr(out, "prompt_top_logprobs", None)
            meta["input_top_logprobs"] = (_tops(p_tops[start:], len(out.prompt_token_ids) - start, tok, text)
                                          if start >= 0 and p_tops is not None else [])
    return {"text": c.text or "", "output_ids": list(c.token_ids), "meta_info": meta}


def _stream(st: ServerState, req: GenerateRequest, ids: list[list[int]], params: list[Any], rids: list[str]
            ) -> StreamingResponse:
    """SGLang's stream: ``data: {cumulative text, output_ids, meta_info}`` per step and sample, then [DONE]."""
    st.check_room(sum(p.n for p in params))
    aloop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    for i, (prompt, p, rid) in enumerate(zip(ids, params, rids)):
        fut = st.loop.submit(prompt, p, rid, on_partial=lambda part, i=i: aloop.call_soon_threadsafe(
            queue.put_nowait, (i, part, False)))
        fut.add_done_callback(lambda f, i=i: aloop.call_soon_threadsafe(
            queue.put_nowait, (i, None if f.cancelled() or f.exception() else f.result(), True)))
    n = params[0].n if params else 1
    t0 = time.perf_counter()

    async def events() -> Any:
        seen: dict[tuple[int, int], list[int]] = {}
        done = 0
        try:
            while done < len(ids):
                i, out, final = await queue.get()
                done += final
                if out is None:
                    continue
                for c in out.outputs:
                    key = (i, c.index)
                    if final:
                        item = await st.text(_item, st, req, out, c, time.perf_counter() - t0)
                    else:
                        seen.setdefault(key, []).extend(c.token_ids)
                        c.token_ids = list(seen[key])
                        c.text = await st.text(_decode, st.engine.tokenizer, c.token_ids)
                        item = {"text": c.text, "output_ids": c.token_ids,
                                "meta_info": {"id": rids[i], "finish_reason": None,
                                              "prompt_tokens": len(out.prompt_token_ids),
                                              "completion_tokens": len(c.token_ids),
                                              "cached_tokens": int(getattr(out, "num_cached_tokens", 0) or 0)}}
                    item["index"] = i * n + c.index
                    yield f"data: {json.dumps(item)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            _abort(st, rids)  # a reader gone mid-stream frees its sequences

    return StreamingResponse(events(), media_type="text/event-stream")


def _decode(tokenizer: Any, ids: list[int]) -> str:
    return "" if tokenizer is None else tokenizer.decode(ids, skip_special_tokens=True)


# ---- info -------------------------------------------------------------------------------------------------
@router.get("/get_model_info")
async def get_model_info(request: Request) -> dict[str, Any]:
    st = state(request)
    return {"model_path": st.model_path or st.model_name, "tokenizer_path": st.model_path or st.model_name,
            "served_model_name": st.model_name, "is_generation": True, "preferred_sampling_params": None,
            "weight_version": str(st.engine.policy_version), "has_image_understanding": False,
            "has_audio_understanding": False, "model_type": getattr(st.engine.hf_config, "model_type", None)}


@router.get("/get_server_info")
async def get_server_info(request: Request) -> dict[str, Any]:
    st = state(request)
    stats = await st.run(st.engine.get_stats)
    return {"model_path": st.model_path or st.model_name, "served_model_name": st.model_name,
            "context_length": st.engine.max_model_len, "max_total_num_tokens": st.engine.kv.num_tokens,
            "max_running_requests": st.engine.config.max_num_seqs, "tp_size": 1, "dp_size": 1, "pp_size": 1,
            "version": "rollout", "weight_version": str(st.engine.policy_version),
            "internal_states": [{"num_running_reqs": stats.num_running_seqs,
                                 "num_waiting_reqs": stats.num_waiting_seqs,
                                 "kv_cache_usage": stats.kv_cache_usage}]}


@router.get("/get_weight_version")
async def get_weight_version(request: Request) -> dict[str, str]:
    return {"weight_version": str(state(request).engine.policy_version)}


@router.get("/health_generate")
async def health_generate(request: Request) -> Any:
    """Healthy when one token can be generated now (SGLang's probe; slime polls it before starting)."""
    st = state(request)
    if st.loop.paused or st.engine.is_sleeping:
        return PlainTextResponse("")  # alive, deliberately not generating
    rid = f"health-{uuid.uuid4().hex}"
    try:
        fut = st.loop.submit([1], make_params({"max_tokens": 1, "temperature": 0.0}, {}), rid)
        await asyncio.wait_for(asyncio.wrap_future(fut), timeout=20)
    except Exception as e:  # noqa: BLE001 - any failure is unhealthy
        st.loop.abort(rid)
        raise APIError(503, f"the engine could not generate a token: {e!r}") from None
    return PlainTextResponse("")


@router.post("/abort_request")
async def abort_request(request: Request) -> dict[str, Any]:
    raw = await json_body(request)
    st = state(request)
    if not isinstance(raw, dict):
        raise APIError(400, "the request body must be a JSON object: {\"rid\": ...} or {\"abort_all\": true}")
    if raw.get("abort_all"):
        return {"success": True, "aborted": await st.run(st.loop.abort_all)}
    rid = raw.get("rid")
    if not isinstance(rid, str) or not rid:
        raise APIError(400, "abort_request needs rid (a request id) or abort_all=true", param="rid")
    # Finished in the engine, not cancelled in the loop: the caller's future then resolves with the tokens so far
    # and finish_reason "abort" (SGLang's answer) at the next step boundary; while generation is paused, when
    # it continues. An unknown or finished rid is ignored, as SGLang does.
    await st.run(lambda: st.engine.abort(rid))
    return {"success": True}
