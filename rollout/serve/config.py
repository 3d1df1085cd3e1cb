"""The server's configuration: the main job's model / engine / sampling groups plus ``server``.

Mirrored by rollout/conf/serve.yaml and rollout/conf/server/default.yaml; built from a plain dict so Hydra
stays in the entry points (rollout/cli). The sections and the parser are the shared ones
(``rollout.settings.schema``), so a key means (and is checked) the same everywhere.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rollout.config import EngineConfig
from rollout.serve.auth import check_sources
from rollout.settings.checks import check_bool, check_num, check_opt_str
from rollout.settings.checks import check_int as _int
from rollout.settings.checks import check_num as _num
from rollout.settings.checks import fail as _fail
from rollout.settings.schema import ModelConfig, SamplingConfig, parse_section

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


@dataclass(frozen=True, slots=True)
class ServerConfig:
    host: str = "127.0.0.1"  # loopback by default: nothing is exposed unless asked
    port: int = 8000  # 0 = a free port, printed at start-up
    served_model_name: str | None = None  # None = the checkpoint directory's name
    max_n: int | None = None  # largest n a request may ask for; None = engine.max_num_seqs
    max_body_mib: int = 64  # larger request bodies get 413
    torch_threads: int | None = 1  # as rollout.torch_threads: 1 is fastest for tiny CPU models
    log_level: str = "warning"
    log_stats_s: float = 5.0  # one stats line this often while busy (throughput, queue, KV, version); 0 = never
    # security (README "Security"): who may call, what the admin surface reaches
    api_key: str | None = None  # Bearer key for every route but GET /health; null = $ROLLOUT_API_KEY, else none
    admin: bool = True  # false: the weight, pause, sleep and reset routes do not exist (404)
    weight_sources: tuple[str, ...] = ("loopback", "client")  # master_address allowed: IPs, CIDRs, these two words
    max_weight_timeout_s: float = 120.0  # cap on a weight-transfer request's timeout_s (how long a join may block)
    weights_root: str | None = None  # /update_weights_from_disk reads only under this directory; null = anywhere
    allow_request_chat_template: bool = False  # a request's own chat_template (rendered sandboxed, time-limited)
    # caps: one request cannot flood the engine (400 naming the cap; 429 with Retry-After while full)
    max_prompts_per_request: int = 1024
    max_queued_sequences: int = 16384  # waiting + running sequences (prompts x n) the engine holds at most
    # Text work and connections: nothing a client sends can stall the event loop or hold resources unbounded.
    text_workers: int = 2  # threads that tokenize, render chat templates and detokenize (never the event loop)
    max_chars_per_token: int = 32  # a string prompt over max_model_len x this many characters is refused untokenized
    stream_buffer_tokens: int = 65536  # a stream whose reader falls this many tokens behind is aborted
    stream_interval_s: float = 0.1  # streams get their new tokens at most this often (0 = every engine step)
    max_connections: int = 1024  # open connections beyond this are closed at once (capped by the open-file limit)
    header_timeout_s: float = 10.0  # a request's head must arrive within this (slowloris guard)
    body_timeout_s: float = 60.0  # and its body within this after the head
    keep_alive_s: float = 30.0  # an idle keep-alive connection is closed after this
    max_header_kib: int = 16  # a larger request head is refused (h11's max incomplete event size)

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host:
            _fail("server.host", self.host, "a non-empty string")
        _int("server.port", self.port, lo=0, hi=65535, allowed="an int in [0, 65535] (0 = any free port)")
        if self.served_model_name is not None and (not isinstance(self.served_model_name, str)
                                                   or not self.served_model_name):
            _fail("server.served_model_name", self.served_model_name, "a non-empty string or null")
        if self.max_n is not None:
            _int("server.max_n", self.max_n, lo=1, allowed="an int >= 1 or null")
        _int("server.max_body_mib", self.max_body_mib, lo=1)
        if self.torch_threads is not None:
            _int("server.torch_threads", self.torch_threads, lo=1, allowed="an int >= 1 or null")
        if self.log_level not in LOG_LEVELS:
            _fail("server.log_level", self.log_level, f"one of {list(LOG_LEVELS)}")
        check_num("server.log_stats_s", self.log_stats_s, lo=0.0, allowed="a number of seconds >= 0 (0 = never)")
        check_opt_str("server.api_key", self.api_key)
        check_bool("server.admin", self.admin)
        check_bool("server.allow_request_chat_template", self.allow_request_chat_template)
        check_num("server.max_weight_timeout_s", self.max_weight_timeout_s, lo=1.0)
        check_opt_str("server.weights_root", self.weights_root)
        check_sources(self.weight_sources)
        _int("server.max_prompts_per_request", self.max_prompts_per_request, lo=1)
        _int("server.max_queued_sequences", self.max_queued_sequences, lo=1)
        for key in ("text_workers", "max_chars_per_token", "stream_buffer_tokens", "max_connections", "max_header_kib"):
            _int(f"server.{key}", getattr(self, key), lo=1)
        _num("server.stream_interval_s", self.stream_interval_s, lo=0, hi=60, allowed="seconds in [0, 60]")
        for key in ("header_timeout_s", "body_timeout_s", "keep_alive_s"):
            _num(f"server.{key}", getattr(self, key), lo=0, lo_open=True)


@dataclass(frozen=True, slots=True)
class ServeConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)  # defaults for fields a request omits
    server: ServerConfig = field(default_factory=ServerConfig)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> ServeConfig:
        return parse_section(cls, "", raw)
