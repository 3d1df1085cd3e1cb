"""Several engines behind one ``generate``: Ray actors, dynamic dispatch, weight broadcast, fault tolerance.

``build_rollout(replicas, factory)`` is what the scripts call: one replica is today's in-process
``Engine`` (no Ray at all); more make a ``RolloutPool``. Ray is imported only when a pool is made.
"""

from __future__ import annotations

from typing import Any

from rollout.pool.factory import EngineFactory


def build_rollout(replicas: int, engine_factory: Any, address: str = "local", gpus_per_replica: float = 1,
                  **pool_options: Any) -> Any:
    """An ``Engine`` for ``replicas == 1``, else a ``RolloutPool`` of ``replicas`` Ray actors."""
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"pool.replicas must be an int >= 1, got {replicas!r}")
    if replicas == 1:
        return engine_factory()
    from rollout.pool.pool import RolloutPool

    return RolloutPool(replicas, engine_factory, address=address, gpus_per_replica=gpus_per_replica, **pool_options)


def __getattr__(name: str) -> Any:
    if name == "RolloutPool":
        from rollout.pool.pool import RolloutPool

        return RolloutPool
    raise AttributeError(name)


__all__ = ["EngineFactory", "RolloutPool", "build_rollout"]
