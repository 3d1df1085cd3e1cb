"""The main job built on the engine: prompt dataset -> rounds -> trajectories (parquet, metrics, W&B).

Nothing here is part of the engine's public API; ``rollout.job.main`` (``scripts/rollout.py``) and
``trainer_hooks`` use it.
"""
