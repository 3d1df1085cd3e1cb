"""Replica 0 on the trainer's own device (``pool.colocate_with_trainer``): where it runs, and what must hold.

A co-located replica (veRL's hybrid engine; TRL's ``vllm_mode="colocate"``) shares the trainer's GPU, so
it cannot be a rank of the NCCL weight group (NCCL refuses two ranks on one GPU): it takes the weights by
handle (``rollout.weights.handles``: CUDA IPC on a GPU, a /dev/shm file on the CPU) while the other
replicas take them by broadcast, all in one ``RolloutPool.update_weights``.

Placement is address-based: the replica is pinned to the trainer's Ray node (node affinity, not loopback),
and on a GPU it finds the trainer's GPU by UUID among those it can see. Ray does not count a GPU that the
trainer process uses outside Ray, so the replica reserves that GPU in Ray's books (``num_gpus``) unless the
trainer is itself a Ray actor that holds GPUs already (then it asks for none); every other replica is
checked not to have landed on the trainer's GPU. Each of these facts is checked when a replica starts and
each push's tensors are checked to be on the trainer's device, with errors that say what to change.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from rollout.weights.group import cuda_device
from rollout.weights.handles import gpu_uuid

ADVICE = "set pool.colocate_with_trainer=false to send every replica its weights by broadcast"


@dataclass(frozen=True, slots=True)
class TrainerPlace:
    """Where the process that pushes weights (the trainer) keeps them."""

    device: torch.device  # index resolved
    device_uuid: str | None  # None on the CPU
    node_id: str | None  # Ray's id of the trainer's node

    @classmethod
    def here(cls, ray: Any, device: torch.device | str | None) -> TrainerPlace:
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        dev = cuda_device(device)
        if dev.type not in ("cuda", "cpu"):
            raise ValueError(f"trainer_device must be a CUDA device or 'cpu' for a co-located replica, got {dev}")
        return cls(dev, gpu_uuid(dev) if dev.type == "cuda" else None, ray.get_runtime_context().get_node_id())

    def describe(self) -> str:
        return f"{self.device} (GPU {self.device_uuid})" if self.device_uuid else str(self.device)


def actor_options(ray: Any, place: TrainerPlace, gpus_per_replica: float) -> dict[str, Any]:
    """Ray options for the co-located replica's actor: on the trainer's node, reserving the trainer's GPU in
    Ray's books only when the trainer (this process) does not hold it through Ray already."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if place.device.type == "cuda" and gpus_per_replica > 1:
        raise ValueError(f"a co-located replica holds one GPU (the trainer's); gpus_per_replica={gpus_per_replica}")
    held = ray.get_runtime_context().get_accelerator_ids().get("GPU", [])
    gpus = 1 if place.device.type == "cuda" and not held and gpus_per_replica > 0 else 0
    return {"num_gpus": gpus, "scheduling_strategy": NodeAffinitySchedulingStrategy(place.node_id, soft=False)}


def check_replica(index: int, info: Mapping[str, Any], place: TrainerPlace, colocated: bool) -> None:
    """A started replica's ``ready()`` answer against the trainer's place; ValueError naming what is wrong."""
    where = f"{info.get('device')} (GPU {info.get('device_uuid')})" if info.get("device_uuid") else info.get("device")
    if not colocated:
        if place.device_uuid is not None and info.get("device_uuid") == place.device_uuid:
            raise ValueError(f"replica {index} landed on the trainer's GPU {place.device_uuid}, where NCCL cannot "
                             "reach it (two ranks on one GPU): Ray does not know the trainer uses that GPU. Run "
                             "the trainer as a Ray actor holding its GPU, or hide it from Ray (CUDA_VISIBLE_DEVICES "
                             "before ray start)")
        return
    if info.get("node_id") != place.node_id:
        raise ValueError(f"replica {index} is co-located with the trainer but runs on Ray node "
                         f"{info.get('node_id')}, the trainer on {place.node_id}: weights by handle (CUDA IPC, "
                         f"shared memory) need one host; {ADVICE}")
    kind = torch.device(info.get("device", "cpu")).type
    if kind != place.device.type or info.get("device_uuid") != place.device_uuid:
        raise ValueError(f"replica {index} is co-located with the trainer but its engine is on {where}, the trainer "
                         f"on {place.describe()}: give both the same device (trainer_device / model.device), or "
                         f"{ADVICE}")


def check_source(pairs: list[tuple[str, torch.Tensor]], place: TrainerPlace) -> None:
    """Every tensor of a push must be on the trainer's device: the co-located replica maps them from there."""
    for name, t in pairs:
        dev = t.device
        if dev.type != place.device.type or (dev.type == "cuda" and cuda_device(dev) != place.device):
            raise ValueError(f"weight {name!r} is on {dev}, but replica 0 is co-located with the trainer on "
                             f"{place.describe()} and maps the weights from there (CUDA IPC / shared memory): "
                             f"push tensors on {place.device}, or {ADVICE}")
