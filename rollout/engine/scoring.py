"""``Engine.score``'s input checks: token sequences and the distribution they are scored under.

Scoring is a request that computes its prompt and samples nothing (``Sequence.score_only``), asking for
the logprob of every prompt token from ``logprob_start_len`` on (``prompt_logprobs``); the engine runs
it through the same scheduler, prefill and kernels as generation.
"""

from __future__ import annotations

import dataclasses

from rollout.engine.validation import check_features, normalize_params, normalize_prompts, to_token_ids
from rollout.sampling_params import SamplingParams


def prepare_score(sequences: object, logprob_start_len: object, top_logprobs: object,
                  sampling_params: SamplingParams | None, tokenizer: object | None, vocab_size: int,
                  max_model_len: int, max_kv_tokens: int,
                  tensor_parallel: bool) -> tuple[list[list[int]], SamplingParams]:
    """(token ids per sequence, the params every scoring request runs with); refuses bad input, naming it."""
    seqs = normalize_prompts(sequences)
    if isinstance(logprob_start_len, bool) or not isinstance(logprob_start_len, int) or logprob_start_len < 0:
        raise ValueError(f"logprob_start_len must be an int >= 0, got {logprob_start_len!r}")
    base = normalize_params(sampling_params, 1)[0]
    params = dataclasses.replace(base, n=1, max_tokens=1, min_tokens=0, logprobs=None,
                                 prompt_logprobs=top_logprobs or 0)  # checks top_logprobs as prompt_logprobs
    check_features(params, tensor_parallel)
    params.check_vocab(vocab_size)
    ids = []
    for i, seq in enumerate(seqs):
        try:
            x = to_token_ids(seq, tokenizer, vocab_size)
            if len(x) > max_model_len:
                raise ValueError(f"sequence has {len(x)} tokens; allowed: at most max_model_len {max_model_len}")
            if len(x) > max_kv_tokens:
                raise ValueError(f"sequence has {len(x)} tokens; the KV cache holds {max_kv_tokens}")
        except (ValueError, TypeError) as e:
            raise type(e)(f"sequence {i}: {e}") from None
        ids.append(x)
    return ids, params
