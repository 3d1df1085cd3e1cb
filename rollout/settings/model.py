"""The ``model`` and ``engine`` sections made real: ``model.path`` as a local checkpoint dir, a Hugging Face Hub
name (``Qwen/Qwen3-0.6B``) or the embedded default, and the in-process engine on it.

A hub name is fetched once with ``huggingface_hub.snapshot_download`` (config, safetensors, tokenizer and
generation config only; the hub's cache makes later runs free). Offline, or for a gated or missing repo,
the error says which and how to proceed instead of surfacing the hub client's exception.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

from rollout.assets import check_checkpoint_dir
from rollout.config import EngineConfig
from rollout.settings.schema import ModelConfig

CHECKPOINT_FILES = ["config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json",
                    "tokenizer*", "special_tokens_map.json", "vocab.json", "merges.txt", "*.model",
                    "chat_template.*"]
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def is_hub_name(path: str) -> bool:
    """``org/name`` that is not an existing local path."""
    return bool(_REPO_ID.match(path)) and not Path(path).expanduser().exists()


def resolve_model_path(path: str, key: str = "model.path") -> Path:
    """A checkpoint dir for ``path``: checked as is when local, downloaded (or found in the hub cache)
    when it is a hub name."""
    if not is_hub_name(path):
        return check_checkpoint_dir(path)
    from huggingface_hub import snapshot_download

    try:
        local = snapshot_download(repo_id=path, allow_patterns=CHECKPOINT_FILES)
    except Exception as e:  # the hub client raises its own types (offline, gated, missing, network)
        raise ValueError(
            f"{key}={path!r} is not a local directory, so it was taken as a Hugging Face Hub name, and "
            f"huggingface_hub.snapshot_download could not fetch it ({type(e).__name__}: {e}). Offline "
            "(HF_HUB_OFFLINE=1, or no network)? Download it where there is a network "
            f"(`hf download {path}`) and set {key} to that directory; a gated model also needs `hf auth login`."
        ) from None
    return check_checkpoint_dir(local)


def model_dir(model: ModelConfig) -> Path:
    """A local checkpoint dir, a hub name (fetched once), or the embedded default (random init, saved once)."""
    from rollout.assets import materialize_default_model

    if model.path is not None:
        return resolve_model_path(model.path)
    return materialize_default_model(model.cache_dir, seed=model.seed)


def load_engine(model: ModelConfig, engine: EngineConfig, path: Path, tokenizer: Any) -> Any:
    """The in-process engine on the checkpoint at ``path``; a checkpoint it cannot load is a ValueError."""
    from rollout import Engine

    try:
        return Engine.from_pretrained(str(path), dtype=model.dtype, device=model.device, tokenizer=tokenizer,
                                      **dataclasses.asdict(engine))
    except (ValueError, KeyError, OSError) as e:  # e.g. an architecture the engine lacks, a missing tensor
        raise ValueError(f"cannot load the model in {str(path)!r}: {e}") from None
