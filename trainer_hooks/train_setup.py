"""What the training scripts (rollout/cli/train_grpo.py, rollout/cli/train_ppo.py) share: config loading, the model,
tokenizer, dataset and engine, W&B settings, and the per-step log (logger line + metrics.jsonl).

No Hydra here: the scripts compose the config and hand a plain dict to ``load_job``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rollout.rl.prompts import load_rows, use_chat_template
from rollout.rl.rewards import NEEDS_ANSWER, check_reward_spec, is_import_path
from rollout.settings import model as settings_model
from rollout.settings.schema import DataConfig, RunConfig, WandbConfig

log = logging.getLogger("rollout.train")


# ---- validation -----------------------------------------------------------------------------------------
def is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_num(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v


def check(key: str, ok: bool, value: object, allowed: str) -> None:
    if not ok:
        raise ValueError(f"train.{key}={value!r} is invalid: must be {allowed}")


def check_common(train: Any) -> None:
    """The keys both scripts' ``train`` sections have."""
    for key in ("steps", "logging_steps"):
        check(key, is_int(getattr(train, key)) and getattr(train, key) >= 1, getattr(train, key), "an int >= 1")
    check("seed", is_int(train.seed) and train.seed >= 0, train.seed, "an int >= 0")
    for key in ("learning_rate", "max_grad_norm"):
        value = getattr(train, key)
        check(key, is_num(value) and value > 0, value, "a number > 0")
    check("sleep_level", train.sleep_level in (0, 1, 2) and is_int(train.sleep_level), train.sleep_level,
          "0 (engine keeps its memory), 1 (frees its KV cache while training) or 2 (also its weights)")
    threads = train.torch_threads
    check("torch_threads", threads is None or (is_int(threads) and threads >= 1), threads, "an int >= 1 or null")
    if not (train.reward == "env" and getattr(train, "env", None)):  # "env": the environment's get_reward alone
        check_reward_spec(train.reward, "train.reward")


def check_env_keys(train: Any) -> None:
    """``train.env`` / ``train.tools`` / ``train.tool_timeout_s`` / ``train.max_turn_tokens`` (both scripts)."""
    from rollout.envs.protocol import _SPEC

    check("env", train.env is None or (isinstance(train.env, str) and bool(_SPEC.match(train.env))), train.env,
          "null or an import path 'package.module:factory'")
    tools = list(train.tools)
    check("tools", all(isinstance(t, str) and _SPEC.match(t) for t in tools), tools,
          "a list of import paths 'package.module:function'")
    t = train.tool_timeout_s
    check("tool_timeout_s", is_num(t) and t > 0, t, "a number of seconds > 0")
    m = train.max_turn_tokens
    check("max_turn_tokens", m is None or (is_int(m) and m >= 1), m, "an int >= 1 or null")
    if train.reward == "env" and not train.env:
        check("reward", False, train.reward, "a reward name or path ('env' needs train.env)")


def load_job(raw: Mapping[str, Any], train_cls: type) -> tuple[RunConfig, Any]:
    """The shared groups through RunConfig (same checks and messages as the main job), plus ``train``."""
    raw = dict(raw)
    train = dict(raw.pop("train", None) or {})
    names = {f.name for f in dataclasses.fields(train_cls)}
    unknown = sorted(set(train) - names)
    if unknown:
        raise ValueError(f"unknown key(s) {[f'train.{k}' for k in unknown]}; allowed: {sorted(names)}")
    job = RunConfig.from_dict(raw)
    if job.sampling.logprobs_mode != "policy":
        raise ValueError(f"sampling.logprobs_mode={job.sampling.logprobs_mode!r} is invalid for training: "
                         "must be 'policy' (the logprob the trainer recomputes)")
    return job, train_cls(**train)


# ---- model, tokenizer, data, engine ---------------------------------------------------------------------
def model_dir(job: RunConfig) -> Path:
    """The checkpoint dir: a local dir, a hub name (fetched once), or the embedded random-init default."""
    return settings_model.model_dir(job.model)


def load_tokenizer(job: RunConfig, checkpoint: Path) -> Any:
    from rollout.rl.prompts import load_tokenizer as load

    return load(checkpoint, job.model.tokenizer, needed_by="training")


def make_engine(job: RunConfig, checkpoint: Path, tokenizer: Any, torch_threads: int | None = None) -> Any:
    """The in-process engine, or with ``pool.replicas`` > 1 a ``RolloutPool`` of that many Ray actors (each
    loads the checkpoint itself; ``generate`` and ``update_weights`` as an engine's, so ``TRLRollout`` takes it)."""
    if job.pool.replicas > 1:
        return make_pool(job, checkpoint, torch_threads)
    return settings_model.load_engine(job.model, job.engine, checkpoint, tokenizer)


def make_pool(job: RunConfig, checkpoint: Path, torch_threads: int | None = None) -> Any:
    """A ``RolloutPool`` whose ``sleep()`` (``train.sleep_level``) sleeps the replicas that share the trainer's
    memory. With ``pool.colocate_with_trainer`` that is replica 0 alone: the others sit on GPUs the trainer
    does not use, so sleeping them frees nothing it could take, costs a KV-cache (and CUDA-graph) rebuild
    per step, and at level 2 turns their pushes into copies into host memory. Without co-location every
    replica sleeps, as one engine does: the replicas then share the host (CPU replicas, or GPUs shared by
    placement), and sleeping one that shares nothing with the trainer is harmless."""

    from rollout.pool import EngineFactory
    from rollout.pool.pool import RolloutPool

    factory = EngineFactory(str(checkpoint), job.model.dtype, job.model.device, job.model.tokenizer or str(checkpoint),
                            dataclasses.asdict(job.engine))
    pool = RolloutPool(job.pool.replicas, factory, address=job.pool.address,
                       gpus_per_replica=job.pool.gpus_per_replica, torch_threads=torch_threads,
                       colocate_with_trainer=job.pool.colocate_with_trainer, trainer_device=trainer_device(job),
                       sleep_replicas=[0] if job.pool.colocate_with_trainer else None)
    return pool


def trainer_device(job: RunConfig) -> Any:
    """Where the trainer's models live: ``model.device``, else the GPU if there is one."""
    import torch

    return torch.device(job.model.device or ("cuda" if torch.cuda.is_available() else "cpu"))


def close_engine(job: RunConfig, engine: Any) -> None:
    """Stop what ``make_engine`` started outside this process: a pool's Ray actors (an in-process engine
    goes with the process; a server client owns nothing)."""
    if job.pool.replicas > 1:
        engine.shutdown()


def build_dataset(cfg: DataConfig, tokenizer: Any, reward: str) -> Any:
    """``prompt`` (chat messages when templated, as TRL expects) and ``answer`` columns from data.*."""
    rows = load_rows(cfg)
    fields = list(rows.column_names)
    where = cfg.path or "the embedded dataset"
    if cfg.prompt_field not in fields:
        raise ValueError(f"data.prompt_field={cfg.prompt_field!r} is not a field of {where!r}; its fields are {fields}")
    answer = cfg.answer_field if cfg.answer_field in fields else None
    if reward in NEEDS_ANSWER and answer is None:
        raise ValueError(f"train.reward={reward} needs answers but data.answer_field={cfg.answer_field!r} "
                         f"is not a field of {where!r}; its fields are {fields}")
    template = use_chat_template(tokenizer, cfg.apply_chat_template)
    keep = [f for f in fields if f not in (cfg.prompt_field, answer)] if is_import_path(reward) else []

    def convert(row: dict[str, Any]) -> dict[str, Any]:
        prompt = row[cfg.prompt_field]
        messages = isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt)
        if not (isinstance(prompt, str) or messages):
            raise ValueError(f"data.prompt_field={cfg.prompt_field!r}: training needs text or chat messages, "
                             f"got {prompt!r:.100}")
        if isinstance(prompt, str) and template:
            prompt = [{"role": "user", "content": prompt}]
        return {"prompt": prompt, "answer": None if answer is None else str(row[answer])}

    # A plug-in reward sees the other columns too (TRL passes dataset columns as keyword arguments).
    return rows.map(convert, remove_columns=[f for f in fields if f not in keep])


def torch_threads(n: int | None) -> None:
    import torch

    if n is not None:
        torch.set_num_threads(n)


def wandb_env(cfg: WandbConfig, output_dir: Path) -> list[str]:
    """``report_to`` for a transformers trainer, whose W&B callback reads the rest from the environment."""
    if cfg.mode == "disabled":
        return ["none"]
    env = {"WANDB_MODE": cfg.mode, "WANDB_PROJECT": cfg.project, "WANDB_DIR": str(output_dir),
           "WANDB_DISABLE_GIT": "true", "WANDB_CONSOLE": "off"}
    if cfg.mode == "offline":
        env["WANDB_SILENT"] = "true"
    for key, value in (("WANDB_ENTITY", cfg.entity), ("WANDB_RUN_GROUP", cfg.group),
                       ("WANDB_TAGS", ",".join(cfg.tags) or None), ("WANDB_NAME", cfg.name)):
        if value:
            env[key] = value
    os.environ.update(env)
    if "wandb" in sys.modules:  # wandb reads the environment once per process, at its first setup: start afresh
        import wandb  # (an earlier online attempt would otherwise keep this run online and ask for a login)

        if wandb.run is None:
            wandb.teardown()
    return ["wandb"]


def finish_wandb(exit_code: int = 0) -> None:
    """Close the run a transformers trainer opened (it leaves it open), so the offline run is complete."""
    if "wandb" not in sys.modules:
        return
    import wandb

    if wandb.run is not None:
        wandb.finish(exit_code=exit_code)


# ---- the per-step log -----------------------------------------------------------------------------------
class StepLog:
    """One logger line per step (reward, length, the engine's speed) and one JSON line in metrics.jsonl."""

    def __init__(self, path: Path, reward_name: str) -> None:
        self.path, self.reward_name = path, reward_name
        self.rewards: list[float] = []

    def add(self, step: int, logs: Mapping[str, Any]) -> None:
        if "reward" not in logs:
            return
        self.rewards.append(float(logs["reward"]))
        length = logs.get("completions/mean_length", logs.get("rollout/completion_len_mean", math.nan))
        speed = logs.get("rollout/tokens_per_s")
        engine = f"  engine {speed:.0f} tok/s" if isinstance(speed, (int, float)) else ""
        log.info("step %4d  reward %.3f (std %.3f)  completion length %.1f%s", step, float(logs["reward"]),
                 float(logs.get("reward_std") or 0.0), float(length), engine)
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **logs}, default=float) + "\n")

    def summary(self) -> str:
        r = self.rewards
        if not r:
            return "no reward was logged"
        k = max(1, len(r) // 5)
        return (f"{self.reward_name}: mean of the first {k} steps {sum(r[:k]) / k:.3f} -> "
                f"last {k} steps {sum(r[-k:]) / k:.3f}")
