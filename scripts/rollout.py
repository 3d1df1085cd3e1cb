"""The main job: rounds of rollouts over a prompt dataset -> output_dir/trajectories/round_NNNNN.parquet.

    python scripts/rollout.py                     # the embedded default: offline, < 1 min on CPU
    python scripts/rollout.py model.path=/ckpt data.path=prompts.jsonl sampling.n=8 rollout.rounds=10
    python scripts/rollout.py --multirun sampling.temperature=0.7,1.0

Writes trajectories/round_NNNNN.parquet (one file per round, atomically), metrics.jsonl (one line per
round), config.json (the resolved config and the job seed; a resume must match it) and a wandb/ run
dir, all under output_dir, which the job locks for its lifetime. Everything a user can get wrong,
every dataset row included, is checked before anything is written; the script then prints
``error: ...`` and exits with status 2 instead of a traceback. Progress goes through ``logging``, so
Hydra's console and its rollout.log both get it.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any

# This file is named like the package: drop its own directory from the path so `import rollout`
# finds the package, not this script.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or os.curdir).resolve() != _HERE]

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from rollout.cli import quiet_progress_bars, resolved_config, run_or_exit  # noqa: E402
from rollout.job.config import JobConfig  # noqa: E402

log = logging.getLogger("rollout")


def run(cfg: DictConfig) -> Path:
    """Run the job a composed Hydra config describes; returns output_dir. Used by main() and by tests."""
    return run_job(JobConfig.from_dict(resolved_config(cfg)))


def run_job(job: JobConfig) -> Path:
    """Check and load everything, then write config.json and run the rounds, holding output_dir throughout."""
    from rollout.job.output_dir import OutputDirLock
    from rollout.job.trajectory_writer import TrajectoryWriter

    job.sampling.to_params()  # a sampling combination the engine refuses stops the job here
    writer = TrajectoryWriter(job.output_dir, with_reward=job.rollout.reward is not None)
    with OutputDirLock(writer.dir):
        return _run_locked(job, writer)


def _run_locked(job: JobConfig, writer: Any) -> Path:
    from rollout.job import setup
    from rollout.job.actor import RolloutActor
    from rollout.job.data import load_prompt_dataset
    from rollout.job.snapshots import SnapshotWatcher
    from rollout.rl.prompts import load_tokenizer
    from rollout.rl.rewards import get_reward_fn
    from rollout.rl.wandb_logger import WandbLogger
    from rollout.settings import model as settings_model

    reward_fn = get_reward_fn(job.rollout.reward)
    start = setup.start_point(job, writer)
    if start.round >= job.rollout.rounds:
        log.info("nothing to do: %d of %d rounds already in %s", start.round, job.rollout.rounds, writer.dir)
        return writer.dir
    params = job.sampling.to_params()
    watcher = SnapshotWatcher(job.rollout.weights_from) if job.rollout.weights_from is not None else None
    model_dir = settings_model.model_dir(job.model)
    tokenizer = load_tokenizer(model_dir, job.model.tokenizer)
    dataset = load_prompt_dataset(job.data, tokenizer, require_answer=reward_fn is not None)
    bandwidth = setup.copy_bandwidth(job)  # before the engine takes its memory
    engine = setup.load_engine(job, model_dir, tokenizer)
    dataset.check(setup.prompt_limits(engine), params, where=f"data.path={job.data.path or 'embedded'!r}")
    logger = WandbLogger(job.logger.wandb, writer.dir, job.to_dict())  # may refuse (online, no account)
    writer.save_config(setup.config_record(job, start.job_seed))  # only now: a refused run leaves no trace
    run_dir = logger.run_dir
    actor = RolloutActor(
        engine,
        dataset,
        params,
        job.data.num_prompts,
        reward_fn,
        start_round=start.round,
        log_every_steps=job.logger.log_every_steps,
        on_step=logger.log_step,
        progress=job.logger.progress,
        seed=start.job_seed,
        mode=job.rollout.mode,
        max_staleness=job.rollout.max_staleness,
        stale_groups=job.rollout.stale_groups,
        recompute_running=job.rollout.recompute_running,
        max_inflight_groups=job.rollout.max_inflight_groups,
        state=start.state,
        copy_bandwidth=bandwidth,
    )
    exit_code = 1
    threads = torch_threads(job.rollout.torch_threads)
    try:
        for _ in range(start.round, job.rollout.rounds):
            if watcher is not None:
                watcher.load_newest(actor)  # between rounds: the round's tokens carry its step
            result = actor.run_round()
            writer.write_round(result.round, result.trajectories, result.metrics, actor.state())
            lengths = [len(t.completion_ids) for t in result.trajectories]
            logger.log_round(result.metrics, {"completion_len": lengths, "staleness": result.staleness})
            log.info(_summary(result.metrics))
        exit_code = 0
    finally:
        torch_threads(threads)
        logger.finish(exit_code)
    where = f" (wandb run: {run_dir})" if run_dir is not None else ""
    log.info("wrote %d trajectories to %s%s", writer.num_rows, writer.rounds_dir, where)
    return writer.dir


def torch_threads(n: int | None) -> int:
    """Set torch's intra-op thread count (None leaves it); returns the previous one, to restore after."""
    import torch

    previous = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    return previous


def _summary(m: dict[str, Any]) -> str:
    reward = f", reward {m['reward_mean']:.3f}" if "reward_mean" in m else ""
    carried = f", {m['carried_over_groups']} groups carried over" if m["carried_over_groups"] else ""
    dropped = f", {m['dropped_groups']} dropped as stale" if m["dropped_groups"] else ""
    return (
        f"round {m['round']}: {m['num_samples']} samples, {m['generated_tokens']} tokens in "
        f"{m['round_time_s']:.2f}s ({m['generated_tokens_per_s']:.0f} tok/s){reward}{carried}{dropped}"
    )


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    run_or_exit(run, cfg, log)


if __name__ == "__main__":
    quiet_progress_bars()
    main()
