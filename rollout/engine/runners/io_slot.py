"""One IO slot: pinned host buffers and their device twins for every per-step input, plus events.

Inputs are packed into three flat buffers by dtype (int64, int32, float32) at fixed offsets, so a
step is three host-to-device copies and every field is a *static* view that CUDA graphs can read.
Two slots are used alternately: the CPU fills slot B for batch N+1 while the GPU reads slot A.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True, slots=True)
class SlotShape:
    max_tokens: int  # T: flattened new tokens per step
    max_seqs: int  # B
    max_blocks: int  # W: block-table width
    max_suppress: int  # S: suppressed ids per row
    max_copies: int  # copy-on-write block copies per step


def _layout(shape: SlotShape) -> dict[str, dict[str, tuple[int, int]]]:
    t, b = shape.max_tokens, shape.max_seqs
    groups = {
        "i64": [("input_ids", t), ("positions", t), ("slot_mapping", t), ("carry", t), ("sample_idx", b),
                ("top_k", b), ("seed", b), ("position", b), ("mode", b), ("suppress", b * shape.max_suppress),
                ("copy_src", shape.max_copies), ("copy_dst", shape.max_copies), ("hist_row", b)],
        "i32": [("query_start_loc", b + 1), ("seq_lens", b), ("block_tables", b * shape.max_blocks)],
        "f32": [("temperature", b), ("top_p", b), ("min_p", b), ("repetition", b), ("presence", b),
                ("frequency", b)],
    }
    out: dict[str, dict[str, tuple[int, int]]] = {}
    for group, items in groups.items():
        off, fields = 0, {}
        for name, n in items:
            fields[name] = (off, n)
            off += n
        out[group] = fields
    return out


_DTYPES = {"i64": torch.int64, "i32": torch.int32, "f32": torch.float32}


class IOSlot:
    def __init__(self, index: int, shape: SlotShape, device: torch.device) -> None:
        self.index, self.shape, self.device = index, shape, device
        self.layout = _layout(shape)
        self.host: dict[str, torch.Tensor] = {}
        self.dev: dict[str, torch.Tensor] = {}
        self.np: dict[str, np.ndarray] = {}
        for group, fields in self.layout.items():
            size = sum(n for _, n in fields.values())
            self.host[group] = torch.zeros(size, dtype=_DTYPES[group], pin_memory=True)
            self.dev[group] = torch.zeros(size, dtype=_DTYPES[group], device=device)
            self.np[group] = self.host[group].numpy()
        self.out_tokens = torch.zeros(shape.max_seqs, dtype=torch.int64, device=device)
        self.out_logprobs = torch.zeros(shape.max_seqs, dtype=torch.float32, device=device)
        self.host_tokens = torch.zeros(shape.max_seqs, dtype=torch.int64, pin_memory=True)
        self.host_logprobs = torch.zeros(shape.max_seqs, dtype=torch.float32, pin_memory=True)
        # top logprobs (allocated on first use: most engines never ask)
        self.out_top_ids: torch.Tensor | None = None
        self.out_top_lps: torch.Tensor | None = None
        self.host_top_ids: torch.Tensor | None = None
        self.host_top_lps: torch.Tensor | None = None
        self.h2d_done = torch.cuda.Event()
        self.compute_done = torch.cuda.Event()
        self.d2h_done = torch.cuda.Event()
        self.compute_start = torch.cuda.Event(enable_timing=True)
        self.compute_end = torch.cuda.Event(enable_timing=True)
        self.used = False  # events recorded at least once

    def ensure_top(self, k: int) -> None:
        if self.out_top_ids is None:
            n = self.shape.max_seqs
            self.out_top_ids = torch.zeros(n, k, dtype=torch.int64, device=self.device)
            self.out_top_lps = torch.zeros(n, k, dtype=torch.float32, device=self.device)
            self.host_top_ids = torch.zeros(n, k, dtype=torch.int64, pin_memory=True)
            self.host_top_lps = torch.zeros(n, k, dtype=torch.float32, pin_memory=True)
            torch.cuda.synchronize(self.device)  # zeroed before any stream uses them (once per slot)

    def host_view(self, name: str) -> np.ndarray:
        group, (off, n) = self._find(name)
        return self.np[group][off : off + n]

    def dev_view(self, name: str, n: int | None = None) -> torch.Tensor:
        group, (off, size) = self._find(name)
        return self.dev[group][off : off + (size if n is None else n)]

    def _find(self, name: str) -> tuple[str, tuple[int, int]]:
        for group, fields in self.layout.items():
            if name in fields:
                return group, fields[name]
        raise KeyError(name)
