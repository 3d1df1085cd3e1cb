"""Environments in the loop: TRL's environment protocol, the engine-side loop, and two examples.

``rollout.envs.calculator:CalculatorEnv`` (tools) and ``rollout.envs.guess:GuessNumberEnv`` (``step``).
"""

from rollout.envs.loop import EnvLimits, EnvLoop, Episode
from rollout.envs.protocol import EnvSpec, load_factory

__all__ = ["EnvLimits", "EnvLoop", "EnvSpec", "Episode", "load_factory"]
