"""Trainer integration: TRL's rollout_func and async-GRPO adapters, PPO, and weight sync into a live engine.

    from trainer_hooks import EngineGRPOTrainer, TRLRollout
    trainer = EngineGRPOTrainer(model, reward_funcs, args, train_dataset, rollout_func=TRLRollout(engine))

(``EngineGRPOTrainer`` adds TRL's importance-sampling correction on the engine's logprobs to a plain
``GRPOTrainer(..., rollout_func=TRLRollout(engine))``.)
    # or against a server (scripts/serve.py) in another process:
    rollout_func = TRLRollout(RolloutClient("http://127.0.0.1:8000"))

Imports are lazy so that ``import trainer_hooks`` does not pull in trl or torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__all__ = [
    "TRLRollout",
    "EngineGRPOTrainer",
    "EngineAsyncGRPOTrainer",
    "EngineWindow",
    "PPOConfig",
    "EnginePPO",
    "HFWeights",
    "normalize_name",
    "push_weights",
    "bench_weight_push",
    "EngineRolloutWorker",
    "EngineWeightTransfer",
    "build_async_grpo_trainer",
    "RolloutClient",
    "save_snapshot",
]

_WHERE = {
    "TRLRollout": "trainer_hooks.trl",
    "EngineGRPOTrainer": "trainer_hooks.grpo",
    "EngineAsyncGRPOTrainer": "trainer_hooks.async_trainer",
    "EngineWindow": "trainer_hooks.engine_metrics",
    "PPOConfig": "trainer_hooks.ppo",
    "EnginePPO": "trainer_hooks.ppo_loop",
    "HFWeights": "trainer_hooks.weights",
    "normalize_name": "trainer_hooks.weights",
    "push_weights": "trainer_hooks.weights",
    "bench_weight_push": "trainer_hooks.weights",
    "EngineRolloutWorker": "trainer_hooks.async_grpo",
    "EngineWeightTransfer": "trainer_hooks.async_grpo",
    "build_async_grpo_trainer": "trainer_hooks.async_trainer",
    "RolloutClient": "trainer_hooks.client",
    "save_snapshot": "trainer_hooks.snapshot",
}

if TYPE_CHECKING:  # pragma: no cover
    from trainer_hooks.async_grpo import EngineRolloutWorker, EngineWeightTransfer
    from trainer_hooks.async_trainer import EngineAsyncGRPOTrainer, build_async_grpo_trainer
    from trainer_hooks.client import RolloutClient
    from trainer_hooks.engine_metrics import EngineWindow
    from trainer_hooks.grpo import EngineGRPOTrainer
    from trainer_hooks.ppo import PPOConfig
    from trainer_hooks.ppo_loop import EnginePPO
    from trainer_hooks.snapshot import save_snapshot
    from trainer_hooks.trl import TRLRollout
    from trainer_hooks.weights import HFWeights, bench_weight_push, normalize_name, push_weights


def __getattr__(name: str) -> object:
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'trainer_hooks' has no attribute {name!r}")
