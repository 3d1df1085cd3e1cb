"""A picklable recipe for an engine, so a Ray actor can build its own on its own device."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class EngineFactory:
    """``Engine.from_pretrained(model, dtype, device, tokenizer, **options)`` in whichever process calls it.

    ``model`` must be a path or hub id every replica can read (not an in-memory module: it would be
    pickled to each actor). ``device=None`` picks the replica's own GPU (Ray sets CUDA_VISIBLE_DEVICES).
    """

    model: str
    dtype: str = "auto"
    device: str | None = None
    tokenizer: Any = None  # a path, a (picklable) tokenizer object, or None = the checkpoint's own
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise TypeError(f"EngineFactory.model must be a checkpoint path or hub id (str), got {self.model!r}")

    def __call__(self) -> Any:
        from rollout import Engine

        return Engine.from_pretrained(self.model, dtype=self.dtype, device=self.device, tokenizer=self.tokenizer,
                                      **self.options)
