"""Request bodies in OpenAI / vLLM shape, checked by pydantic (unknown fields and wrong types refused).

Every field vLLM's ``CompletionRequest`` / ``ChatCompletionRequest`` accepts is accepted here, so a client
written for vLLM (SkyRL, prime-rl, AReaL, TRL...) sends its defaults unchanged. ``params.py`` maps them onto
``SamplingParams``: the ones the engine honours are passed on; ones without effect on the tokens (request
ids, cache salts, KV-transfer hints) are ignored, as vLLM ignores them where they do not apply; ones whose
non-default value the engine cannot honour (structured outputs, beam search, logit bias...) are refused with
a 400 naming the field.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


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
    return_tokens_as_token_ids: bool | None = False
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # honoured through the engine's SamplingParams (vLLM's names)
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=1)
    prompt_logprobs: int | None = None
    priority: int | None = None
    # accepted, without effect here (vLLM ignores them too where they do not apply)
    request_id: str | None = None
    cache_salt: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool | None = None
    length_penalty: float | None = None  # beam search only
    # refused unless at their defaults (params.refuse_unsupported names them)
    logit_bias: dict[str, float] | None = None
    best_of: int | None = None
    use_beam_search: bool | None = False
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    logits_processors: list[Any] | None = None
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    structural_tag: str | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None  # k alternatives per token besides the sampled one
    echo: bool | None = False
    suffix: str | None = None
    prompt_embeds: str | list[str] | None = None

    def prompts(self) -> list[str | list[int]]:
        from rollout.serve.errors import APIError

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
        from rollout.serve.errors import APIError

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
    logprobs: bool | None = False
    top_logprobs: int | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool | None = False  # vLLM: prepend the last message when it has the assistant's role
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    documents: list[dict[str, Any]] | None = None
    reasoning_effort: str | None = None
    include_reasoning: bool | None = None
    # OpenAI fields a client library may send; no effect here
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    modalities: list[str] | None = None
    function_call: str | dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None


class InitWeightTransfer(_Strict):
    """``/init_weight_transfer``: join the trainer's group (vLLM's ``init_info`` fields)."""

    master_address: str = Field(max_length=255)
    master_port: int = Field(ge=1, le=65535)
    world_size: int = Field(2, ge=2, le=1024)
    rank_offset: int = Field(1, ge=1, le=1023)
    backend: Literal["nccl", "gloo"] | None = None  # None = nccl for a CUDA engine, else gloo
    timeout_s: float = Field(600.0, gt=0)  # capped at server.max_weight_timeout_s
    packed: bool = True
    packed_buffer_size_bytes: int = Field(1 << 30, ge=256)  # vLLM's packing (TRL's VLLMClient): both ends agree
    packed_num_buffers: int = Field(2, ge=1)


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
    """Ours (``path``, ``version``) or SGLang's (``model_path``, ``weight_version``...): the same update."""

    path: str | None = Field(None, min_length=1, max_length=4096)
    model_path: str | None = Field(None, min_length=1, max_length=4096)
    version: int | None = None
    weight_version: str | int | None = None
    recompute_running: bool = True
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    is_async: bool = False
    torch_empty_cache: bool = False
    keep_pause: bool = False
    token_step: int | None = None

    def where(self) -> str:
        from rollout.serve.errors import APIError

        if (self.path is None) == (self.model_path is None):
            raise APIError(400, "give exactly one of path and model_path", param="path")
        if self.load_format not in (None, "auto", "safetensors"):
            raise APIError(400, f"load_format={self.load_format!r} is not supported; allowed: 'auto' "
                                "(safetensors)", param="load_format")
        return self.path or self.model_path  # type: ignore[return-value]

    def new_version(self) -> int | None:
        from rollout.serve.errors import APIError

        v = self.version if self.version is not None else self.weight_version
        if v is None or isinstance(v, int):
            return v
        if isinstance(v, str) and v.isdigit():
            return int(v)
        raise APIError(400, f"weight_version={v!r} must be an integer: it becomes the policy version",
                       param="weight_version")
