"""rollout: an RL rollout generator built on asynchronous continuous batching.

Imports are lazy so that torch-free parts (scheduler, block manager) stay torch-free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__all__ = [
    "RolloutBackend", "SteppedBackend", "ContinuousBackend", "RequestBackend", "BackendLimits",
    "Engine", "SamplingParams", "RequestOutput", "CompletionOutput", "EngineConfig",
]
__version__ = "0.1.0"

_WHERE = {
    "RolloutBackend": "rollout.api",
    "SteppedBackend": "rollout.api",
    "ContinuousBackend": "rollout.api",
    "RequestBackend": "rollout.api",
    "BackendLimits": "rollout.api",
    "Engine": "rollout.engine.engine",
    "SamplingParams": "rollout.sampling_params",
    "RequestOutput": "rollout.outputs",
    "CompletionOutput": "rollout.outputs",
    "EngineConfig": "rollout.config",
}

if TYPE_CHECKING:  # pragma: no cover
    from rollout.api import BackendLimits, ContinuousBackend, RequestBackend, RolloutBackend, SteppedBackend
    from rollout.config import EngineConfig
    from rollout.engine.engine import Engine
    from rollout.outputs import CompletionOutput, RequestOutput
    from rollout.sampling_params import SamplingParams


def __getattr__(name: str) -> object:
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'rollout' has no attribute {name!r}")
