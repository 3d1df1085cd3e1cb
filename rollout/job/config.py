"""The main job's configuration: frozen dataclasses mirrored one-to-one by the Hydra groups in rollout/conf/.

Built from a plain dict (``JobConfig.from_dict``) so Hydra stays in the entry points. Every user error is a
ValueError naming the key, the value and what is allowed, raised before anything is loaded.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from rollout.config import EngineConfig
from rollout.job.checks import (
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
from rollout.job.rewards import check_reward_spec
from rollout.sampling_params import LOGPROBS_MODES, SamplingParams

DTYPES = ("auto", "bfloat16", "float16", "float32")
WANDB_MODES = ("online", "offline", "disabled")
# Keys that may change between a run and its resume (where the output goes, how long, how it is logged).
RESUME_FREE_KEYS = (
    "output_dir",
    "rollout.rounds",
    "rollout.resume",
    "rollout.torch_threads",
    "model.cache_dir",
    "logger",
    "pool",
)


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
        check_int("sampling.top_k", self.top_k, lo=-1, allowed="an int >= 0 (0 or -1 = off)")
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
class RolloutConfig:
    rounds: int = 2
    resume: bool = False  # continue after the last complete round found in output_dir
    reward: str | None = "exact_match"  # None = no reward column
    # torch intra-op threads while the job runs; None = torch's default. Small CPU models run several
    # times faster on one thread (no OpenMP hand-offs per tiny op), hence 1 for the embedded default.
    torch_threads: int | None = 1
    # drain: a round waits for all its groups. partial: a round ends once num_prompts groups finished;
    # the rest keep running (and their KV) into the next round, under the weights that arrive meanwhile.
    mode: str = "drain"
    max_inflight_groups: int | None = None  # partial: groups kept in the engine; None = data.num_prompts
    max_staleness: int | None = None  # partial: max versions between a group's oldest token and the weights
    stale_groups: str = "drop"  # partial: what happens to a group over max_staleness: drop | regenerate
    recompute_running: bool = True  # partial: recompute carried-over KV under new weights (one prefill each)
    # A directory the trainer writes step_<N>/ snapshots into (HF safetensors + a COMPLETE marker); before
    # each round the newest unseen complete one is loaded and the round's tokens carry policy_version N.
    weights_from: str | None = None

    def __post_init__(self) -> None:
        check_int("rollout.rounds", self.rounds, lo=1)
        check_bool("rollout.resume", self.resume)
        if self.torch_threads is not None:
            check_int("rollout.torch_threads", self.torch_threads, lo=1, allowed="an int >= 1 or null")
        if self.reward is not None:
            check_reward_spec(self.reward)  # a shipped name or 'package.module:function'
        check_choice("rollout.mode", self.mode, ("drain", "partial"))
        check_partial_keys(self, self.mode == "partial")
        check_opt_str("rollout.weights_from", self.weights_from)


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
class JobConfig:
    output_dir: str
    model: ModelConfig = field(default_factory=ModelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    pool: PoolConfig = field(default_factory=PoolConfig)

    def __post_init__(self) -> None:
        check_str("output_dir", self.output_dir)
        if self.rollout.mode == "partial" and self.pool.replicas > 1:
            fail("rollout.mode", "partial", f"drain with pool.replicas={self.pool.replicas}: a pool runs each round "
                 "to its end, while partial rollouts carry running groups across rounds in the in-process engine "
                 "(pool.replicas=1)")

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> JobConfig:
        """Build from a plain (resolved) dict such as ``OmegaConf.to_container(cfg, resolve=True)``."""
        top = _check_keys("", raw, {f.name for f in fields(cls)})
        if "output_dir" not in top:
            raise ValueError("output_dir is missing: it is required (trajectories and metrics go there)")
        logger_keys = {f.name for f in fields(LoggerConfig)}
        logger_raw = dict(_check_keys("logger", top.get("logger") or {}, logger_keys))
        logger_raw["wandb"] = _section(WandbConfig, "logger.wandb", logger_raw.get("wandb") or {})
        return cls(
            output_dir=top["output_dir"],
            model=_section(ModelConfig, "model", top.get("model") or {}),
            engine=_engine(top.get("engine") or {}),
            sampling=_section(SamplingConfig, "sampling", top.get("sampling") or {}),
            data=_section(DataConfig, "data", top.get("data") or {}),
            rollout=_section(RolloutConfig, "rollout", top.get("rollout") or {}),
            logger=LoggerConfig(**logger_raw),
            pool=_section(PoolConfig, "pool", top.get("pool") or {}),
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe nested dict (tuples become lists); ``from_dict(to_dict())`` round-trips."""
        return json.loads(json.dumps(dataclasses.asdict(self)))

    def resume_mismatches(self, saved: Mapping[str, Any]) -> list[str]:
        """Keys whose value differs from a saved run's config, ignoring those a resume may change."""
        now, before = _flatten(self.to_dict()), _flatten(dict(saved))
        keys = sorted(set(now) | set(before))
        free = lambda k: any(k == f or k.startswith(f + ".") for f in RESUME_FREE_KEYS)
        diff = [k for k in keys if not free(k) and now.get(k) != before.get(k)]
        return [f"{k}: saved {before.get(k)!r}, now {now.get(k)!r}" for k in diff]


def _section(cls: type, prefix: str, raw: Mapping[str, Any]) -> Any:
    values = dict(_check_keys(prefix, raw, {f.name for f in fields(cls)}))
    for key, value in values.items():
        if isinstance(value, list):  # YAML lists -> tuples, so the frozen config stays hashable
            values[key] = tuple(value)
    return cls(**values)


def _engine(raw: Mapping[str, Any]) -> EngineConfig:
    values = dict(_check_keys("engine", raw, {f.name for f in fields(EngineConfig)}))
    check_typed_fields("engine", EngineConfig, values)  # YAML types first: async_mode=maybe is no bool
    try:
        return EngineConfig.from_options(**values)
    except (TypeError, ValueError) as e:  # EngineConfig names the field and the range; add the group
        raise ValueError(f"engine.{e}") from None


def _check_keys(prefix: str, raw: object, allowed: set[str]) -> Mapping[str, Any]:
    where = prefix or "the config"
    if not isinstance(raw, Mapping):
        raise ValueError(f"{where} must be a mapping, got {raw!r}")
    unknown = sorted(set(raw) - allowed)
    if unknown:
        dotted = [f"{prefix}.{k}" if prefix else str(k) for k in unknown]
        raise ValueError(f"unknown key(s) {dotted} in {where}; allowed: {sorted(allowed)}")
    return raw


def _flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out
