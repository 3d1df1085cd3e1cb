"""``model.path`` as a local checkpoint dir or a Hugging Face Hub name (``Qwen/Qwen3-0.6B``).

A hub name is fetched once with ``huggingface_hub.snapshot_download`` (config, safetensors, tokenizer and
generation config only; the hub's cache makes later runs free). Offline, or for a gated or missing repo,
the error says which and how to proceed instead of surfacing the hub client's exception.
"""

from __future__ import annotations

import re
from pathlib import Path

from rollout.assets import check_checkpoint_dir

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
