"""Stop conditions, checked on the host after each sampled token lands."""

from __future__ import annotations

from collections.abc import Callable

from rollout.engine.sequence import Sequence


def check_stop(seq: Sequence, detokenize: Callable[[list[int]], str] | None) -> tuple[str, int | str | None] | None:
    """(finish_reason, stop_reason) if the newest known token ends ``seq``, else None.

    ``seq.stop_ids`` (EOS unless ``ignore_eos``, plus ``stop_token_ids``) count only once ``min_tokens``
    are out (the sampler also masks them before); a stop string is searched in the tail of the decoded
    output so the check stays O(1) per token. ``stop_reason`` is the stop token id, or None for EOS.
    """
    p = seq.params
    n_out = seq.num_output_tokens - seq.num_inflight
    tok = seq.token_ids[seq.num_prompt_tokens + n_out - 1]
    if n_out >= p.min_tokens:
        if tok in seq.stop_ids:
            return "stop", (tok if tok in p.stop_set else None)
        if p.stop and detokenize is not None:
            hit = find_stop_string(seq.token_ids[seq.num_prompt_tokens : seq.num_prompt_tokens + n_out],
                                   p.stop, detokenize)
            if hit is not None:
                return "stop", hit
    if n_out >= p.max_tokens:
        return "length", None
    return None


def find_stop_string(output_ids: list[int], stops: list[str], detokenize: Callable[[list[int]], str]) -> str | None:
    window = max(len(s) for s in stops) + 8  # tokens: a stop string spans at most this many
    tail = detokenize(output_ids[-window:])
    last = detokenize(output_ids[-1:])
    for s in stops:
        idx = tail.rfind(s)
        # only a match that the newest token helped complete (an older one would have stopped earlier)
        if idx >= 0 and idx + len(s) > len(tail) - len(last):
            return s
    return None


def truncate_at_stop(text: str, stop: str, keep: bool = False) -> str:
    """The text up to the stop string (``keep``: up to and including it: ``include_stop_str_in_output``).

    The last occurrence is the one that stopped it (an earlier one came before ``min_tokens``)."""
    idx = text.rfind(stop)
    return text if idx < 0 else text[: idx + len(stop) if keep else idx]
