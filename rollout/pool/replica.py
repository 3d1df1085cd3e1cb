"""One pool replica: an ``Engine`` in its own process (a Ray actor), stepped by its ``AsyncEngine`` thread.

The actor is asynchronous: each ``run`` call (one request, i.e. one GRPO group with its ``n`` samples)
submits the request to the ``AsyncEngine`` and awaits its completion, so any number of groups can be in
flight and the engine batches them continuously. ``sleep`` / ``wake_up`` run in that thread between steps.

Weights arrive over the pool's ``TransferGroup`` through ``WeightReceiver`` and ``Engine.update_weights``,
the same code the HTTP server uses (validate everything, then copy). A replacement replica catches up
from a survivor's state (``export_state`` / ``load_state``) before it takes any work.

A replica co-located with the trainer (``device_uuid``: the trainer's GPU) takes pushes by handle instead
(``receive_weights_by_handle``), through the same receiver and ``Engine.update_weights``.

``sleep`` / ``wake_up`` are ``Engine``'s, plus the receiver's staging buffer (a model's worth of bytes kept
between broadcasts): it goes while the replica sleeps, and a push that arrives then frees it again after
applying. A sleeping replica refuses ``run`` (its engine could not step until woken). A replica whose
``AsyncEngine`` thread died exits its actor (``ready`` or ``run`` finds it), so the pool sees a dead actor
and replaces it as it replaces any other.

Nothing here imports Ray at module level (``ready`` asks it for the node id when present): ``pool.py``
wraps ``Replica`` with ``ray.remote``, so the class is testable in process and imports without Ray.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from dataclasses import asdict, replace
from typing import Any

import torch

from rollout.engine.async_engine import AsyncEngine
from rollout.engine.validation import check_lengths, to_token_ids
from rollout.outputs import RequestOutput
from rollout.pool.factory import EngineFactory
from rollout.sampling_params import SamplingParams
from rollout.weights.handles import BucketHandle, cuda_index, gpu_uuid
from rollout.weights.layout import BUCKET_BYTES, TensorSpec
from rollout.weights.receiver import WeightReceiver


class Replica:
    def __init__(self, engine_factory: Callable[[], Any], index: int = 0, torch_threads: int | None = None,
                 device_uuid: str | None = None) -> None:
        if torch_threads:
            torch.set_num_threads(torch_threads)
        self.index = index
        if device_uuid is not None:  # co-located with the trainer: its GPU, found by UUID (indices differ per process)
            gpu = cuda_index(device_uuid)
            torch.cuda.set_device(gpu)
            if isinstance(engine_factory, EngineFactory):
                engine_factory = replace(engine_factory, device=f"cuda:{gpu}")
        self.engine = engine_factory()
        self.receiver = WeightReceiver(self.engine)
        self.loop = AsyncEngine(self.engine, name=f"replica-{index}").start()

    # ---- info ------------------------------------------------------------------------------------
    def ready(self) -> dict[str, Any]:
        """What the pool needs to schedule onto this replica (capacity in sequences) and its version."""
        self._check_loop()
        e = self.engine
        return {"index": self.index, "max_num_seqs": e.config.max_num_seqs, "policy_version": e.policy_version,
                "device": str(e.device), "num_blocks": e.num_blocks,
                "max_model_len": e.max_model_len, "vocab_size": e.limits.vocab_size,
                "kv_cache_tokens": e.limits.kv_cache_tokens, "pid": os.getpid(), "node_id": _node_id(),
                "device_uuid": gpu_uuid(e.device) if e.device.type == "cuda" else None}

    def stats(self) -> dict[str, Any]:
        s = asdict(self.engine.get_stats())
        busy = self.loop.busy_s  # wall time spent stepping: tokens/s = generated / busy
        s["busy_s"] = busy
        s["tokens_per_s"] = s["num_generated_tokens"] / busy if busy > 0 else 0.0
        s["index"] = self.index
        s["sleeping"] = self.engine.is_sleeping
        s["weight_staging_bytes"] = self.receiver.staging_bytes
        return s

    # ---- generation ------------------------------------------------------------------------------
    def validate(self, prompts: list[Any], params: list[SamplingParams]) -> None:
        """The engine's own checks on a whole round, so a bad prompt is refused before any is dispatched."""
        e = self.engine
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            try:
                ids = to_token_ids(prompt, e.tokenizer, e.model.vocab_size)
                check_lengths(len(ids), p, e.max_model_len, e.kv.num_tokens, e.model.vocab_size)
            except ValueError as err:
                raise ValueError(f"prompt {i}: {err}") from None

    async def run(self, request_id: str, prompt: Any, params: SamplingParams) -> RequestOutput:
        """One group, start to finish; a bad prompt raises ValueError/TypeError here, as in ``Engine``."""
        if self.engine.is_sleeping:
            raise RuntimeError(f"replica {self.index} is asleep (sleep() was called); call wake_up() "
                               "before giving it work")
        self._check_loop()
        try:
            return await asyncio.wrap_future(self.loop.submit(prompt, params, request_id))
        except RuntimeError:
            self._check_loop()  # the loop died meanwhile: exit rather than fail the group as its own fault
            raise

    def _check_loop(self) -> None:
        """A dead engine loop serves nothing again: exit the actor (the pool replaces it); raise outside Ray."""
        if self.loop.alive:
            return
        message = f"replica {self.index}: its engine loop is not running ({self.loop.error!r})"
        try:
            import ray
        except ImportError:
            ray = None
        if ray is not None and ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None:
            ray.actor.exit_actor()
        raise RuntimeError(message)

    # ---- weights ---------------------------------------------------------------------------------
    async def join_weight_group(self, master_address: str, master_port: int, world_size: int, rank: int,
                                backend: str, timeout_s: float = 600.0) -> int:
        """Join the trainer's group as ``rank`` (blocks until every rank joined)."""
        await asyncio.to_thread(self.receiver.join, master_address, master_port, world_size, rank, backend,
                                timeout_s)
        return rank

    async def receive_weights(self, specs: list[TensorSpec], push_id: int, version: int | None,
                              bucket_bytes: int = BUCKET_BYTES, recompute_running: bool = True) -> int:
        """One push: verdict, broadcast into staging, then ``Engine.update_weights``; the new version."""
        return await asyncio.to_thread(self.receiver.receive, specs, bucket_bytes, push_id, version, recompute_running)

    async def receive_weights_by_handle(self, specs: list[TensorSpec], handles: list[BucketHandle],
                                        version: int | None, recompute_running: bool = True) -> int:
        """A co-located push: map the trainer's buckets, ``Engine.update_weights`` on views of them, unmap."""
        return await asyncio.to_thread(self.receiver.receive_handles, specs, handles, version, recompute_running)

    # ---- memory ----------------------------------------------------------------------------------
    async def sleep(self, level: int = 1) -> int:
        """``Engine.sleep(level)``, then the staging buffer; the bytes released on the engine's device."""
        def go() -> int:
            released = self.engine.sleep(level)  # refuses while requests run: the staging buffer stays then
            return released + self.receiver.release_staging()

        return await asyncio.wrap_future(self.loop.call(go))

    async def wake_up(self) -> None:
        await asyncio.wrap_future(self.loop.call(self.engine.wake_up))

    def leave_weight_group(self) -> None:
        self.receiver.close()

    def export_state(self) -> tuple[dict[str, torch.Tensor], int]:
        """The engine's weights under their HF names (on the CPU) and its version: a replacement's catch-up."""
        with self.engine._lock:
            mapper = self.engine.weights.mapper
            state = {name: mapper.resolve(name).dst().to("cpu", copy=True) for name in mapper.hf_names()}
            return state, self.engine.policy_version

    def load_state_from(self, exported: tuple[dict[str, torch.Tensor], int]) -> int:
        """Take a survivor's ``export_state()`` through ``Engine.update_weights`` before any work arrives;
        refused once requests are in."""
        state, version = exported
        if self.engine.has_unfinished_requests():
            raise RuntimeError("load_state on a replica with requests in flight")
        return self.engine.update_weights(state, version)

    def shutdown(self) -> None:
        self.loop.close()
        self.receiver.close()


def _node_id() -> str | None:
    """Ray's id of this replica's node (the pool checks a co-located replica shares the trainer's)."""
    try:
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    except ImportError:
        return None
