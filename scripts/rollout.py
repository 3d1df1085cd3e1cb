"""The main job: rounds of rollouts over a prompt dataset -> output_dir/trajectories.parquet.

    python scripts/rollout.py                     # the embedded default: offline, < 1 min on CPU
    python scripts/rollout.py model.path=/ckpt data.path=prompts.jsonl sampling.n=8 rollout.rounds=10
    python scripts/rollout.py --multirun sampling.temperature=0.7,1.0

Writes trajectories.parquet (after every round, atomically), metrics.jsonl (one line per round),
config.json (the resolved config; a resume must match it) and a wandb/ run dir, all under output_dir.
Everything a user can get wrong is checked before any generation; the script then prints
``error: ...`` and exits with status 2 instead of a traceback.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path
from typing import Any

# This file is named like the package: drop its own directory from the path so `import rollout`
# finds the package, not this script.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or os.curdir).resolve() != _HERE]

import hydra  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402
from omegaconf.errors import OmegaConfBaseException  # noqa: E402

from rollout.job.config import JobConfig  # noqa: E402

USER_ERRORS = (ValueError, FileNotFoundError)


def run(cfg: DictConfig) -> Path:
    """Run the job a composed Hydra config describes; returns output_dir. Used by main() and by tests."""
    try:
        raw = OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as e:
        raise ValueError(
            f"the config does not resolve: {e} (outside a Hydra run, set output_dir=...)"
        ) from None
    return run_job(JobConfig.from_dict(raw))  # type: ignore[arg-type]


def run_job(job: JobConfig) -> Path:
    from rollout.job.actor import RolloutActor
    from rollout.job.data import load_prompt_dataset
    from rollout.job.rewards import get_reward_fn
    from rollout.job.trajectory_writer import TrajectoryWriter
    from rollout.job.wandb_logger import WandbLogger

    reward_fn = get_reward_fn(job.rollout.reward)
    writer = TrajectoryWriter(job.output_dir, with_reward=reward_fn is not None)
    start = _start_round(job, writer)
    if start >= job.rollout.rounds:
        print(f"nothing to do: {start} of {job.rollout.rounds} rounds already in {writer.dir}")
        return writer.dir
    model_dir = _model_dir(job)
    tokenizer = _load_tokenizer(job.model.tokenizer or model_dir, explicit=job.model.tokenizer is not None)
    dataset = load_prompt_dataset(job.data, tokenizer, require_answer=reward_fn is not None)
    engine = _load_engine(job, model_dir, tokenizer)
    logger = WandbLogger(job.logger.wandb, writer.dir, job.to_dict())  # may refuse (online, no account)
    writer.save_config(job.to_dict())  # only now: a run refused above leaves output_dir reusable
    run_dir = logger.run_dir
    actor = RolloutActor(
        engine,
        dataset,
        job.sampling.to_params(),
        job.data.num_prompts,
        reward_fn,
        start_round=start,
        log_every_steps=job.logger.log_every_steps,
        on_step=logger.log_step,
        progress=job.logger.progress,
    )
    exit_code = 1
    threads = torch_threads(job.rollout.torch_threads)
    try:
        for _ in range(start, job.rollout.rounds):
            result = actor.run_round()
            writer.write_round(result.trajectories, result.metrics)
            logger.log_round(result.metrics, [len(t.completion_ids) for t in result.trajectories])
            print(_summary(result.metrics), flush=True)
        exit_code = 0
    finally:
        torch_threads(threads)
        logger.finish(exit_code)
    where = f" (wandb run: {run_dir})" if run_dir is not None else ""
    print(f"wrote {writer.num_rows} trajectories to {writer.dir / 'trajectories.parquet'}{where}")
    return writer.dir


def torch_threads(n: int | None) -> int:
    """Set torch's intra-op thread count (None leaves it); returns the previous one, to restore after."""
    import torch

    previous = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    return previous


def _start_round(job: JobConfig, writer: Any) -> int:
    """0 for a fresh run; after the last complete round for a resume whose config matches."""
    if not job.rollout.resume:
        if writer.has_previous_run:
            raise ValueError(
                f"output_dir={job.output_dir!r} already holds a run; set rollout.resume=true to continue it "
                "or choose another output_dir"
            )
        return 0
    saved = writer.saved_config()
    if saved is None:
        if writer.has_previous_run:
            raise ValueError(f"cannot resume in {job.output_dir!r}: its config.json is missing")
        print(f"rollout.resume=true but {writer.dir} holds no run yet: starting at round 0")
        return 0
    mismatches = job.resume_mismatches(saved)
    if mismatches:
        raise ValueError(
            f"cannot resume in {job.output_dir!r}: the config differs from the saved one in "
            + "; ".join(mismatches)
        )
    start = writer.resume()
    print(f"resuming after {start} complete round(s) in {writer.dir}")
    return start


def _model_dir(job: JobConfig) -> Path:
    from rollout.assets import check_checkpoint_dir, materialize_default_model

    if job.model.path is not None:
        return check_checkpoint_dir(job.model.path)
    return materialize_default_model(job.model.cache_dir, seed=job.model.seed)


def _load_tokenizer(path: str | Path, explicit: bool) -> Any:
    """The tokenizer at ``path``; a checkpoint without tokenizer files gives None (token-id prompts only)."""
    p = Path(path).expanduser()
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not p.is_dir() or not any((p / n).exists() for n in names):
        if explicit:
            raise FileNotFoundError(f"model.tokenizer={str(path)!r} is not a directory with tokenizer files")
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(p))


def _load_engine(job: JobConfig, model_dir: Path, tokenizer: Any) -> Any:
    from rollout import Engine

    options = dataclasses.asdict(job.engine)
    if getattr(job, "pool", None) is not None and job.pool.replicas > 1:  # the server's config has no pool
        return _load_pool(job, model_dir, tokenizer, options)
    try:
        return Engine.from_pretrained(
            str(model_dir), dtype=job.model.dtype, device=job.model.device, tokenizer=tokenizer, **options
        )
    except (ValueError, KeyError, OSError) as e:  # e.g. an architecture the engine lacks, a missing tensor
        raise ValueError(f"cannot load the model in {str(model_dir)!r}: {e}") from None


def _load_pool(job: JobConfig, model_dir: Path, tokenizer: Any, options: dict[str, Any]) -> Any:
    """``pool.replicas`` Ray actors behind the engine's step surface (each loads the checkpoint itself)."""
    from rollout.pool import EngineFactory
    from rollout.pool.engine_view import PoolEngine
    from rollout.pool.pool import RolloutPool

    factory = EngineFactory(str(model_dir), job.model.dtype, job.model.device, tokenizer, options)
    pool = RolloutPool(job.pool.replicas, factory, address=job.pool.address,
                       gpus_per_replica=job.pool.gpus_per_replica, torch_threads=job.rollout.torch_threads)
    return PoolEngine(pool)


def _summary(m: dict[str, Any]) -> str:
    reward = f", reward {m['reward_mean']:.3f}" if "reward_mean" in m else ""
    return (
        f"round {m['round']}: {m['num_samples']} samples, {m['generated_tokens']} tokens in "
        f"{m['round_time_s']:.2f}s ({m['generated_tokens_per_s']:.0f} tok/s){reward}"
    )


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    try:
        run(cfg)
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)


if __name__ == "__main__":
    # Quiet third-party progress bars (dataset split generation, checkpoint writing); ours stays.
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    main()
