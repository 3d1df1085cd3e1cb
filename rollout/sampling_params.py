"""Sampling parameters, with vLLM's field names so users can move over without relearning."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

LOGPROBS_MODES = ("policy", "processed", "raw")
# Bounds on what one request may ask for, so nothing overflows int64 (or int32) inside a step; the engine
# further bounds top_k and stop_token_ids by its vocabulary and max_tokens by max_model_len.
MAX_INT32 = (1 << 31) - 1
MAX_N = 1 << 16
MAX_SEED = 1 << 64  # exclusive
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 512  # per stop string: the stop check detokenizes that many trailing tokens per token
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGPROBS = 20  # top alternatives per token (vLLM's default max_logprobs)


@dataclass(slots=True)
class SamplingParams:
    """How to sample one request.

    ``logprobs_mode`` decides which log-probability comes back with each token:
    ``policy`` (default) is log softmax(logits / T) over the whole vocabulary in float32, the
    number an RL trainer recomputes; ``processed`` is the log-probability under the distribution
    actually sampled from (after top-k / top-p / min-p); ``raw`` uses T = 1. Greedy uses T = 1.

    Penalties (vLLM's): ``repetition_penalty`` divides positive / multiplies negative logits of tokens seen
    in the prompt or output; ``presence_penalty`` and ``frequency_penalty`` subtract per output token seen /
    per occurrence. They act on the logits before temperature; ``raw`` logprobs stay the model's own.
    ``logprobs=k`` adds the k most likely tokens per generated token (of the distribution ``logprobs_mode``
    names); ``prompt_logprobs=k`` scores every prompt token under that same distribution, plus k alternatives.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: int = 16
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    stop: list[str] | str | None = None
    ignore_eos: bool = False
    seed: int | None = None
    logprobs_mode: str = "policy"
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None  # top alternatives per generated token (the sampled token's logprob always comes)
    prompt_logprobs: int | None = None  # each prompt token's logprob, plus that many alternatives
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: int | None = None  # keep only the last k prompt tokens
    stop_set: frozenset[int] = field(default=frozenset(), init=False, repr=False)
    has_penalties: bool = field(default=False, init=False, repr=False)  # set by validate (read every step)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Refuse values a user can get wrong, naming the value and the allowed range."""
        _check_int("n", self.n, 1, MAX_N)
        _check_num("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        _check_num("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k, -1, MAX_INT32, "-1 or 0 (off) or an int in [1, vocab_size]")
        _check_num("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        _check_int("max_tokens", self.max_tokens, 1, MAX_INT32)
        _check_int("min_tokens", self.min_tokens, 0, MAX_INT32)
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"
            )
        if self.seed is not None:
            _check_int("seed", self.seed, 0, MAX_SEED - 1, "an int in [0, 2**64) or None")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {self.logprobs_mode!r}")
        _check_num("repetition_penalty", self.repetition_penalty)
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_num(name, value)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2] (0 = off), got {value}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value, 0, MAX_LOGPROBS, f"None or an int in [0, {MAX_LOGPROBS}]")
        for name in ("skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output",
                     "ignore_eos"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.truncate_prompt_tokens is not None:
            _check_int("truncate_prompt_tokens", self.truncate_prompt_tokens, 1, MAX_INT32,
                       f"None or an int in [1, {MAX_INT32}]")
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, (list, tuple)):
                raise TypeError(f"stop_token_ids must be a list of ints, got {type(self.stop_token_ids).__name__}")
            if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
                raise ValueError(f"stop_token_ids has {len(self.stop_token_ids)} entries; allowed: at most "
                                 f"{MAX_STOP_TOKEN_IDS}")
            for t in self.stop_token_ids:
                _check_int("stop_token_ids entry", t, 0, MAX_INT32, "an int in [0, vocab_size)")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None:
            if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) and s for s in self.stop):
                raise TypeError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
            if len(self.stop) > MAX_STOP_STRINGS:
                raise ValueError(f"stop has {len(self.stop)} strings; allowed: at most {MAX_STOP_STRINGS}")
            longest = max((len(s) for s in self.stop), default=0)
            if longest > MAX_STOP_CHARS:
                raise ValueError(f"a stop string has {longest} characters; allowed: at most {MAX_STOP_CHARS}")
        self.stop_set = frozenset(self.stop_token_ids or ())
        self.has_penalties = (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                              or self.frequency_penalty != 0.0)

    def check_vocab(self, vocab_size: int) -> None:
        """The bounds that depend on the model: ``top_k`` and ``stop_token_ids`` within its vocabulary."""
        if self.top_k > vocab_size:
            raise ValueError(f"top_k={self.top_k} is out of range; allowed: -1 or 0 (off) or an int in "
                             f"[1, {vocab_size}] (the vocabulary size)")
        for t in self.stop_token_ids or ():
            if t >= vocab_size:
                raise ValueError(f"stop_token_ids entry {t} is outside the vocabulary; allowed: [0, {vocab_size})")

    @property
    def num_top_logprobs(self) -> int:
        """Alternatives per generated token (0: only the sampled token's logprob)."""
        return self.logprobs or 0

    @property
    def effective_top_k(self) -> int:
        """0 means off; vLLM's -1 is accepted and normalised."""
        return 0 if self.top_k in (0, -1) else self.top_k


def _check_int(name: str, value: object, lo: int, hi: int, allowed: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if not lo <= value <= hi:
        raise ValueError(f"{name}={value} is out of range; allowed: {allowed or f'an int in [{lo}, {hi}]'}")


def _check_num(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}")
