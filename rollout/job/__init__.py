"""The main job built on the engine: prompt dataset -> rounds -> trajectories (parquet, metrics, W&B).

Nothing here is part of the engine's public API, and nothing outside it imports it but ``scripts/rollout.py``
(what the server and the trainers share with it lives in ``rollout.settings`` and ``rollout.rl``).
"""
