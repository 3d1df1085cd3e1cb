"""Console entry points (``[project.scripts]`` in pyproject.toml): the Hydra scripts in ``scripts/`` as commands.

``rollout-run``, ``rollout-train-grpo``, ``rollout-train-ppo`` and ``rollout-serve`` each run their script
as ``__main__`` (so Hydra finds ``conf/`` next to it and names the log file after it), without touching
``sys.path``. The scripts and ``conf/`` live in the source tree, so the commands need the project installed
from a checkout (``pip install -e .``, which ``make`` does).
"""

from __future__ import annotations

import logging
import os
import runpy
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
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


def _run_script(name: str) -> None:
    path = SCRIPTS / f"{name}.py"
    if not path.is_file():
        sys.exit(f"error: {path} is missing: the rollout-* commands run the scripts of a source checkout; "
                 "install the project with `pip install -e .` from the repository")
    runpy.run_path(str(path), run_name="__main__")


def run() -> None:
    _run_script("rollout")


def train_grpo() -> None:
    _run_script("train_grpo")


def train_ppo() -> None:
    _run_script("train_ppo")


def serve() -> None:
    _run_script("serve")
