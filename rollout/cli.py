"""Console entry points (``[project.scripts]`` in pyproject.toml): the Hydra scripts in ``scripts/`` as commands.

``rollout-run``, ``rollout-train-grpo``, ``rollout-train-ppo`` and ``rollout-serve`` each run their script
as ``__main__`` (so Hydra finds ``conf/`` next to it and names the log file after it), without touching
``sys.path``. The scripts and ``conf/`` live in the source tree, so the commands need the project installed
from a checkout (``pip install -e .``, which ``make`` does).
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


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
