"""The embedded default (tiny Llama config, tokenizer, arithmetic dataset) and where model files come from.

The files ship as package data so the default job runs offline both in-repo and installed. There are
no weights: the default model is random-init from the shipped config with a fixed seed and saved once to
a cache dir keyed by a hash of config + tokenizer + seed, so every run (and every test) loads the same
checkpoint through the same ``Engine.from_pretrained(dir)`` path a real checkpoint takes.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from importlib import resources
from pathlib import Path

MODEL_FILES = ("config.json", "generation_config.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
DATASET_FILE = "arithmetic.jsonl"


def assets_dir() -> Path:
    """The directory holding the shipped files (a real path: the package is never zipped)."""
    path = Path(str(resources.files(__name__)))
    assert (path / "config.json").is_file(), f"rollout assets missing in {path}"
    return path


def default_dataset_path() -> Path:
    return assets_dir() / DATASET_FILE


def default_cache_dir() -> Path:
    """``$ROLLOUT_CACHE`` or ``~/.cache/rollout``: outside output_dir so runs share one default model."""
    return Path(os.environ.get("ROLLOUT_CACHE") or Path.home() / ".cache" / "rollout")


def materialize_default_model(cache_dir: str | os.PathLike[str] | None = None, seed: int = 0) -> Path:
    """Return a checkpoint dir (config + safetensors + tokenizer) for the default model, building it once.

    Built in a temp dir and renamed into place, so concurrent jobs (a multirun sweep) never see a
    half-written checkpoint.
    """
    src = assets_dir()
    digest = hashlib.sha256(str(seed).encode())
    for name in MODEL_FILES + TOKENIZER_FILES:
        digest.update(name.encode() + (src / name).read_bytes())
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / f"default-llama-{digest.hexdigest()[:12]}"
    if (target / "model.safetensors").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=root))
    try:
        _build_random_model(src, tmp, seed)
        try:
            os.replace(tmp, target)
        except OSError:  # another job won the race; its copy is identical
            if not (target / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _build_random_model(src: Path, out: Path, seed: int) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(src)
    with torch.random.fork_rng(devices=[]):  # the caller's random state is the same whether the cache was warm
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    for name in MODEL_FILES + TOKENIZER_FILES:
        shutil.copyfile(src / name, out / name)


def check_checkpoint_dir(path: str | os.PathLike[str]) -> Path:
    """Refuse a model path before any loading: it must exist and hold config.json and *.safetensors."""
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"model.path {str(path)!r} does not exist")
    if not p.is_dir():
        raise ValueError(
            f"model.path {str(path)!r} is not a directory; expected a Hugging Face checkpoint dir "
            "(config.json + *.safetensors)"
        )
    if not (p / "config.json").is_file():
        raise ValueError(f"model.path {str(path)!r} is not a supported checkpoint: no config.json in it")
    if not any(p.glob("*.safetensors")):
        raise ValueError(f"model.path {str(path)!r} is not a supported checkpoint: no *.safetensors in it")
    return p
