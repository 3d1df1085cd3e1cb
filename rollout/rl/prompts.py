"""Prompts for the job and the trainers alike: the rows they come from (``data.*``), the tokenizer that encodes
them (``model.tokenizer``) and how a prompt becomes token ids (raw text, or through the chat template).

One encoding everywhere, so a prompt gets the same ids in the job, in GRPO, async GRPO and PPO.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from rollout.assets import default_dataset_path
from rollout.settings.schema import DataConfig

LOCAL_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}


def load_tokenizer(model_dir: str | Path, tokenizer: str | None = None, needed_by: str | None = None) -> Any:
    """``model.tokenizer`` (a directory) or else the checkpoint's own tokenizer files. A checkpoint without
    any gives None (token-id prompts only), or a ValueError when ``needed_by`` names what needs one."""
    from rollout.engine.loading import load_tokenizer as load

    explicit = None if tokenizer is None else os.path.expanduser(tokenizer)
    try:
        tok = load(os.path.expanduser(str(model_dir)), explicit)
    except FileNotFoundError:
        raise FileNotFoundError(f"model.tokenizer={tokenizer!r} is not a directory with tokenizer files") from None
    except (OSError, ValueError) as e:  # files that transformers cannot read
        raise ValueError(f"cannot load the tokenizer in {explicit or str(model_dir)!r}: {e}") from None
    if tok is None and needed_by is not None:
        raise ValueError(f"{needed_by} needs a tokenizer and the checkpoint {str(model_dir)!r} has none; set "
                         "model.tokenizer")
    return tok


def use_chat_template(tokenizer: Any, setting: bool | str) -> bool:
    """``data.apply_chat_template`` for plain-string prompts: true, false, or "auto" (when the tokenizer has one)."""
    if setting == "auto":
        return tokenizer is not None and getattr(tokenizer, "chat_template", None) is not None
    return bool(setting)


def encode_prompt(tokenizer: Any, prompt: str | list[dict[str, Any]], template_strings: bool = False,
                  **template_kwargs: Any) -> tuple[str, list[int]]:
    """(The text the model sees, its token ids) for a string (raw, or as one user message with ``template_strings``)
    or a list of {role, content} messages (always through the chat template, with a generation prompt).
    ``template_kwargs`` go to ``apply_chat_template`` (``tools``, ``chat_template``, ``enable_thinking``...)."""
    if isinstance(prompt, str) and not template_strings:
        return prompt, list(tokenizer(prompt)["input_ids"])
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **template_kwargs)
    return text, list(tokenizer(text, add_special_tokens=False)["input_ids"])


def load_rows(cfg: DataConfig) -> Any:
    """A local file by its suffix, a local dataset dir, or a dataset name (hub access: the network's job)."""
    path = cfg.path if cfg.path is not None else str(default_dataset_path())
    local = Path(path).expanduser()
    if local.is_file():
        if local.stat().st_size == 0:
            raise ValueError(f"data.path={path!r} is an empty file: it has no rows")
        fmt = LOCAL_FORMATS.get(local.suffix.lower())
        if fmt is None:
            raise ValueError(
                f"data.path={path!r} has an unsupported suffix; allowed: {sorted(LOCAL_FORMATS)}"
            )
        return _load(path, cfg.split, fmt, data_files=str(local))
    if local.suffix.lower() in LOCAL_FORMATS or path.startswith((".", "/", "~")) and not local.is_dir():
        raise FileNotFoundError(f"data.path={path!r} does not exist")
    return _load(path, cfg.split, path, cfg.name)


def _load(where: str, split: str, *args: Any, **kwargs: Any) -> Any:
    import datasets

    try:
        return datasets.load_dataset(*args, split=split, **kwargs)
    except Exception as e:  # noqa: BLE001 - datasets raises many types (StopIteration on an empty file, ArrowInvalid)
        reason = f"{type(e).__name__}: {e}" if str(e) else f"{type(e).__name__} (an empty or unreadable file?)"
        raise ValueError(f"could not load data.path={where!r} (data.split={split!r}): {reason}") from None
