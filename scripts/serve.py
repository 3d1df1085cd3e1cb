"""The engine as an OpenAI / vLLM-compatible server that a trainer in another process pushes weights into.

    python scripts/serve.py                                   # the embedded tiny model on 127.0.0.1:8000
    python scripts/serve.py model.path=/ckpt server.host=0.0.0.0 server.port=8001 engine.max_num_seqs=256

Configured like the main job (conf/serve.yaml reuses its model / engine / sampling groups, plus
`server`); the engine is built exactly as scripts/rollout.py builds it. Everything a user can get wrong
is checked before loading; the script then prints ``error: ...`` and exits with status 2.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

# scripts/rollout.py is named like the package: drop this directory from the path so `import rollout`
# finds the package.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or os.curdir).resolve() != _HERE]

import hydra  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402
from omegaconf.errors import OmegaConfBaseException  # noqa: E402

from rollout.serve.config import ServeConfig  # noqa: E402

USER_ERRORS = (ValueError, FileNotFoundError)


def _job_setup() -> Any:
    """The main job's loaders (model dir, tokenizer, engine): the one way a config becomes an engine."""
    try:
        import rollout.job.setup as setup  # issue 8 moved them here from scripts/rollout.py

        return setup
    except ImportError:  # pragma: no cover - before that: scripts/rollout.py's own helpers
        spec = importlib.util.spec_from_file_location("rollout_job_script", _HERE / "rollout.py")
        module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        spec.loader.exec_module(module)  # type: ignore[union-attr]
        return _Legacy(module)


class _Legacy:
    """scripts/rollout.py's private helpers under rollout.job.setup's names."""

    def __init__(self, script: ModuleType) -> None:
        self.model_dir, self.load_tokenizer, self.load_engine = (script._model_dir, script._load_tokenizer,
                                                                 script._load_engine)


def load_config(cfg: DictConfig) -> ServeConfig:
    try:
        raw = OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as e:
        raise ValueError(f"the config does not resolve: {e}") from None
    return ServeConfig.from_dict(raw)  # type: ignore[arg-type]


def build_engine(config: ServeConfig) -> tuple[object, Path]:
    """(engine, checkpoint dir) the way the main job builds them (same groups, same checks)."""
    setup = _job_setup()
    model_dir = setup.model_dir(config)
    tokenizer = setup.load_tokenizer(config.model.tokenizer or model_dir, explicit=config.model.tokenizer is not None)
    return setup.load_engine(config, model_dir, tokenizer), model_dir


def run(cfg: DictConfig) -> None:
    config = load_config(cfg)
    engine, model_dir = build_engine(config)
    if config.server.torch_threads is not None:
        import torch

        torch.set_num_threads(config.server.torch_threads)
    from rollout.serve.app import serve

    serve(engine, config, config.server.served_model_name or model_dir.name, str(model_dir))


@hydra.main(version_base="1.3", config_path="../conf", config_name="serve")
def main(cfg: DictConfig) -> None:
    try:
        run(cfg)
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    main()
