"""A non-editable install works: the wheel carries the Hydra configs, the entry-point modules and the embedded
model, its console commands name modules, and an installed entry point finds its config away from the checkout."""

from __future__ import annotations

import configparser
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tests.script_helpers import CONF, ROOT


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """``pip wheel .`` (offline, no isolation) of a copy of the sources, so the checkout gets no build/ folder."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("rollout", "trainer_hooks"):
        shutil.copytree(ROOT / name, src / name, ignore=ignore)
    shutil.copy(ROOT / "pyproject.toml", src)
    cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
           "-w", str(tmp / "dist"), str(src)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    (path,) = (tmp / "dist").glob("rollout-*.whl")
    return path


def test_the_wheel_carries_configs_entry_points_and_assets(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    configs = {f"rollout/conf/{p.relative_to(CONF).as_posix()}" for p in CONF.rglob("*.yaml")}
    assert "rollout/conf/config.yaml" in configs and "rollout/conf/model/qwen3-0.6b.yaml" in configs
    assert configs <= names, sorted(configs - names)
    assert {f"rollout/cli/{n}.py" for n in ("__init__", "serve", "train_grpo", "train_ppo")} <= names
    assets = {f"rollout/assets/{p.name}" for p in (ROOT / "rollout" / "assets").iterdir() if p.suffix != ".py"}
    assert "rollout/assets/tokenizer.json" in assets and assets <= names, sorted(assets - names)
    (entry_points,) = (n for n in names if n.endswith(".dist-info/entry_points.txt"))
    parser = configparser.ConfigParser()
    parser.read_string(zipfile.ZipFile(wheel).read(entry_points).decode())
    assert dict(parser["console_scripts"]) == {
        "rollout-run": "rollout.job.main:main", "rollout-serve": "rollout.cli.serve:main",
        "rollout-train-grpo": "rollout.cli.train_grpo:main", "rollout-train-ppo": "rollout.cli.train_ppo:main"}


def test_an_installed_entry_point_finds_its_config(wheel, tmp_path):
    site = tmp_path / "site"
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--no-compile",
           "--target", str(site), str(wheel)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    code = ("import sys; sys.argv = ['rollout-serve', '--cfg', 'job', 'server.port=9'];"
            "import rollout; print('#', rollout.__file__, file=sys.stderr);"
            "from rollout.cli.serve import main; main()")
    env = {**os.environ, "PYTHONPATH": str(site)}  # the installed copy, not the checkout
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"# {site / 'rollout' / '__init__.py'}" in done.stderr
    printed = OmegaConf.create(done.stdout)
    assert printed.server.port == 9 and printed.engine.max_num_seqs == 64
