"""Stop conditions, checked on the host after each sampled token lands."""

from __future__ import annotations

from rollout.engine.sequence import Sequence


def check_stop(seq: Sequence, eos_ids: frozenset[int], tokenizer: object | None) -> tuple[str, int | str | None] | None:
    """(finish_reason, stop_reason) if the newest known token ends ``seq``, else None.

    EOS and stop ids count only once ``min_tokens`` are out (the sampler also masks them before);
    a stop string is searched in the tail of the decoded output so the check stays O(1) per token.
    """
    p = seq.params
    n_out = seq.num_output_tokens - seq.num_inflight
    tok = seq.token_ids[seq.num_prompt_tokens + n_out - 1]
    if n_out >= p.min_tokens:
        if tok in p.stop_set:
            return "stop", tok
        if not p.ignore_eos and tok in eos_ids:
            return "stop", None
        if p.stop and tokenizer is not None:
            hit = find_stop_string(seq.token_ids[seq.num_prompt_tokens : seq.num_prompt_tokens + n_out],
                                   p.stop, tokenizer)
            if hit is not None:
                return "stop", hit
    if n_out >= p.max_tokens:
        return "length", None
    return None


def find_stop_string(output_ids: list[int], stops: list[str], tokenizer: object) -> str | None:
    window = max(len(s) for s in stops) + 8  # tokens: a stop string spans at most this many
    tail = tokenizer.decode(output_ids[-window:], skip_special_tokens=False)  # type: ignore[attr-defined]
    last = tokenizer.decode(output_ids[-1:], skip_special_tokens=False)  # type: ignore[attr-defined]
    for s in stops:
        idx = tail.rfind(s)
        # only a match that the newest token helped complete (an older one would have stopped earlier)
        if idx >= 0 and idx + len(s) > len(tail) - len(last):
            return s
    return None


def truncate_at_stop(text: str, stop: str) -> str:
    idx = text.find(stop)
    return text if idx < 0 else text[:idx]
