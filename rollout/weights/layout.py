"""The byte layout every weight push shares: specs (name, dtype, shape), aligned offsets, buckets.

A sender and every receiver derive the same layout from the same metadata: each tensor's bytes sit at an
``ALIGN``-ed offset of one flat stream. The broadcast (``broadcast``) sends that stream in chunks of at
most ``bucket_bytes``; handles (``handles``) pack whole tensors into buckets of about that size
(``bucket_ranges``). Either way a receiver views each tensor in place (``tensor_views``): nothing is unpacked.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from rollout.weights.names import HFWeights

BUCKET_BYTES = 1 << 30
ALIGN = 256  # byte alignment of every tensor in the stream (views of the staging buffer need it)
DTYPES = {
    name: getattr(torch, name)
    for name in ("float32", "bfloat16", "float16", "float64", "float8_e4m3fn", "float8_e5m2")
    if hasattr(torch, name)
}


@dataclass(frozen=True, slots=True)
class TensorSpec:
    name: str
    dtype: str  # vLLM-style name: "bfloat16", not "torch.bfloat16"
    shape: tuple[int, ...]

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def nbytes(self) -> int:
        n = self.torch_dtype.itemsize
        for d in self.shape:
            n *= d
        return n


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def make_specs(names: object, dtype_names: object, shapes: object) -> list[TensorSpec]:
    """Specs from JSON-like lists, refusing anything malformed with a message naming the item."""
    for key, value in (("names", names), ("dtype_names", dtype_names), ("shapes", shapes)):
        if not isinstance(value, (list, tuple)):
            raise TypeError(f"{key} must be a list, got {type(value).__name__}")
    if not len(names) == len(dtype_names) == len(shapes):  # type: ignore[arg-type]
        raise ValueError(f"names, dtype_names and shapes must have one entry per tensor; got lengths "
                         f"{len(names)}, {len(dtype_names)}, {len(shapes)}")  # type: ignore[arg-type]
    if not names:
        raise ValueError("a weight push needs at least one tensor")
    specs = []
    for i, (name, dt, shape) in enumerate(zip(names, dtype_names, shapes)):  # type: ignore[call-overload]
        if not isinstance(name, str) or not name:
            raise TypeError(f"names[{i}] must be a non-empty string, got {name!r}")
        if dt not in DTYPES:
            raise ValueError(f"dtype_names[{i}] ({name!r}) is {dt!r}; allowed: {sorted(DTYPES)}")
        ok = isinstance(shape, (list, tuple)) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                      for d in shape)
        if not ok:
            raise TypeError(f"shapes[{i}] ({name!r}) must be a list of ints >= 0, got {shape!r}")
        specs.append(TensorSpec(name, dt, tuple(shape)))
    if len({s.name for s in specs}) != len(specs):
        raise ValueError("names must be unique within one push")
    return specs


def specs_of(weights: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None) -> list[TensorSpec]:
    """Specs of ``named_weights``' pairs without touching data (an ``HFWeights`` gathers nothing), each
    tensor as ``dtype`` on the wire when given; TypeError naming a malformed item."""
    items = weights.parameters() if isinstance(weights, HFWeights) else weights
    specs = []
    for i, item in enumerate(items):
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
                and isinstance(item[1], torch.Tensor)):
            raise TypeError(f"update_weights expects (name, tensor) pairs; item {i} is {item!r:.80}")
        name, t = item
        specs.append(TensorSpec(name, dtype_name(dtype or t.dtype), tuple(t.shape)))
    if not specs:
        raise ValueError("a weight push needs at least one tensor")
    return specs


def layout(specs: list[TensorSpec]) -> tuple[list[int], int]:
    """(byte offset of each tensor, total stream bytes): offsets aligned to ``ALIGN``."""
    offsets, pos = [], 0
    for s in specs:
        pos = -(-pos // ALIGN) * ALIGN
        offsets.append(pos)
        pos += s.nbytes
    return offsets, pos


def chunk_bounds(total: int, bucket_bytes: int) -> list[tuple[int, int]]:
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < ALIGN:
        raise ValueError(f"bucket_bytes must be an int >= {ALIGN}, got {bucket_bytes!r}")
    return [(a, min(a + bucket_bytes, total)) for a in range(0, total, bucket_bytes)]


def bucket_ranges(specs: list[TensorSpec], bucket_bytes: int = BUCKET_BYTES) -> list[tuple[int, int]]:
    """[first, end) tensor ranges, in spec order: each bucket's layout fits ``bucket_bytes`` unless it holds
    a single larger tensor. Tensors are never split, so each one is a view of exactly one bucket."""
    chunk_bounds(1, bucket_bytes)  # the broadcast's check of the value
    ranges, first, size = [], 0, 0
    for i, s in enumerate(specs):
        start = -(-size // ALIGN) * ALIGN
        if i > first and start + s.nbytes > bucket_bytes:
            ranges.append((first, i))
            first, start = i, 0
        size = start + s.nbytes
    if specs:
        ranges.append((first, len(specs)))
    return ranges

def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.uint8).reshape(-1)


def next_bytes(source: Iterator[tuple[str, torch.Tensor]], specs: list[TensorSpec], i: int) -> torch.Tensor:
    """The next source tensor's bytes, cast to ``specs[i]``'s dtype, once its name and shape are as announced."""
    item = next(source, None)
    spec = specs[i]
    if item is None:
        raise ValueError(f"the weights ended after {i} tensors; {len(specs)} were announced")
    name, tensor = item
    if name != spec.name or tuple(tensor.shape) != spec.shape:
        raise ValueError(f"tensor {i} is {name!r} {tuple(tensor.shape)}; announced {spec.name!r} {spec.shape}")
    return _as_bytes(tensor.to(spec.torch_dtype))


def tensor_views(specs: list[TensorSpec], offsets: list[int], buffer: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) views of a flat byte buffer laid out by ``layout``: nothing is copied."""
    return [(s.name, buffer[o : o + s.nbytes].view(s.torch_dtype).view(s.shape)) for s, o in zip(specs, offsets)]
