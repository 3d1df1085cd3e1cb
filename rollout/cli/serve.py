"""The engine as an OpenAI / vLLM-compatible server that a trainer in another process pushes weights into.

    rollout-serve                                             # the embedded tiny model on 127.0.0.1:8000
    rollout-serve model.path=/ckpt server.host=0.0.0.0 server.port=8001 engine.max_num_seqs=256

(``python scripts/serve.py ...`` from the repo root does the same.) Configured like the main job
(rollout/conf/serve.yaml reuses its model / engine / sampling groups, plus
`server`); the engine is built exactly as the main job builds it. Everything a user can get wrong
is checked before loading; the script then prints ``error: ...`` and exits with status 2.
"""

from __future__ import annotations

import logging
from pathlib import Path

import hydra
from omegaconf import DictConfig

from rollout.cli import quiet_progress_bars, resolved_config, run_or_exit
from rollout.rl.prompts import load_tokenizer
from rollout.serve.config import ServeConfig
from rollout.settings.model import load_engine, model_dir

log = logging.getLogger("rollout.serve")


def load_config(cfg: DictConfig) -> ServeConfig:
    return ServeConfig.from_dict(resolved_config(cfg, hint=""))


def build_engine(config: ServeConfig) -> tuple[object, Path]:
    """(engine, checkpoint dir) the way the main job builds them (same groups, same checks)."""
    path = model_dir(config.model)
    tokenizer = load_tokenizer(path, config.model.tokenizer)
    return load_engine(config.model, config.engine, path, tokenizer), path


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
    quiet_progress_bars()
    run_or_exit(run, cfg, log)


if __name__ == "__main__":
    main()
