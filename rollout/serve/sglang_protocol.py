"""Request bodies of SGLang's native API (``GenerateReqInput``, ``SamplingParams`` and the weight routes).

Field names and defaults are SGLang 0.5.x's. As on the OpenAI routes, a field the engine cannot honour at a
non-default value (constrained decoding, multimodal input, LoRA, hidden states...) is a 400 naming it.
"""

from __future__ import annotations

import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rollout.serve.errors import APIError
from rollout.settings.schema import SamplingConfig

# sglang.srt.sampling.sampling_params.SamplingParams -> how it maps: ours, an engine extra, ignored or refused
_OURS = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "temperature": "temperature",
         "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "stop": "stop", "stop_token_ids": "stop_token_ids",
         "ignore_eos": "ignore_eos", "n": "n", "sampling_seed": "seed"}
_EXTRAS = {"frequency_penalty": "frequency_penalty", "presence_penalty": "presence_penalty",
           "repetition_penalty": "repetition_penalty", "skip_special_tokens": "skip_special_tokens",
           "spaces_between_special_tokens": "spaces_between_special_tokens",
           "no_stop_trim": "include_stop_str_in_output"}
_IGNORED = ("stream_interval",)
_REFUSED = ("json_schema", "regex", "ebnf", "structural_tag", "stop_regex", "logit_bias", "custom_params")


def _check_keys(sp: dict[str, Any]) -> None:
    for key, value in sp.items():
        if key in _REFUSED:
            if value not in (None, {}, [], ""):
                raise APIError(400, f"sampling_params.{key} is not supported by the rollout engine (no constrained "
                                    "decoding or custom logits); leave it out", param=f"sampling_params.{key}")
        elif key not in _OURS and key not in _EXTRAS and key not in _IGNORED:
            known = sorted([*_OURS, *_EXTRAS, *_IGNORED])
            raise APIError(400, f"unknown sampling_params field {key!r}; allowed: {known}",
                           param=f"sampling_params.{key}")


def sampling_base(sp: dict[str, Any], defaults: SamplingConfig) -> dict[str, Any]:
    """SGLang's sampling_params as our ``SamplingParams`` keywords, the server's defaults for what is left out."""
    if not isinstance(sp, dict):
        raise APIError(400, f"sampling_params must be an object, got {type(sp).__name__}", param="sampling_params")
    _check_keys(sp)
    got = {ours: sp[theirs] for theirs, ours in _OURS.items() if sp.get(theirs) is not None}
    base = {"n": 1, "temperature": defaults.temperature, "top_p": defaults.top_p, "top_k": defaults.top_k,
            "min_p": defaults.min_p, "max_tokens": defaults.max_tokens, "min_tokens": defaults.min_tokens,
            "stop": list(defaults.stop) or None, "stop_token_ids": None, "ignore_eos": defaults.ignore_eos,
            "seed": defaults.seed, "logprobs_mode": defaults.logprobs_mode}
    base.update(got)
    for key in ("temperature", "top_p", "min_p"):
        if isinstance(base[key], int) and not isinstance(base[key], bool):
            base[key] = float(base[key])
    return base


def sampling_extras(sp: dict[str, Any], top: int | None, prompt_top: int | None) -> dict[str, Any]:
    extras = {ours: sp.get(theirs) for theirs, ours in _EXTRAS.items()}
    extras["logprobs"] = top
    extras["prompt_logprobs"] = prompt_top
    return extras


class GenerateRequest(BaseModel):
    """``POST /generate`` (sglang.srt.managers.io_struct.GenerateReqInput)."""

    model_config = ConfigDict(extra="forbid")
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    rid: str | list[str] | None = None
    return_logprob: bool = False
    logprob_start_len: int | None = -1  # -1: output logprobs only; k >= 0: the prompt's too, from position k
    top_logprobs_num: int = Field(0, ge=0, le=20)
    return_text_in_logprobs: bool = False
    stream: bool = False
    # accepted without effect
    log_metrics: bool | None = None
    modalities: list[str] | None = None
    session_params: dict[str, Any] | None = None
    bootstrap_host: Any = None
    bootstrap_port: Any = None
    bootstrap_room: Any = None
    data_parallel_rank: int | None = None
    priority: int | None = None
    no_logs: bool | None = None
    custom_labels: dict[str, Any] | None = None
    # refused unless left out
    input_embeds: Any = None
    image_data: Any = None
    video_data: Any = None
    audio_data: Any = None
    lora_path: Any = None
    lora_id: Any = None
    custom_logit_processor: Any = None
    token_ids_logprob: Any = None
    return_hidden_states: bool | None = None
    return_routed_experts: bool | None = None

    def prompts(self) -> tuple[list[str | list[int]], bool]:
        """The prompts, and whether the request was a single one (answered with an object, not a list)."""
        for key in ("input_embeds", "image_data", "video_data", "audio_data", "lora_path", "lora_id",
                    "custom_logit_processor", "token_ids_logprob", "return_hidden_states", "return_routed_experts"):
            if getattr(self, key) not in (None, False, [], ""):
                raise APIError(400, f"{key} is not supported by the rollout engine; leave it out", param=key)
        if (self.text is None) == (self.input_ids is None):
            raise APIError(400, "give exactly one of text and input_ids", param="text")
        if self.text is not None:
            return ([self.text], True) if isinstance(self.text, str) else (list(self.text), False)
        ids = self.input_ids or []
        if not ids:
            raise APIError(400, "input_ids is empty", param="input_ids")
        if all(isinstance(t, int) for t in ids):
            return [list(ids)], True  # type: ignore[arg-type]
        return [list(x) for x in ids], False  # type: ignore[union-attr]

    def rids(self, k: int) -> list[str]:
        if self.rid is None:
            return [uuid.uuid4().hex for _ in range(k)]
        rids = [self.rid] if isinstance(self.rid, str) else list(self.rid)
        if len(rids) != k or len(set(rids)) != k:
            raise APIError(400, f"rid must give one distinct id per prompt ({k})", param="rid")
        return rids


class InitGroup(BaseModel):
    """``/init_weights_update_group`` (slime's ``init_weights_update_group`` payload)."""

    model_config = ConfigDict(extra="forbid")
    master_address: str = Field(max_length=255)
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1, le=1023)
    world_size: int = Field(ge=2, le=1024)
    group_name: str = Field("weight_update_group", min_length=1, max_length=255)
    backend: Literal["nccl", "gloo"] | None = None


class DestroyGroup(BaseModel):
    model_config = ConfigDict(extra="forbid")
    group_name: str = "weight_update_group"


class PauseGeneration(BaseModel):
    model_config = ConfigDict(extra="forbid")
    mode: Literal["abort", "retract", "in_place"] = "abort"


class UpdateFromDistributed(BaseModel):
    """``/update_weights_from_distributed`` (slime's payload: dtypes as ``bfloat16``, without ``torch.``)."""

    model_config = ConfigDict(extra="forbid")
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    weight_version: str | int | None = None
    load_format: str | None = None
    abort_all_requests: bool = False

    def version(self) -> int | None:
        if self.load_format not in (None, "auto"):
            raise APIError(400, f"load_format={self.load_format!r} is not supported; allowed: null (one broadcast "
                                "per tensor, as slime sends them)", param="load_format")
        v = self.weight_version
        if v is None:
            return None
        if isinstance(v, int) or (isinstance(v, str) and v.isdigit()):
            return int(v)
        raise APIError(400, f"weight_version={v!r} must be an integer (as a string or a number): it becomes the "
                            "policy version", param="weight_version")
