"""The console entry points (``[project.scripts]`` in pyproject.toml) and what they share.

``rollout-serve``, ``rollout-train-grpo`` and ``rollout-train-ppo`` are ``main`` of ``rollout.cli.serve``,
``rollout.cli.train_grpo`` and ``rollout.cli.train_ppo`` (``rollout-run``: ``rollout.job.main``); each
composes its Hydra config from ``rollout/conf/`` (package data, so a non-editable install works too) and
``run(cfg)`` does the work. ``scripts/*.py`` are one-line wrappers of the same ``main``.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from typing import Any

USER_ERRORS = (ValueError, FileNotFoundError)  # what a user can get wrong: `error: ...` and exit 2


def run_or_exit(run: Callable[[Any], object], cfg: Any, log: logging.Logger) -> None:
    """Run a script's job; a user error ends it with ``error: ...`` on stderr (once) and in Hydra's log file,
    and exit status 2, never a traceback."""
    try:
        run(cfg)
    except USER_ERRORS as e:
        message = f"error: {e}"
        record = log.makeRecord(log.name, logging.ERROR, __file__, 0, message, None, None)
        for handler in logging.getLogger().handlers:
            if isinstance(handler, logging.FileHandler):
                handler.handle(record)
        print(message, file=sys.stderr, flush=True)
        sys.exit(2)


def resolved_config(cfg: Any, hint: str = " (outside a Hydra run, set output_dir=...)") -> dict[str, Any]:
    """The composed Hydra config as a plain dict; an interpolation that does not resolve is a user error
    (``ValueError``), not an OmegaConf traceback."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
    except OmegaConfBaseException as e:
        raise ValueError(f"the config does not resolve: {e}{hint}") from None


def quiet_progress_bars() -> None:
    """Third-party progress bars (dataset split generation, checkpoint writing) off; ours stay."""
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

