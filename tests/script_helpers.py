"""Compose the Hydra configs in rollout/conf/ and load the scripts left in scripts/ (bench.py) as modules, for tests.

The console entry points are modules (``rollout.cli.serve``, ``rollout.cli.train_grpo``, ...): tests import them."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CONF = ROOT / "rollout" / "conf"


def compose(config_name: str, *overrides: str) -> Any:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "rollout" / "conf"), version_base="1.3"):
        return hydra_compose(config_name, overrides=list(overrides))


def load_script(name: str) -> ModuleType:
    return _load(ROOT / "scripts" / f"{name}.py", f"{name}_script")


def load_bench(name: str, alias: str | None = None) -> ModuleType:
    """A fresh copy of ``bench/<name>.py`` as a module (``alias``: its name in sys.modules, for a test that
    patches its globals and must not share them with another test's copy)."""
    return _load(ROOT / "bench" / f"{name}.py", alias or f"bench_{name}")


def _load(path: Path, module_name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses resolve their module through sys.modules
    spec.loader.exec_module(module)
    return module


def message_regex(message: str) -> str:
    """A refusal message as a ``pytest.raises(match=...)`` pattern: ``[``, ``]`` and ``+`` literal, ``.*`` still
    a wildcard (some expected messages skip a part that way)."""
    return message.replace("[", r"\[").replace("+", r"\+").replace("]", r"\]")


def run_job(out: Path, cache: Path, *overrides: str) -> list[dict]:
    """The main job (``config``) writing into ``out``, its model cached in ``cache``: its trajectory rows."""
    from rollout.job import main as script
    from rollout.job.trajectory_writer import read_trajectories

    script.run(compose("config", f"output_dir={out}", f"model.cache_dir={cache}", *overrides))
    return read_trajectories(out).to_pylist()
