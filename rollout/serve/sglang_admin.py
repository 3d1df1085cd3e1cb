"""SGLang's control and weight routes (gone with ``server.admin=false``), all ending in the one weight path.

``/update_weights_from_disk`` is admin.py's (it takes SGLang's ``model_path``); ``/init_weights_update_group``
joins the trainer's group as SGLang does and ``/update_weights_from_distributed`` lands slime's per-tensor
broadcasts through ``WeightReceiver.receive_each``, then ``Engine.update_weights`` at a step boundary.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from rollout.serve.admin import _body
from rollout.serve.auth import weight_source
from rollout.serve.errors import APIError
from rollout.serve.sglang_protocol import DestroyGroup, InitGroup, PauseGeneration, UpdateFromDistributed
from rollout.serve.state import state
from rollout.weights.group import PushRejected, TransferError
from rollout.weights.layout import make_specs
from rollout.weights.torch_group import RendezvousUnreachable

router = APIRouter()


@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(request: Request) -> PlainTextResponse:
    st = state(request)
    await st.run(st.engine.block_manager.reset_prefix_cache)
    return PlainTextResponse("Cache flushed.\n")


@router.post("/pause_generation")
async def pause_generation(request: Request) -> dict[str, Any]:
    """SGLang's modes: ``abort`` (the default) ends running requests; ``retract`` / ``in_place`` keep them."""
    body: PauseGeneration = await _body(request, PauseGeneration, "pause")
    return {"success": True, "mode": body.mode, "aborted": await state(request).pause(abort=body.mode == "abort")}


@router.post("/continue_generation")
async def continue_generation(request: Request) -> dict[str, Any]:
    await state(request).resume()
    return {"success": True}


@router.post("/release_memory_occupation")
async def release_memory_occupation(request: Request) -> dict[str, Any]:
    released = await state(request).sleep(1, "POST /pause_generation")
    return {"success": True, "released_bytes": released}


@router.post("/resume_memory_occupation")
async def resume_memory_occupation(request: Request) -> dict[str, Any]:
    st = state(request)
    await st.run(st.engine.wake_up)
    return {"success": True}


@router.post("/init_weights_update_group")
async def init_weights_update_group(request: Request) -> dict[str, Any]:
    """Join the trainer's group as SGLang does (slime: ``connect_rollout_engines_from_distributed``)."""
    st = state(request)
    body: InitGroup = await _body(request, InitGroup, "init")
    client = request.client.host if request.client else None
    address = await asyncio.to_thread(weight_source, body.master_address, client, st.settings.weight_sources)
    timeout_s = st.settings.max_weight_timeout_s
    try:
        await asyncio.to_thread(st.receiver.join_named, address, body.master_port, body.world_size,
                                body.rank_offset, body.group_name, body.backend, timeout_s)
    except (ValueError, RendezvousUnreachable) as e:  # our own checks; nobody at the rendezvous (within seconds)
        raise APIError(400, str(e)) from None
    except Exception as e:  # noqa: BLE001 - the rendezvous or the group could not be reached
        if isinstance(e, RuntimeError) and "in progress" in str(e):
            raise APIError(409, str(e)) from None
        raise APIError(400, f"cannot join weight-update group {body.group_name!r} at {body.master_address}:"
                            f"{body.master_port} within {timeout_s:g} s ({type(e).__name__})") from None
    return {"success": True, "message": f"joined {body.group_name} as rank {body.rank_offset}"}


@router.post("/destroy_weights_update_group")
async def destroy_weights_update_group(request: Request) -> dict[str, Any]:
    await _body(request, DestroyGroup, "destroy")
    st = state(request)
    try:
        await asyncio.to_thread(st.receiver.close)
    except RuntimeError as e:
        raise APIError(409, str(e)) from None
    return {"success": True, "message": "destroyed"}


@router.post("/update_weights_from_distributed")
async def update_weights_from_distributed(request: Request) -> dict[str, Any]:
    """slime's push: names / dtypes / shapes here, then one broadcast per tensor from rank 0, in that order."""
    st = state(request)
    body: UpdateFromDistributed = await _body(request, UpdateFromDistributed, "update")
    try:
        specs = make_specs(body.names, [d.removeprefix("torch.") for d in body.dtypes], body.shapes)
    except (TypeError, ValueError) as e:
        raise APIError(400, str(e)) from None
    named = st.receiver.named
    if named is None or named.group_name != body.group_name:
        raise APIError(400, f"no weight-update group named {body.group_name!r}: POST /init_weights_update_group "
                            "first", param="group_name")
    t0 = time.perf_counter()
    try:
        new = await asyncio.to_thread(st.receiver.receive_each, specs, body.version(), True)
    except PushRejected as e:
        raise APIError(400, f"weight update rejected, nothing changed: {e}") from None
    except TransferError as e:
        raise APIError(409, f"{e}; the old weights still serve; initialise a new group") from None
    except (TypeError, ValueError, KeyError) as e:
        raise APIError(400, f"weight update rejected, nothing changed: {e}") from None
    except RuntimeError as e:
        raise APIError(409, str(e)) from None
    if body.flush_cache:
        await st.run(st.engine.block_manager.reset_prefix_cache)
    st.counters["weight_updates"] += 1
    st.counters["last_update_s"] = time.perf_counter() - t0
    return {"success": True, "message": f"updated {len(specs)} tensors", "policy_version": new}
