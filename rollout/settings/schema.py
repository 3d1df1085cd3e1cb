"""The config schema every entry point shares: frozen dataclasses mirrored one-to-one by the Hydra groups in
conf/ (engine: rollout/config.py's EngineConfig), and ``parse_section``, which builds one from a plain dict.

Hydra stays in scripts/: they hand a resolved dict to ``parse_section`` (or ``RunConfig.from_dict``). Every
user error is a ValueError naming the key, the value and what is allowed, raised before anything is loaded.
The main job adds its ``rollout`` section (rollout/job/config.py), the server its ``server`` section.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from rollout.config import EngineConfig
from rollout.sampling_params import LOGPROBS_MODES, MAX_INT32, SamplingParams
from rollout.settings.checks import (
    check_bool,
    check_choice,
    check_device,
    check_int,
    check_num,
    check_opt_str,
    check_str,
    check_typed_fields,
    fail,
)

DTYPES = ("auto", "bfloat16", "float16", "float32")
WANDB_MODES = ("online", "offline", "disabled")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    path: str | None = None  # Hugging Face checkpoint dir; None = the embedded tiny Llama (random init)
    tokenizer: str | None = None  # tokenizer dir; None = the checkpoint's own tokenizer files
    dtype: str = "auto"
    device: str | None = None  # None = cuda if available else cpu
    seed: int = 0  # init seed of the embedded default's random weights
    cache_dir: str | None = None  # where the default's weights go; None = $ROLLOUT_CACHE or ~/.cache/rollout

    def __post_init__(self) -> None:
        check_opt_str("model.path", self.path)
        check_opt_str("model.tokenizer", self.tokenizer)
        check_choice("model.dtype", self.dtype, DTYPES)
        check_device("model.device", self.device)
        check_int("model.seed", self.seed, lo=0)
        check_opt_str("model.cache_dir", self.cache_dir)


@dataclass(frozen=True, slots=True)
class SamplingConfig:
    n: int = 4  # samples per prompt, generated as one request so the group shares its prompt's KV blocks
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: int = 32
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    logprobs_mode: str = "policy"

    def __post_init__(self) -> None:
        check_int("sampling.n", self.n, lo=1)
        check_num("sampling.temperature", self.temperature, lo=0.0, allowed="a number >= 0 (0 = greedy)")
        check_num("sampling.top_p", self.top_p, lo=0.0, hi=1.0, lo_open=True, allowed="a number in (0, 1]")
        check_int("sampling.top_k", self.top_k, -1, MAX_INT32, "0 or -1 (off) or an int in [1, vocab_size]")
        check_num("sampling.min_p", self.min_p, lo=0.0, hi=1.0, allowed="a number in [0, 1]")
        check_int("sampling.max_tokens", self.max_tokens, lo=1)
        check_int("sampling.min_tokens", self.min_tokens, 0, self.max_tokens, "an int in [0, max_tokens]")
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) and s for s in self.stop):
            fail("sampling.stop", self.stop, "a list of non-empty strings")
        check_bool("sampling.ignore_eos", self.ignore_eos)
        if self.seed is not None:
            check_int("sampling.seed", self.seed, 0, 2**64 - 1, "an int in [0, 2**64) or null")
        check_choice("sampling.logprobs_mode", self.logprobs_mode, LOGPROBS_MODES)

    def to_params(self) -> SamplingParams:
        return SamplingParams(
            n=self.n,
            temperature=float(self.temperature),
            top_p=float(self.top_p),
            top_k=self.top_k,
            min_p=float(self.min_p),
            max_tokens=self.max_tokens,
            min_tokens=self.min_tokens,
            stop=list(self.stop) or None,
            ignore_eos=self.ignore_eos,
            seed=self.seed,
            logprobs_mode=self.logprobs_mode,
        )


@dataclass(frozen=True, slots=True)
class DataConfig:
    path: str | None = None  # local .json/.jsonl/.parquet file or a dataset name; None = embedded arithmetic
    name: str | None = None  # the dataset's configuration (subset) name, for hub datasets
    split: str = "train"
    prompt_field: str = "prompt"  # a string, or a list of {role, content} messages
    answer_field: str | None = "answer"  # what the reward compares against; None = no answers
    num_prompts: int = 8  # prompts per round; the dataset wraps around when exhausted
    apply_chat_template: bool | str = (
        "auto"  # for plain strings: true, false, "auto" (if the tokenizer has one)
    )
    shuffle: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        check_opt_str("data.path", self.path)
        check_opt_str("data.name", self.name)
        check_str("data.split", self.split)
        check_str("data.prompt_field", self.prompt_field)
        check_opt_str("data.answer_field", self.answer_field)
        check_int("data.num_prompts", self.num_prompts, lo=1)
        if not (isinstance(self.apply_chat_template, bool) or self.apply_chat_template == "auto"):
            fail("data.apply_chat_template", self.apply_chat_template, "one of true, false, 'auto'")
        check_bool("data.shuffle", self.shuffle)
        check_int("data.seed", self.seed, lo=0)


def check_partial_keys(cfg: Any, partial: bool) -> None:
    """The partial-rollout keys of ``rollout`` (``max_inflight_groups``, ``max_staleness``, ``stale_groups``,
    ``recompute_running``), shared by the main job's and the training script's config: valid values, and the
    two counts left null outside partial mode."""
    if cfg.max_inflight_groups is not None:
        check_int("rollout.max_inflight_groups", cfg.max_inflight_groups, lo=1, allowed="an int >= 1 or null")
    if cfg.max_staleness is not None:
        check_int("rollout.max_staleness", cfg.max_staleness, lo=0, allowed="an int >= 0 or null")
    check_choice("rollout.stale_groups", cfg.stale_groups, ("drop", "regenerate"))
    check_bool("rollout.recompute_running", cfg.recompute_running)
    for key in ("max_inflight_groups", "max_staleness"):
        if not partial and getattr(cfg, key) is not None:
            fail(f"rollout.{key}", getattr(cfg, key), f"null with rollout.mode={cfg.mode} (it is partial mode's)")


@dataclass(frozen=True, slots=True)
class WandbConfig:
    mode: str = "offline"  # offline needs no network or API key; the run dir lands under output_dir
    project: str = "rollout"
    entity: str | None = None
    name: str | None = None
    group: str | None = None
    tags: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        check_choice("logger.wandb.mode", self.mode, WANDB_MODES)
        check_str("logger.wandb.project", self.project)
        for key in ("entity", "name", "group"):
            check_opt_str(f"logger.wandb.{key}", getattr(self, key))
        if not isinstance(self.tags, tuple) or not all(isinstance(t, str) for t in self.tags):
            fail("logger.wandb.tags", self.tags, "a list of strings")


@dataclass(frozen=True, slots=True)
class LoggerConfig:
    log_every_steps: int = 16  # engine steps between step-level metrics (running requests, tokens/s)
    progress: bool = True  # tqdm bar per round
    wandb: WandbConfig = field(default_factory=WandbConfig)

    def __post_init__(self) -> None:
        check_int("logger.log_every_steps", self.log_every_steps, lo=1)
        check_bool("logger.progress", self.progress)


@dataclass(frozen=True, slots=True)
class PoolConfig:
    replicas: int = 1  # 1 = the in-process engine (no Ray); more = a RolloutPool of Ray actors
    address: str = "local"  # local = start Ray on this machine; else a Ray cluster address to join
    gpus_per_replica: float = 1  # GPUs each replica's actor reserves (0 on a CPU-only machine)
    colocate_with_trainer: bool = False  # replica 0 on the trainer's GPU (veRL's hybrid engine), weights by CUDA IPC

    def __post_init__(self) -> None:
        check_int("pool.replicas", self.replicas, lo=1)
        check_str("pool.address", self.address)
        if isinstance(self.gpus_per_replica, bool) or not isinstance(self.gpus_per_replica, (int, float)) \
                or self.gpus_per_replica < 0:
            fail("pool.gpus_per_replica", self.gpus_per_replica, "a number >= 0")
        check_bool("pool.colocate_with_trainer", self.colocate_with_trainer)
        if self.colocate_with_trainer and self.replicas < 2:
            fail("pool.colocate_with_trainer", True, "false with pool.replicas=1 (that one engine runs in the "
                 "trainer's process already, without Ray; co-locating needs pool.replicas >= 2)")
        if self.colocate_with_trainer and self.gpus_per_replica > 1:
            fail("pool.colocate_with_trainer", True, f"false with pool.gpus_per_replica={self.gpus_per_replica} "
                 "(a co-located replica holds one GPU: the trainer's)")


@dataclass(frozen=True, slots=True)
class RunConfig:
    """What every run that writes output shares (the main job, the training scripts): output_dir and groups."""

    output_dir: str
    model: ModelConfig = field(default_factory=ModelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    pool: PoolConfig = field(default_factory=PoolConfig)

    def __post_init__(self) -> None:
        check_str("output_dir", self.output_dir)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> Any:
        """Build from a plain (resolved) dict such as ``OmegaConf.to_container(cfg, resolve=True)``."""
        if isinstance(raw, Mapping) and "output_dir" not in raw:
            raise ValueError("output_dir is missing: it is required (trajectories and metrics go there)")
        return parse_section(cls, "", raw)

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe nested dict (tuples become lists); ``from_dict(to_dict())`` round-trips."""
        return json.loads(json.dumps(dataclasses.asdict(self)))


def parse_section(cls: type, prefix: str, raw: object) -> Any:
    """``cls`` (a config dataclass) from the plain mapping ``raw`` at ``prefix`` ("" = the whole config).

    Unknown keys are refused with the allowed ones; a null section is its defaults; a field whose default is a
    config dataclass is parsed the same way (``logger.wandb``, the top level's groups); YAML lists become
    tuples so the frozen config stays hashable. EngineConfig's values are type-checked first (its own checks
    are for Python callers: ``async_mode=maybe`` must not pass as true), its errors prefixed with ``engine.``.
    """
    where = prefix or "the config"
    raw = {} if raw is None else raw
    if not isinstance(raw, Mapping):
        raise ValueError(f"{where} must be a mapping, got {raw!r}")
    allowed = {f.name: f for f in fields(cls)}
    unknown = sorted(set(raw) - set(allowed))
    if unknown:
        dotted = [f"{prefix}.{k}" if prefix else str(k) for k in unknown]
        raise ValueError(f"unknown key(s) {dotted} in {where}; allowed: {sorted(allowed)}")
    values = dict(raw)
    for key, value in values.items():
        sub = allowed[key].default_factory
        if isinstance(sub, type) and dataclasses.is_dataclass(sub):
            values[key] = parse_section(sub, f"{prefix}.{key}" if prefix else key, value or {})
        elif isinstance(value, list) and cls is not EngineConfig:
            values[key] = tuple(value)
    if cls is not EngineConfig:
        return cls(**values)
    check_typed_fields(prefix, EngineConfig, values)
    try:
        return EngineConfig.from_options(**values)
    except (TypeError, ValueError) as e:  # EngineConfig names the field and the range; add the group
        raise ValueError(f"{prefix}.{e}") from None
