"""Request bodies in OpenAI / vLLM shape, checked by pydantic (unknown fields and wrong types refused).

Fields a client library sends by default are accepted; ones whose non-default value the engine cannot
honour (penalties, ``echo``, top alternatives in ``logprobs``...) are refused with 400 naming the field,
rather than silently ignored. ``to_sampling_params`` maps a request onto ``SamplingParams`` with the
server's ``sampling`` group as the defaults for omitted fields.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rollout.sampling_params import SamplingParams
from rollout.serve.errors import APIError
from rollout.settings.schema import SamplingConfig


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Sampling(_Strict):
    """Fields shared by completions and chat: vLLM's SamplingParams names plus OpenAI's."""

    model: str | None = None
    n: int | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    logprobs_mode: Literal["policy", "processed", "raw"] | None = None
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Accepted at their defaults only (refused otherwise: the engine cannot honour them).
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    best_of: int | None = None
    skip_special_tokens: bool | None = None

    def refuse_unsupported(self) -> None:
        defaults = {"frequency_penalty": (None, 0, 0.0), "presence_penalty": (None, 0, 0.0),
                    "repetition_penalty": (None, 1, 1.0), "logit_bias": (None, {}), "skip_special_tokens": (None, True)}
        for key, allowed in defaults.items():
            if getattr(self, key) not in allowed:
                raise APIError(400, f"{key}={getattr(self, key)!r} is not supported by the rollout engine; "
                                    f"allowed: {allowed[1]!r} (or leave it out)", param=key)
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise APIError(400, f"best_of={self.best_of} is not supported; allowed: equal to n (or leave it out)",
                           param="best_of")


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None  # 0 = the sampled token's logprob (the only one the engine returns)
    echo: bool = False
    suffix: str | None = None
    prompt_logprobs: int | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.logprobs is not None and self.logprobs != 0:
            raise APIError(400, f"logprobs={self.logprobs} asks for top alternatives, which the engine does not "
                                "return; allowed: 0 (the sampled token's logprob) or null", param="logprobs")
        for key, bad in (("echo", self.echo), ("suffix", self.suffix), ("prompt_logprobs", self.prompt_logprobs)):
            if bad not in (None, False):
                raise APIError(400, f"{key}={bad!r} is not supported; leave it out", param=key)

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise APIError(400, "prompt is empty: give a string, a list of strings or token ids", param="prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_calls, tool_call_id...: the template may use them
    role: str
    content: str | list[ContentPart] | None = None

    def as_template_dict(self) -> dict[str, Any]:
        d = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            bad = [p.type for p in self.content if p.type != "text"]
            if bad:
                raise APIError(400, f"message content of type {bad[0]!r} is not supported; allowed: 'text'",
                               param="messages")
            d["content"] = "".join(p.text or "" for p in self.content)
        return d


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.top_logprobs not in (None, 0):
            raise APIError(400, f"top_logprobs={self.top_logprobs} asks for top alternatives, which the engine "
                                "does not return; allowed: 0 or null", param="top_logprobs")
        if self.tool_choice not in (None, "none"):
            raise APIError(400, f"tool_choice={self.tool_choice!r} is not supported (tool calls are not parsed); "
                                "allowed: 'none' (the tools are still rendered into the prompt)", param="tool_choice")
        if self.response_format not in (None, {"type": "text"}):
            raise APIError(400, "response_format other than {'type': 'text'} is not supported",
                           param="response_format")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise APIError(400, "give max_tokens or max_completion_tokens, not both", param="max_completion_tokens")


def to_sampling_params(req: _Sampling, defaults: SamplingConfig, max_n: int, max_tokens: int | None = None
                       ) -> SamplingParams:
    """The request's SamplingParams (server defaults for omitted fields); bad values -> 400 naming them."""
    req.refuse_unsupported()
    pick = lambda value, default: default if value is None else value
    n = pick(req.n, 1)
    if isinstance(n, int) and n > max_n:
        raise APIError(400, f"n={n} is too large; allowed: 1 .. {max_n} (server.max_n)", param="n")
    try:
        return SamplingParams(
            n=n,
            temperature=float(pick(req.temperature, defaults.temperature)),
            top_p=float(pick(req.top_p, defaults.top_p)),
            top_k=pick(req.top_k, defaults.top_k),
            min_p=float(pick(req.min_p, defaults.min_p)),
            max_tokens=pick(max_tokens if max_tokens is not None else req.max_tokens, defaults.max_tokens),
            min_tokens=pick(req.min_tokens, defaults.min_tokens),
            stop=pick(req.stop, list(defaults.stop) or None),
            stop_token_ids=req.stop_token_ids,
            ignore_eos=pick(req.ignore_eos, defaults.ignore_eos),
            seed=pick(req.seed, defaults.seed),
            logprobs_mode=pick(req.logprobs_mode, defaults.logprobs_mode),
        )
    except (TypeError, ValueError) as e:
        raise APIError(400, str(e)) from None


class InitWeightTransfer(_Strict):
    """``/init_weight_transfer``: join the trainer's group (vLLM's ``init_info`` fields)."""

    master_address: str = Field(max_length=255)
    master_port: int = Field(ge=1, le=65535)
    world_size: int = Field(2, ge=2, le=1024)
    rank_offset: int = Field(1, ge=1, le=1023)
    backend: Literal["nccl", "gloo"] | None = None  # None = nccl for a CUDA engine, else gloo
    timeout_s: float = Field(600.0, gt=0)  # capped at server.max_weight_timeout_s
    packed: bool = True


class UpdateWeights(_Strict):
    """``/update_weights``: the metadata of one push (vLLM's ``update_info`` fields plus ours)."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    packed: bool = True
    bucket_bytes: int = 1 << 30
    push_id: int | None = None
    version: int | None = None
    recompute_running: bool = True
    is_checkpoint_format: bool = True


class UpdateWeightsFromDisk(_Strict):
    path: str = Field(min_length=1, max_length=4096)
    version: int | None = None
    recompute_running: bool = True
