"""What `Engine.generate` returns: vLLM-shaped request and completion outputs."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class CompletionOutput:
    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    text: str | None = None
    policy_versions: list[int] = field(default_factory=list)
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    # With ``SamplingParams.logprobs=k``: per generated token, the k most likely (token_id, logprob) pairs,
    # descending, of the same distribution ``logprobs`` come from (``logprobs_mode``).
    top_logprobs: list[list[tuple[int, float]]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt: str | None = None
    finished: bool = False
    # With ``SamplingParams.prompt_logprobs=k`` (and from ``Engine.score``): each prompt token's logprob given
    # the tokens before it (the first is None), and per token its k most likely alternatives (None when k = 0).
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None
    # Prompt tokens whose KV came from the prefix cache at the request's first scheduling (vLLM's name)
    num_cached_tokens: int = 0
