"""Joining or starting Ray, kept in one place so that only the pool imports it (lazily)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import rollout


def init(address: str, num_cpus: float) -> Any:
    """The ``ray`` module, connected: ``local`` starts a small single-machine Ray (no dashboard) unless one
    is already up in this process; any other value is a cluster address (``ray://...`` or ``host:port``)."""
    if not isinstance(address, str) or not address:
        raise ValueError(f"pool address must be 'local' or a Ray cluster address, got {address!r}")
    try:
        import ray
    except ImportError as e:
        raise ImportError("RolloutPool needs Ray: pip install 'rollout[pool]' (pinned in requirements.lock)") from e
    if ray.is_initialized():
        return ray
    # Workers import this checkout's `rollout` even when it is not installed (tests, a source tree).
    root = str(Path(rollout.__file__).resolve().parent.parent)
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    runtime_env = {"env_vars": {"PYTHONPATH": path}}
    if address == "local":
        ray.init(num_cpus=max(int(num_cpus + 0.999), 1), include_dashboard=False, configure_logging=False,
                 runtime_env=runtime_env)
    else:
        ray.init(address=address, runtime_env=runtime_env)
    return ray


def check_gpus(ray: Any, replicas: int, gpus_per_replica: float) -> None:
    """Fail now, not by waiting for ever, when Ray has fewer GPUs than the replicas ask for."""
    if not gpus_per_replica:
        return
    have = ray.cluster_resources().get("GPU", 0)
    if have < replicas * gpus_per_replica:
        raise ValueError(
            f"pool.gpus_per_replica={gpus_per_replica:g} x pool.replicas={replicas} needs "
            f"{replicas * gpus_per_replica:g} GPUs but the Ray cluster has {have:g}; set pool.gpus_per_replica=0 "
            "to run the replicas on the CPU")


def driver_address(address: str) -> str:
    """Where replicas reach this process's weight-group store: loopback on one machine, else our node IP."""
    if address == "local":
        return "127.0.0.1"
    import ray

    return ray.util.get_node_ip_address()
