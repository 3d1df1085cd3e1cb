"""Weights and control: vLLM's weight-transfer endpoints, disk updates, pause / resume, sleep / wake_up.

Every weight update ends in ``Engine.update_weights`` (validate everything, then copy in place), run in
the engine loop thread at a step boundary: a rejected or broken push leaves the old weights serving.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from fastapi import APIRouter, Query, Request
from pydantic import ValidationError

from rollout.serve.auth import weight_source
from rollout.serve.errors import APIError, describe_validation, json_body
from rollout.serve.protocol import InitWeightTransfer, UpdateWeights, UpdateWeightsFromDisk
from rollout.serve.state import ServerState, state
from rollout.weights.disk import CheckpointWeights, step_of
from rollout.weights.group import PushRejected, TransferError
from rollout.weights.layout import make_specs

log = logging.getLogger("rollout.serve")
router = APIRouter()  # what changes the server: weights, pause, sleep, reset (none of it with server.admin=false)
status = APIRouter()  # read-only: is_paused, is_sleeping, get_world_size, policy_version


async def _body(request: Request, model: type, wrapper: str) -> Any:
    """Parse a JSON object (vLLM wraps it as ``{wrapper: {...}}``; both shapes are accepted)."""
    raw = await json_body(request)
    if not isinstance(raw, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(raw).__name__}")
    if set(raw) == {wrapper}:
        raw = raw[wrapper]
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        status, message, param = describe_validation(list(e.errors()))
        raise APIError(status, message, param) from None


async def _packed_body(request: Request, model: type, wrapper: str) -> Any:
    """``_body`` for the NCCL endpoints: tensors travel only packed in flat buckets, never one call each."""
    body = await _body(request, model, wrapper)
    if not body.packed:
        raise APIError(400, "packed=false is not supported: tensors travel packed in flat buckets", param="packed")
    return body


@router.post("/init_weight_transfer")
@router.post("/init_weight_transfer_engine")
async def init_weight_transfer(request: Request) -> dict[str, Any]:
    """Join the trainer's group (the trainer, rank 0, is joining it concurrently).

    Only at an address ``server.weight_sources`` allows, for at most ``server.max_weight_timeout_s``; a
    failure names the address, never what a socket there sent back.
    """
    st = state(request)
    info: InitWeightTransfer = await _packed_body(request, InitWeightTransfer, "init_info")
    client = request.client.host if request.client else None
    address = await asyncio.to_thread(weight_source, info.master_address, client, st.settings.weight_sources)
    timeout_s = min(info.timeout_s, st.settings.max_weight_timeout_s)
    try:
        group = await asyncio.to_thread(st.receiver.join, address, info.master_port, info.world_size,
                                        info.rank_offset, info.backend, timeout_s, info.packed,
                                        info.packed_buffer_size_bytes)
    except ValueError as e:  # our own checks: backend, rank
        raise APIError(400, str(e)) from None
    except Exception as e:  # noqa: BLE001 - the store or the group could not be reached
        if isinstance(e, RuntimeError) and "in progress" in str(e):
            raise APIError(409, str(e)) from None
        raise APIError(400, f"cannot join the weight-transfer group at {info.master_address}:{info.master_port} "
                            f"within {timeout_s:g} s ({type(e).__name__}): is the trainer's group listening there?"
                       ) from None
    return {"message": "weight transfer initialized", "backend": group.backend, "rank": group.rank}


@router.post("/start_weight_update")
@router.post("/finish_weight_update")
async def bracket_weight_update() -> dict[str, str]:
    """vLLM brackets a multi-call update with these; each of our pushes is already whole (all-or-nothing)."""
    return {"message": "ok"}


@router.post("/update_weights")
async def update_weights(request: Request) -> dict[str, Any]:
    """Receive one push (metadata here, tensors by broadcast), then swap it in at a step boundary."""
    st = state(request)
    upd: UpdateWeights = await _packed_body(request, UpdateWeights, "update_info")
    try:
        specs = make_specs(upd.names, upd.dtype_names, upd.shapes)
    except (TypeError, ValueError) as e:
        raise APIError(400, str(e)) from None
    t0 = time.perf_counter()
    try:
        new = await asyncio.to_thread(st.receiver.receive, specs, upd.bucket_bytes, upd.push_id, upd.version,
                                      upd.recompute_running)
    except PushRejected as e:
        raise APIError(400, f"weight update rejected, nothing changed: {e}") from None
    except TransferError as e:
        log.warning("weight push failed, the old weights still serve: %s", e)
        raise APIError(409, f"{e}; the old weights still serve; initialise a new group") from None
    except (TypeError, ValueError, KeyError) as e:
        raise _rejected(e) from None
    except RuntimeError as e:  # another transfer in progress
        raise APIError(409, str(e)) from None
    return _done(st, new, t0)


@router.post("/update_weights_from_disk")
async def update_weights_from_disk(request: Request) -> dict[str, Any]:
    """Load a Hugging Face safetensors directory (``step_<N>`` becomes version N unless ``version`` is given).

    SGLang's body (``model_path``, ``weight_version``, ``abort_all_requests``) is the same update."""
    st = state(request)
    upd: UpdateWeightsFromDisk = await _body(request, UpdateWeightsFromDisk, "update_info")
    where, version = upd.where(), upd.new_version()
    try:
        weights = await asyncio.to_thread(CheckpointWeights, where, st.settings.weights_root)
    except PermissionError as e:
        raise APIError(403, str(e), param="path") from None
    except (OSError, ValueError) as e:
        raise APIError(400, str(e), param="path") from None
    version = version if version is not None else step_of(weights.path)
    if upd.abort_all_requests:
        await st.run(st.loop.abort_all)
    t0 = time.perf_counter()
    try:
        new = await st.run(lambda: st.engine.update_weights(weights, version, upd.recompute_running))
    except (TypeError, ValueError, KeyError) as e:
        raise _rejected(e) from None
    except Exception as e:  # noqa: BLE001 - unreadable bytes past the headers (safetensors' own error type)
        raise APIError(400, f"weight update rejected, nothing changed: cannot read the checkpoint ({e})",
                       param="path") from None
    return {**_done(st, new, t0), "success": True, "message": f"loaded {where} as version {new}"}


def _rejected(e: Exception) -> APIError:
    reason = str(e.args[0] if isinstance(e, KeyError) and e.args else e)  # KeyError's str() adds quotes
    if "nothing changed" not in reason:
        reason = f"weight update rejected, nothing changed: {reason}"
    return APIError(400, reason)


def _done(st: ServerState, new: int, t0: float) -> dict[str, Any]:
    seconds = time.perf_counter() - t0
    st.counters["weight_updates"] += 1
    st.counters["last_update_s"] = seconds
    return {"policy_version": new, "seconds": seconds}


# ---- control ---------------------------------------------------------------------------------------------
@router.post("/pause")
async def pause(request: Request, mode: str = Query("abort")) -> dict[str, Any]:
    """``keep``: running sequences stay and resume later; ``abort``: they end now with finish_reason abort."""
    if mode not in ("keep", "abort"):
        raise APIError(400, f"mode={mode!r} is not supported; allowed: 'keep', 'abort'", param="mode")
    aborted = await state(request).pause(abort=mode == "abort")
    return {"paused": True, "mode": mode, "aborted": aborted}


@router.post("/resume")
async def resume(request: Request) -> dict[str, Any]:
    await state(request).resume()
    return {"paused": False}


@status.get("/is_paused")
async def is_paused(request: Request) -> dict[str, bool]:
    return {"is_paused": state(request).loop.paused}


@router.post("/reset_prefix_cache")
async def reset_prefix_cache(request: Request) -> dict[str, bool]:
    st = state(request)
    await st.run(st.engine.block_manager.reset_prefix_cache)
    return {"success": True}


@router.post("/sleep")
async def sleep(request: Request, level: int = Query(1)) -> dict[str, Any]:
    released = await state(request).sleep(level, "POST /pause?mode=abort")
    return {"sleeping": True, "level": level, "released_bytes": released}


@router.post("/wake_up")
async def wake_up(request: Request) -> dict[str, bool]:
    st = state(request)
    await st.run(st.engine.wake_up)
    return {"sleeping": False}


@status.get("/is_sleeping")
async def is_sleeping(request: Request) -> dict[str, bool]:
    return {"is_sleeping": bool(state(request).engine.is_sleeping)}


@status.get("/get_world_size")
async def get_world_size() -> dict[str, int]:
    return {"world_size": 1}


@status.get("/policy_version")
async def policy_version(request: Request) -> dict[str, int]:
    return {"policy_version": int(state(request).engine.policy_version)}
