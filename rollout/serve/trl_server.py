"""TRL server mode: what TRL 1.16's ``VLLMClient`` (``GRPOTrainer(use_vllm=True, vllm_mode="server")``) reads
beyond the OpenAI routes.

TRL 1.16 speaks vLLM's own server: ``GET /server_info?config_format=json`` (whose ``weight_transfer_config``
it checks before ``init_communicator``), ``GET /get_world_size``, then vLLM's weight routes
(``/init_weight_transfer_engine``, ``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``,
``/reset_prefix_cache``: admin.py's), whose NCCL handshake the weight receiver recognises (vllm_nccl.py).
The weight-transfer config is null where no push can land: without the admin routes, or on a CPU engine
(vLLM's handshake is NCCL), so the client stops at once with its own clear error.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Query, Request

from rollout.serve.state import state

router = APIRouter()


@router.get("/server_info")
async def server_info(request: Request, config_format: str = Query("text")) -> dict[str, Any]:
    st = state(request)
    weights = None
    if st.settings.admin and st.engine.device.type == "cuda":
        weights = {"backend": "nccl"}
    config = {
        "model_config": {"model": st.model_path or st.model_name, "served_model_name": st.model_name,
                         "max_model_len": st.engine.max_model_len},
        "parallel_config": {"tensor_parallel_size": 1, "data_parallel_size": 1, "world_size": 1},
        "cache_config": {"block_size": st.engine.config.block_size, "num_gpu_blocks": st.engine.num_blocks},
        "weight_transfer_config": weights,
    }
    return {"vllm_config": config if config_format == "json" else str(config), "server": "rollout",
            "policy_version": int(st.engine.policy_version)}


@router.get("/get_world_size/")
async def get_world_size_legacy() -> dict[str, int]:
    """Older TRL clients (``trl vllm-serve`` before it became vLLM's server) ask with a trailing slash."""
    return {"world_size": 1}
