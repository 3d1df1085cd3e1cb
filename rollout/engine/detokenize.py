"""Output text as vLLM builds it: ``skip_special_tokens`` and ``spaces_between_special_tokens``.

Fast tokenizers ignore ``spaces_between_special_tokens``; vLLM's (slow-tokenizer) meaning is that
kept special tokens and the text runs between them are joined with a space. Stop strings are cut
from the text unless ``include_stop_str_in_output``.
"""

from __future__ import annotations

from rollout.engine.stop import truncate_at_stop
from rollout.sampling_params import SamplingParams


def decode_output(tokenizer: object, ids: list[int], params: SamplingParams, stop_reason: object) -> str:
    skip = params.skip_special_tokens
    if skip or not params.spaces_between_special_tokens:
        text = tokenizer.decode(ids, skip_special_tokens=skip)  # type: ignore[attr-defined]
    else:
        special = set(getattr(tokenizer, "all_special_ids", ()) or ())
        parts: list[str] = []
        run: list[int] = []
        for t in ids:
            if t in special:
                if run:
                    parts.append(tokenizer.decode(run, skip_special_tokens=False))  # type: ignore[attr-defined]
                    run = []
                parts.append(tokenizer.decode([t], skip_special_tokens=False))  # type: ignore[attr-defined]
            else:
                run.append(t)
        if run:
            parts.append(tokenizer.decode(run, skip_special_tokens=False))  # type: ignore[attr-defined]
        text = " ".join(parts)
    if isinstance(stop_reason, str):
        text = truncate_at_stop(text, stop_reason, keep=params.include_stop_str_in_output)
    return text
