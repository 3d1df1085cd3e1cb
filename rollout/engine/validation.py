"""Check user input before anything is queued: bad input raises and the engine is unchanged."""

from __future__ import annotations

from collections.abc import Sequence as Seq

from rollout.sampling_params import SamplingParams


def normalize_prompts(prompts: object) -> list:
    """What every ``generate`` accepts: one str, or a list / tuple of prompts (str or token-id lists)."""
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts must be a list of str or of token-id lists, got {type(prompts).__name__}")
    return list(prompts)


def normalize_params(sampling_params: object, num_prompts: int) -> list[SamplingParams]:
    if sampling_params is None:
        sampling_params = SamplingParams()
    if isinstance(sampling_params, SamplingParams):
        sampling_params.validate()
        return [sampling_params] * num_prompts
    if not isinstance(sampling_params, (list, tuple)):
        raise TypeError(
            f"sampling_params must be a SamplingParams or a list of them, got {type(sampling_params).__name__}"
        )
    if len(sampling_params) != num_prompts:
        raise ValueError(
            f"got {len(sampling_params)} sampling params for {num_prompts} prompts; pass one, or one per prompt"
        )
    for i, p in enumerate(sampling_params):
        if not isinstance(p, SamplingParams):
            raise TypeError(f"sampling_params[{i}] must be a SamplingParams, got {type(p).__name__}")
        p.validate()
    return list(sampling_params)


def to_token_ids(prompt: object, tokenizer: object | None, vocab_size: int) -> list[int]:
    """A prompt as token ids: a str needs a tokenizer; ids must be ints in [0, vocab_size)."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("string prompts need a tokenizer (none found with the model); pass token ids instead")
        if not prompt:
            raise ValueError("prompt is empty")
        ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]  # type: ignore[operator]
    elif isinstance(prompt, Seq) and not isinstance(prompt, (bytes, bytearray)):
        ids = list(prompt)
    elif hasattr(prompt, "tolist"):
        ids = prompt.tolist()  # a tensor or array of ids
    else:
        raise TypeError(f"a prompt must be a str or a list of token ids, got {type(prompt).__name__}")
    if not ids:
        raise ValueError("prompt is empty: give at least one token")
    if set(map(type, ids)) == {int} and 0 <= min(ids) and max(ids) < vocab_size:
        return ids  # the common case in C-level passes (a 4K prompt: ~10x faster than the loop below)
    for i, t in enumerate(ids):  # name the first bad token
        if isinstance(t, bool) or not isinstance(t, int):
            raise TypeError(f"prompt token {i} is {t!r} ({type(t).__name__}); token ids must be ints")
        if not 0 <= t < vocab_size:
            raise ValueError(f"prompt token {i} is {t}, outside the vocabulary [0, {vocab_size})")
    return ids


def check_request_id(request_id: object) -> str:
    if not isinstance(request_id, str) or not request_id:
        raise TypeError(f"request_id must be a non-empty str or None, got {request_id!r}")
    return request_id


def check_lengths(num_prompt: int, params: SamplingParams, max_model_len: int, max_kv_tokens: int,
                  vocab_size: int) -> None:
    """The request fits the model: prompt + max_tokens within both limits, top_k and stop ids within the vocab."""
    params.check_vocab(vocab_size)
    if num_prompt >= max_model_len:
        raise ValueError(f"prompt has {num_prompt} tokens; max_model_len is {max_model_len} (prompt must be shorter)")
    total = num_prompt + params.max_tokens
    if total > max_model_len:
        raise ValueError(
            f"prompt ({num_prompt} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds "
            f"max_model_len {max_model_len}"
        )
    if total > max_kv_tokens:
        raise ValueError(
            f"prompt + max_tokens = {total} tokens cannot fit the KV cache ({max_kv_tokens} tokens); "
            "raise num_blocks or lower max_tokens"
        )


def check_priority(priority: object) -> int:
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise TypeError(f"priority must be an int (lower is scheduled first), got {priority!r}")
    if not -(1 << 63) <= priority < (1 << 63):
        raise ValueError(f"priority={priority} is out of range; allowed: an int in [-2**63, 2**63)")
    return priority


def check_features(params: SamplingParams, tensor_parallel: bool) -> None:
    """What this engine cannot do for a request, refused before it is queued (naming the field)."""
    if tensor_parallel:
        for name, off in (("repetition_penalty", 1.0), ("presence_penalty", 0.0), ("frequency_penalty", 0.0)):
            if getattr(params, name) != off:
                raise ValueError(f"{name}={getattr(params, name)} is not supported with tensor_parallel_size > 1; "
                                 f"allowed: {off} (off)")
        if params.logprobs:
            raise ValueError(f"logprobs={params.logprobs} is not supported with tensor_parallel_size > 1; "
                             "allowed: None or 0 (the sampled token's logprob always comes back)")
        if params.prompt_logprobs is not None:
            raise ValueError(f"prompt_logprobs={params.prompt_logprobs} (and scoring) is not supported with "
                             "tensor_parallel_size > 1; allowed: None")

