"""Prompt datasets through `datasets`: local JSON/JSONL/Parquet files or a dataset name.

Prompts are consumed in order (optionally shuffled once with a fixed seed) and wrap around when the
dataset is exhausted, so round r always uses positions [r * num_prompts, (r + 1) * num_prompts): a
resume skips the prompts already used just by knowing how many rounds are done.

``PromptDataset.check`` renders every row once before the job writes anything, so a bad row (null,
wrong type, out-of-vocabulary or negative id, too long for the model or the KV cache) stops the job at
the start, named by its index, instead of after hours of rounds and again on every resume.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rollout.engine.validation import check_lengths
from rollout.rl.prompts import encode_prompt, load_rows, use_chat_template
from rollout.sampling_params import SamplingParams
from rollout.settings.schema import DataConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Prompt:
    index: int  # the dataset row it came from
    text: str  # what the model sees (after the chat template, if one was applied)
    token_ids: tuple[int, ...]
    answer: str | None
    columns: tuple[tuple[str, Any], ...] = ()  # every column of the row, as the trajectory names them


@dataclass(frozen=True, slots=True)
class PromptLimits:
    """What the engine accepts: ids in [0, vocab_size), prompt + max_tokens within both limits."""

    vocab_size: int
    max_model_len: int
    max_kv_tokens: int


class PromptDataset:
    """Rows of a `datasets.Dataset`, rendered and tokenized on demand (datasets can be large)."""

    def __init__(
        self,
        rows: Any,
        tokenizer: Any,
        prompt_field: str,
        answer_field: str | None,
        apply_chat_template: bool | str = "auto",
        order: Sequence[int] | None = None,
    ) -> None:
        assert len(rows) > 0 and prompt_field in rows.column_names
        assert order is None or sorted(order) == list(range(len(rows)))
        self.rows, self.tokenizer = rows, tokenizer
        self.order = list(order) if order is not None else None  # a shuffle; the rows keep their own index
        self.prompt_field = prompt_field
        self.answer_field = answer_field if answer_field in rows.column_names else None
        self.template_strings = use_chat_template(tokenizer, apply_chat_template)

    def __len__(self) -> int:
        return len(self.rows)

    def get(self, position: int) -> Prompt:
        """The prompt at stream position ``position`` (wrapping around the dataset)."""
        index = position % len(self.rows)
        if self.order is not None:
            index = self.order[index]
        row = self.rows[index]
        text, ids = self._render(row[self.prompt_field], index)
        answer = row[self.answer_field] if self.answer_field is not None else None
        columns = tuple((column_name(k), v) for k, v in row.items())
        return Prompt(index, text, tuple(ids), None if answer is None else str(answer), columns)

    def column_types(self) -> dict[str, Any]:
        """Arrow type of every dataset column, under the name trajectories give it (``column_name``)."""
        schema = self.rows.data.schema
        return {column_name(f.name): f.type for f in schema}

    def batch(self, start: int, count: int) -> list[Prompt]:
        return [self.get(start + i) for i in range(count)]

    def check(self, limits: PromptLimits, params: SamplingParams, where: str = "the dataset") -> int:
        """Render every row and check it against the engine's limits; returns the longest prompt's length.

        Errors name the row (its index in the file, before any shuffle) and what is allowed.
        """
        longest, longest_row = 0, 0
        for index, row in enumerate(self.rows):
            try:
                _, ids = self._render(row[self.prompt_field], index)
                bad = next((t for t in ids if t >= limits.vocab_size), None)
                if bad is not None:
                    raise ValueError(f"token id {bad} is outside the vocabulary [0, {limits.vocab_size})")
                if not ids:
                    raise ValueError("the prompt has no tokens")
                check_lengths(len(ids), params, limits.max_model_len, limits.max_kv_tokens, limits.vocab_size)
            except ValueError as e:
                msg = str(e) if str(e).startswith("row ") else f"row {index}: {e}"
                raise ValueError(f"{where}, {msg}") from None
            if len(ids) > longest:
                longest, longest_row = len(ids), index
        log.info("checked %d prompts of %s: the longest has %d tokens (row %d)", len(self.rows), where,
                 longest, longest_row)
        return longest

    def _render(self, value: object, index: int) -> tuple[str, list[int]]:
        tok = self.tokenizer
        if value is None:
            raise ValueError(f"row {index}: field {self.prompt_field!r} is null")
        if _is_token_ids(value):
            ids = list(value)  # type: ignore[arg-type]
            negative = next((t for t in ids if t < 0), None)
            if negative is not None:  # the tokenizer's decode would die on it with an OverflowError
                raise ValueError(f"row {index}: token id {negative} is negative; ids must be in [0, vocab_size)")
            return (tok.decode(ids) if tok is not None else ""), ids
        if tok is None:
            raise ValueError(
                "the model has no tokenizer, so text prompts cannot be encoded; set model.tokenizer"
            )
        if isinstance(value, str) and not self.template_strings:
            return encode_prompt(tok, value)
        messages = [{"role": "user", "content": value}] if isinstance(value, str) else value
        if not _is_messages(messages):
            raise ValueError(
                f"row {index}: field {self.prompt_field!r} must be a string, a list of token ids or a "
                f"list of {{role, content}} messages, got {value!r:.200}"
            )
        if getattr(tok, "chat_template", None) is None:
            raise ValueError(
                f"row {index}: chat-formatted prompts need a chat template, and the tokenizer has none "
                "(or set data.apply_chat_template=false for plain strings)"
            )
        return encode_prompt(tok, messages)


DATA_PREFIX = "data_"  # a dataset column whose name a trajectory column already has gets this prefix


def column_name(name: str) -> str:
    """A dataset column's name in the trajectories: its own, prefixed where a trajectory column has it."""
    from rollout.job.trajectory_writer import trajectory_schema

    taken = set(trajectory_schema(True, True).names)
    while name in taken:
        name = DATA_PREFIX + name
    return name


def load_prompt_dataset(cfg: DataConfig, tokenizer: Any, require_answer: bool = False) -> PromptDataset:
    """Load and check the dataset before any generation: the prompt field (and answer field) must exist."""
    rows = load_rows(cfg)
    where = cfg.path or "the embedded dataset"
    if len(rows) == 0:
        raise ValueError(f"data.path={where!r} split {cfg.split!r} has no rows")
    fields = list(rows.column_names)
    if cfg.prompt_field not in fields:
        raise ValueError(
            f"data.prompt_field={cfg.prompt_field!r} is not a field of {where!r}; its fields are {fields}"
        )
    if require_answer and (cfg.answer_field is None or cfg.answer_field not in fields):
        raise ValueError(
            f"the reward needs answers but data.answer_field={cfg.answer_field!r} is not a field of "
            f"{where!r}; its fields are {fields} (or set rollout.reward=null)"
        )
    order = None
    if cfg.shuffle:
        order = list(range(len(rows)))
        random.Random(cfg.seed).shuffle(order)
    return PromptDataset(rows, tokenizer, cfg.prompt_field, cfg.answer_field, cfg.apply_chat_template, order)


def _is_token_ids(value: object) -> bool:
    return (
        isinstance(value, Sequence)
        and not isinstance(value, str)
        and len(value) > 0
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )


def _is_messages(value: object) -> bool:
    return (
        isinstance(value, list)
        and len(value) > 0
        and all(
            isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in value
        )
    )
