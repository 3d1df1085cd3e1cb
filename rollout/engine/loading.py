"""Build the model, tokenizer and EOS ids from a checkpoint directory or a PreTrainedModel."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator

import torch

from rollout.distributed.group import TPGroup
from rollout.models import get_model_class
from rollout.models.loader import load_checkpoint, load_hf_config, load_named_tensors

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for but CUDA is not available; use device='cpu'")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    return dev


def resolve_dtype(dtype: str | torch.dtype, hf_config: object, device: torch.device) -> torch.dtype:
    """"auto": float32 on the CPU (exact parity with transformers), the checkpoint's 16-bit type on GPU."""
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype must be one of {sorted(DTYPES)} or 'auto', got {dtype}")
        return dtype
    if dtype == "auto":
        if device.type == "cpu":
            return torch.float32
        cfg_dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
        if isinstance(cfg_dtype, str):
            cfg_dtype = DTYPES.get(cfg_dtype)
        return cfg_dtype if cfg_dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)} or 'auto', got {dtype!r}")
    return DTYPES[dtype]


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build_model(source: object, dtype: str | torch.dtype, device: torch.device) -> tuple[torch.nn.Module, object]:
    """Our model with ``source``'s weights: a checkpoint dir or a transformers PreTrainedModel."""
    hf_config = source_config(source)
    checkpoint = str(source) if isinstance(source, (str, os.PathLike)) else None
    model = build_shard(hf_config, checkpoint, resolve_dtype(dtype, hf_config, device), device)
    if checkpoint is None:
        with torch.no_grad():
            load_named_tensors(model, ((n, t.detach()) for n, t in source.named_parameters()))  # type: ignore[attr-defined]
    return model, hf_config


def release(model: torch.nn.Module, device: torch.device) -> None:
    """Free the weights of an engine whose construction failed. The exception's traceback keeps the half-built
    engine (and this model, our own copy of the weights) alive for as long as the caller holds it, so without
    this a retry inside ``except`` (say with the ``num_blocks`` a ``KVCacheTooLarge`` names) would find a second
    copy of the weights on the device and not fit. Meta tensors keep the shapes and free the storage."""
    try:
        model.to(device="meta")
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the sizing reads the device's free bytes, which count the allocator's cache
    except Exception:  # noqa: BLE001 - best effort on a failure path: the caller must see the first error
        pass


def source_config(source: object) -> object:
    """The HF config of a checkpoint dir or a transformers PreTrainedModel."""
    if isinstance(source, (str, os.PathLike)):
        return load_hf_config(str(source))
    if hasattr(source, "config") and hasattr(source, "named_parameters"):
        return source.config
    raise TypeError(
        f"model must be a checkpoint path or a transformers PreTrainedModel, got {type(source).__name__}"
    )


def build_shard(hf_config: object, checkpoint: str | None, dtype: torch.dtype, device: torch.device,
                tp: TPGroup | None = None) -> torch.nn.Module:
    """One tensor-parallel rank's model (the whole model when ``tp`` is None), loaded from
    ``checkpoint`` when given (each tensor sharded as it is read), else left for the caller to fill."""
    with _default_dtype(dtype), torch.device(device):
        model = get_model_class(hf_config)(hf_config, tp)
    if checkpoint is not None:
        load_checkpoint(model, checkpoint)
    return model.eval()


def load_tokenizer(source: object, tokenizer: object | None) -> object | None:
    """The tokenizer given, or the checkpoint's own when it ships one, else None (ids-only use)."""
    if tokenizer is not None and not isinstance(tokenizer, (str, os.PathLike)):
        return tokenizer
    path = tokenizer if tokenizer is not None else source
    if not isinstance(path, (str, os.PathLike)):
        path = getattr(getattr(source, "config", None), "_name_or_path", None)
        if not path or not os.path.isdir(path):
            return None
    path = str(path)
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any(os.path.exists(os.path.join(path, n)) for n in names):
        if tokenizer is not None:
            raise FileNotFoundError(f"no tokenizer files in {path!r} (looked for {names})")
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def eos_token_ids(source: object, hf_config: object, tokenizer: object | None) -> frozenset[int]:
    """EOS ids from generation_config.json, then the model config, then the tokenizer (several allowed)."""
    ids: list[int] = []

    def add(value: object) -> None:
        if isinstance(value, int):
            ids.append(value)
        elif isinstance(value, (list, tuple)):
            ids.extend(v for v in value if isinstance(v, int))

    gen = getattr(source, "generation_config", None)
    if gen is not None:
        add(getattr(gen, "eos_token_id", None))
    if isinstance(source, (str, os.PathLike)):
        path = os.path.join(str(source), "generation_config.json")
        if os.path.exists(path):
            with open(path) as f:
                add(json.load(f).get("eos_token_id"))
    add(getattr(hf_config, "eos_token_id", None))
    if not ids and tokenizer is not None:
        add(getattr(tokenizer, "eos_token_id", None))
    return frozenset(ids)
