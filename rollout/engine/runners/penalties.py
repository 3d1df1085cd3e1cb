"""Per-sequence token counts on the device, for repetition / presence / frequency penalties.

One int32 row per sequence with penalties (2 * count in the output + 1 if in the prompt; the last row
stays zero for rows without penalties). A row is built from the host's known tokens the first time a
sequence samples (and again after it left a step: preemption, a failed step); after that the sampler
adds each step's sampled tokens on the device (``sampler.count_samples``), so no token crosses to the
host for it and a sample still in flight (async carry-over) is already counted. Rows of sequences
absent from a step are freed: every later use rebuilds from tokens that have landed by then.
"""

from __future__ import annotations

import torch

from rollout.engine.plan import SeqPlan
from rollout.engine.sequence import PLACEHOLDER


class PenaltyRows:
    def __init__(self, max_rows: int, vocab_size: int, device: torch.device) -> None:
        self.max_rows, self.vocab_size, self.device = max_rows, vocab_size, device
        self.hist: torch.Tensor | None = None  # [max_rows + 1, vocab] int32, allocated on first use
        self._rows: dict[int, int] = {}
        self._free = list(range(max_rows - 1, -1, -1))

    @property
    def zero_row(self) -> int:
        return self.max_rows

    def assign(self, plans: list[SeqPlan]) -> tuple[list[int], list[tuple[SeqPlan, int]]]:
        """Host side: each sampling row's history row (the zero row without penalties), and the rows to build."""
        get, zero = self._rows.get, self.zero_row
        rows = [zero if sp.penalties is None else get(sp.seq_id, -1) for sp in plans]
        if -1 not in rows and len(self._rows) == len(rows) - rows.count(zero):
            return rows, []  # the usual decode step: every sequence known, none gone
        present = {sp.seq_id for sp in plans if sp.penalties is not None}
        for seq_id in [s for s in self._rows if s not in present]:
            self._free.append(self._rows.pop(seq_id))
        rows, new = [], []
        for sp in plans:
            if sp.penalties is None:
                rows.append(self.zero_row)
                continue
            row = self._rows.get(sp.seq_id)
            if row is None:
                row = self._rows[sp.seq_id] = self._free.pop()
                new.append((sp, row))
            rows.append(row)
        return rows, new

    def build(self, new: list[tuple[SeqPlan, int]]) -> torch.Tensor:
        """Device side (on the current stream): reset and fill the new rows; returns the history tensor."""
        if self.hist is None:
            self.hist = torch.zeros(self.max_rows + 1, self.vocab_size, dtype=torch.int32, device=self.device)
        if not new:
            return self.hist
        p_rows, p_ids, o_rows, o_ids = [], [], [], []
        for sp, row in new:
            assert sp.history is not None
            prompt = sp.history[: sp.num_prompt_tokens]
            out = [t for t in sp.history[sp.num_prompt_tokens :] if t != PLACEHOLDER]
            p_rows += [row] * len(prompt)
            p_ids += prompt
            o_rows += [row] * len(out)
            o_ids += out
        rows = self._to_device([row for _, row in new])
        self.hist.index_fill_(0, rows, 0)
        self.hist.index_put_((self._to_device(p_rows), self._to_device(p_ids)),
                             torch.ones((), dtype=torch.int32, device=self.device))
        if o_ids:
            self.hist.index_put_((self._to_device(o_rows), self._to_device(o_ids)),
                                 torch.full((len(o_ids),), 2, dtype=torch.int32, device=self.device), accumulate=True)
        return self.hist

    def reset(self) -> None:
        """Forget every row (a failed step): the next use rebuilds from the host's tokens."""
        self._rows.clear()
        self._free = list(range(self.max_rows - 1, -1, -1))

    def release(self) -> None:
        self.reset()
        self.hist = None

    def _to_device(self, data: list[int]) -> torch.Tensor:
        t = torch.tensor(data, dtype=torch.int64)
        if self.device.type == "cuda":
            return t.pin_memory().to(self.device, non_blocking=True)  # no host sync on the step's stream
        return t.to(self.device)
