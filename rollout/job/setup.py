"""Everything the job checks and loads before its first round, in the order that keeps output_dir clean.

A refused run must leave output_dir as it found it (apart from the lock file), so the rerun with the
corrected setting is a fresh start: the previous run's state is read, the model, tokenizer, dataset and
engine are loaded and every prompt is checked against the engine's limits, and the job writes config.json
only with its first round (a first round that fails is forgotten too). These helpers do the reading and
loading; ``rollout.job.main`` orders them.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

from rollout.job.config import JobConfig
from rollout.job.data import PromptLimits
from rollout.job.seeds import new_job_seed
from rollout.job.trajectory_writer import TrajectoryWriter
from rollout.settings import model as settings_model

log = logging.getLogger(__name__)
JOB_SEED_KEY = "job_seed"  # stored in config.json beside the resolved config


@dataclasses.dataclass(frozen=True, slots=True)
class Start:
    round: int  # the next round to run
    job_seed: int  # every request's seed derives from it (seeds.request_seed)
    state: dict[str, Any] | None  # the round driver's state after the last complete round (None: fresh)


def start_point(job: JobConfig, writer: TrajectoryWriter) -> Start:
    """Round 0 and a new job seed for a fresh run; after the last complete round for a matching resume."""
    fresh_seed = job.sampling.seed if job.sampling.seed is not None else new_job_seed()
    if not job.rollout.resume:
        if writer.has_previous_run:
            raise ValueError(
                f"output_dir={job.output_dir!r} already holds a run; set rollout.resume=true to continue it "
                "or choose another output_dir"
            )
        return Start(0, fresh_seed, None)
    saved = writer.saved_config()
    if saved is None:
        if writer.has_previous_run:
            raise ValueError(f"cannot resume in {job.output_dir!r}: its config.json is missing")
        log.info("rollout.resume=true but %s holds no run yet: starting at round 0", writer.dir)
        return Start(0, fresh_seed, None)
    saved_seed = saved.pop(JOB_SEED_KEY, None)
    mismatches = job.resume_mismatches(saved)
    if mismatches:
        raise ValueError(
            f"cannot resume in {job.output_dir!r}: the config differs from the saved one in "
            + "; ".join(mismatches)
        )
    job_seed = saved_seed if isinstance(saved_seed, int) else job.sampling.seed
    if job_seed is None:
        raise ValueError(
            f"cannot resume in {job.output_dir!r}: its config.json has no {JOB_SEED_KEY!r} (a run of an older "
            "version), so its rounds cannot be repeated exactly; start a new output_dir"
        )
    start = writer.resume()
    log.info("resuming after %d complete round(s) in %s", start, writer.dir)
    return Start(start, job_seed, writer.state)


def config_record(job: JobConfig, job_seed: int) -> dict[str, Any]:
    """What config.json holds: the resolved config plus the job seed a resume needs."""
    return {**job.to_dict(), JOB_SEED_KEY: job_seed}


def copy_bandwidth(job: JobConfig) -> float | None:
    """The device's copy bandwidth for the floor ratio: an in-process CUDA engine only (None on the CPU and for
    a pool, whose replicas run elsewhere)."""
    if job.pool.replicas > 1:
        return None
    from rollout.job.bandwidth import copy_bandwidth as measure

    return measure(job.model.device)


def load_engine(job: JobConfig, model_path: Path, tokenizer: Any) -> Any:
    """The in-process engine, or with ``pool.replicas`` > 1 a pool of them."""
    if job.pool.replicas > 1:
        return load_pool(job, model_path, tokenizer, dataclasses.asdict(job.engine))
    return settings_model.load_engine(job.model, job.engine, model_path, tokenizer)


def load_pool(job: JobConfig, model_path: Path, tokenizer: Any, options: dict[str, Any]) -> Any:
    """``pool.replicas`` Ray actors behind the engine's step surface (each loads the checkpoint itself)."""
    from rollout.pool import EngineFactory
    from rollout.pool.pool import RolloutPool

    if job.pool.colocate_with_trainer:
        raise ValueError("pool.colocate_with_trainer=true is for the training scripts (scripts/train_grpo.py), where "
                         "replica 0 shares the trainer's GPU; this job has no trainer process (its weights come "
                         "from rollout.weights_from or a server push): set it to false")
    factory = EngineFactory(str(model_path), job.model.dtype, job.model.device, tokenizer, options)
    return RolloutPool(job.pool.replicas, factory, address=job.pool.address,
                       gpus_per_replica=job.pool.gpus_per_replica, torch_threads=job.rollout.torch_threads)


def prompt_limits(backend: Any) -> PromptLimits:
    """The backend's limits on a prompt: vocabulary, max_model_len and KV capacity in tokens."""
    limits = backend.limits
    return PromptLimits(limits.vocab_size, limits.max_model_len, limits.kv_cache_tokens)
