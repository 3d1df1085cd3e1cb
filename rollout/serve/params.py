"""A request's ``SamplingParams``: the server's ``sampling`` group fills omitted fields, vLLM's extras map
onto the engine's fields of the same names, and what the engine cannot honour is a 400 naming the field.

The extras (penalties, top alternatives, prompt logprobs, detokenisation switches) are passed only when a
request sets them away from their defaults, so an engine without one of them refuses exactly the requests
that need it (400 naming the field) and serves every other request unchanged.
"""

from __future__ import annotations

import re
from typing import Any

from rollout.sampling_params import SamplingParams
from rollout.serve.errors import APIError
from rollout.serve.protocol import ChatCompletionRequest, CompletionRequest, _Sampling
from rollout.settings.schema import SamplingConfig

MAX_LOGPROBS = 20  # alternatives per token, as OpenAI caps top_logprobs
# engine field -> its default: passed on only when the request moves it
ENGINE_EXTRAS = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                 "skip_special_tokens": True, "spaces_between_special_tokens": True,
                 "include_stop_str_in_output": False, "logprobs": None, "prompt_logprobs": None}
_REFUSED = ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
            "structural_tag", "allowed_token_ids", "logits_processors", "prompt_embeds", "suffix")


def refuse_unsupported(req: _Sampling) -> None:
    """400 naming the first field whose value the engine cannot honour (vLLM would change the output)."""
    for key in _REFUSED:
        value = getattr(req, key, None)
        if value not in (None, [], {}, ""):
            raise APIError(400, f"{key} is not supported by the rollout engine (no constrained decoding); "
                                "leave it out", param=key)
    if req.logit_bias:
        raise APIError(400, f"logit_bias={req.logit_bias!r} is not supported by the rollout engine; leave it out",
                       param="logit_bias")
    if req.bad_words:
        raise APIError(400, "bad_words is not supported by the rollout engine; leave it out", param="bad_words")
    if req.use_beam_search:
        raise APIError(400, "use_beam_search=true is not supported (sampling only); leave it out",
                       param="use_beam_search")
    if req.best_of is not None and req.best_of != (req.n or 1):
        raise APIError(400, f"best_of={req.best_of} is not supported (no best-of selection); allowed: equal to n "
                            "(or leave it out)", param="best_of")
    fmt = req.response_format
    if fmt is not None and fmt.get("type") != "text":
        raise APIError(400, f"response_format type {fmt.get('type')!r} is not supported (no constrained decoding); "
                            "allowed: {'type': 'text'}", param="response_format")
    _check_counts(req)
    if isinstance(req, ChatCompletionRequest):
        if req.max_tokens is not None and req.max_completion_tokens is not None:
            raise APIError(400, "give max_tokens or max_completion_tokens, not both", param="max_completion_tokens")
        choice = req.tool_choice
        if isinstance(choice, str) and choice not in ("none", "auto", "required"):
            raise APIError(400, f"tool_choice={choice!r} is not supported; allowed: 'none', 'auto', 'required' or "
                                "{'type': 'function', 'function': {'name': ...}}", param="tool_choice")
        if choice not in (None, "none") and not req.tools:
            raise APIError(400, f"tool_choice={choice!r} needs tools", param="tool_choice")
        if isinstance(choice, dict):
            name = (choice.get("function") or {}).get("name")
            if name not in {(t.get("function") or {}).get("name") for t in req.tools or ()}:
                raise APIError(400, f"tool_choice names function {name!r}, which is not among the tools",
                               param="tool_choice")


def _check_counts(req: _Sampling) -> None:
    for key in ("logprobs", "top_logprobs", "prompt_logprobs"):
        value = getattr(req, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and not 0 <= value <= MAX_LOGPROBS:
            raise APIError(400, f"{key}={value} is out of range; allowed: 0 .. {MAX_LOGPROBS} (or null)", param=key)


def num_logprobs(req: _Sampling) -> int | None:
    """Top alternatives per generated token the request asks for (None = no logprobs at all)."""
    if isinstance(req, CompletionRequest):
        return req.logprobs
    if isinstance(req, ChatCompletionRequest) and req.logprobs:
        return req.top_logprobs or 0
    return None


def prompt_logprobs(req: _Sampling) -> int | None:
    """vLLM's rule: ``echo`` with ``logprobs`` scores the prompt too, with as many alternatives."""
    if req.prompt_logprobs is not None:
        return req.prompt_logprobs
    if isinstance(req, CompletionRequest) and req.echo and req.logprobs is not None:
        return req.logprobs
    return None


def to_sampling_params(req: _Sampling, defaults: SamplingConfig, max_n: int, max_tokens: int | None = None
                       ) -> SamplingParams:
    """The request's SamplingParams (server defaults for omitted fields); bad values -> 400 naming them."""
    refuse_unsupported(req)
    pick = lambda value, default: default if value is None else value
    n = pick(req.n, 1)
    if isinstance(n, int) and n > max_n:
        raise APIError(400, f"n={n} is too large; allowed: 1 .. {max_n} (server.max_n)", param="n")
    k = num_logprobs(req)
    extras = {"repetition_penalty": req.repetition_penalty, "presence_penalty": req.presence_penalty,
              "frequency_penalty": req.frequency_penalty, "skip_special_tokens": req.skip_special_tokens,
              "spaces_between_special_tokens": req.spaces_between_special_tokens,
              "include_stop_str_in_output": req.include_stop_str_in_output,
              "logprobs": k or None, "prompt_logprobs": prompt_logprobs(req)}
    base = dict(
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
    return make_params(base, extras)


def make_params(base: dict[str, Any], extras: dict[str, Any]) -> SamplingParams:
    """``SamplingParams(**base)`` plus the ``ENGINE_EXTRAS`` a request moved from their defaults; 400 naming
    the field the engine refuses (or, on an engine without it, does not have)."""
    moved = {key: v for key, v in extras.items() if v is not None and v != ENGINE_EXTRAS[key]}
    if extras.get("prompt_logprobs") == 0:  # prompt logprobs without alternatives: still asked for
        moved["prompt_logprobs"] = 0
    try:
        return SamplingParams(**base, **moved)
    except TypeError as e:
        if (m := re.search(r"unexpected keyword argument '(\w+)'", str(e))) is not None and m.group(1) in moved:
            key = m.group(1)
            raise APIError(400, f"{key}={moved[key]!r} is not supported by this engine build; allowed: "
                                f"{ENGINE_EXTRAS[key]!r} (or leave it out)", param=key) from None
        raise APIError(400, str(e)) from None
    except ValueError as e:
        raise APIError(400, str(e)) from None
