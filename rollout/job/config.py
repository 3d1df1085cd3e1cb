"""The main job's configuration: the shared sections (``rollout.settings.schema.RunConfig``) plus ``rollout``.

Mirrored by rollout/conf/config.yaml and rollout/conf/rollout/default.yaml; built from a plain dict
(``JobConfig.from_dict``) so Hydra stays in the entry points.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rollout.rl.rewards import check_reward_spec
from rollout.settings.checks import check_bool, check_choice, check_int, check_opt_str, fail
from rollout.settings.schema import RunConfig, check_partial_keys

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
    # Multi-turn: an environment per conversation (TRL's environment_factory protocol, rollout/envs/):
    # 'package.module:factory'; None = single-turn completions. Each turn continues from the resident KV (over a
    # pool, drain mode only: from the prefix cache of the replica that holds the conversation).
    env: str | None = None
    max_turns: int = 4  # model turns per conversation
    max_turn_tokens: int | None = None  # tokens generated per turn; None = sampling.max_tokens
    tool_timeout_s: float = 60.0  # one environment call (tool, reset, step, get_reward); past it: an error
    max_tool_result_chars: int = 16384  # a longer tool result / reply is cut, with a marker

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
        check_env_keys(self)


def check_env_keys(cfg: RolloutConfig) -> None:
    check_opt_str("rollout.env", cfg.env)
    check_int("rollout.max_turns", cfg.max_turns, lo=1)
    if cfg.max_turn_tokens is not None:
        check_int("rollout.max_turn_tokens", cfg.max_turn_tokens, lo=1, allowed="an int >= 1 or null")
    t = cfg.tool_timeout_s
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0:
        fail("rollout.tool_timeout_s", t, "a number of seconds > 0")
    check_int("rollout.max_tool_result_chars", cfg.max_tool_result_chars, lo=1)


@dataclass(frozen=True, slots=True)
class JobConfig(RunConfig):
    rollout: RolloutConfig = field(default_factory=RolloutConfig)

    def __post_init__(self) -> None:
        RunConfig.__post_init__(self)
        if self.rollout.mode == "partial" and self.pool.replicas > 1:
            env = self.rollout.env
            what = "running groups" if env is None else f"running conversations (rollout.env={env!r})"
            fail("rollout.mode", "partial", f"drain with pool.replicas={self.pool.replicas}: a pool runs each round "
                 f"to its end, while partial rollouts carry {what} across rounds in the in-process engine "
                 "(pool.replicas=1)")

    def resume_mismatches(self, saved: Mapping[str, Any]) -> list[str]:
        """Keys whose value differs from a saved run's config, ignoring those a resume may change."""
        now, before = _flatten(self.to_dict()), _flatten(dict(saved))
        keys = sorted(set(now) | set(before))
        free = lambda k: any(k == f or k.startswith(f + ".") for f in RESUME_FREE_KEYS)
        diff = [k for k in keys if not free(k) and now.get(k) != before.get(k)]
        return [f"{k}: saved {before.get(k)!r}, now {now.get(k)!r}" for k in diff]


def _flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out
