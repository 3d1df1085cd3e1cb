"""The main job: rounds of rollouts over a prompt dataset -> output_dir/trajectories/round_NNNNN.parquet.

``scripts/rollout.py`` (``make run``) and ``rollout-run`` call ``main()``; tests call ``run(cfg)`` / ``run_job(job)``.

    python scripts/rollout.py                     # the embedded default: offline, < 1 min on CPU
    python scripts/rollout.py model.path=/ckpt data.path=prompts.jsonl sampling.n=8 rollout.rounds=10
    python scripts/rollout.py --multirun sampling.temperature=0.7,1.0

Writes trajectories/round_NNNNN.parquet (one file per round, atomically), metrics.jsonl (one line per
round), config.json (the resolved config and the job seed; a resume must match it) and a wandb/ run
dir, all under output_dir, which the job locks for its lifetime. Everything a user can get wrong,
every dataset row included, is checked before anything is written, and nothing is written before the
first round is (a first round that fails leaves output_dir as it was); a refusal, a full disk or a damaged
round file prints ``error: ...`` and exits with status 2 instead of a traceback. Progress goes through ``logging``, so
Hydra's console and its rollout.log both get it.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig

from rollout.cli import quiet_progress_bars, resolved_config, run_or_exit
from rollout.job.config import JobConfig

log = logging.getLogger("rollout")


def run(cfg: DictConfig) -> Path:
    """Run the job a composed Hydra config describes; returns output_dir. Used by main() and by tests."""
    return run_job(JobConfig.from_dict(resolved_config(cfg)))


def run_job(job: JobConfig) -> Path:
    """Check and load everything, then write config.json and run the rounds, holding output_dir throughout."""
    from rollout.job.output_dir import OutputDirLock
    from rollout.job.trajectory_writer import TrajectoryWriter

    job.sampling.to_params()  # a sampling combination the engine refuses stops the job here
    env = job.rollout.env is not None
    writer = TrajectoryWriter(job.output_dir, with_reward=job.rollout.reward is not None or env, with_env=env)
    with OutputDirLock(writer.dir):
        return _run_locked(job, writer)


def _run_locked(job: JobConfig, writer: Any) -> Path:
    from rollout.job import setup
    from rollout.job.data import load_prompt_dataset
    from rollout.job.rounds import RoundDriver
    from rollout.job.snapshots import SnapshotWatcher
    from rollout.rl.prompts import load_tokenizer
    from rollout.rl.rewards import get_reward_fn
    from rollout.rl.wandb_logger import WandbLogger
    from rollout.settings import model as settings_model

    spec = None
    if job.rollout.env is not None:  # loaded first: a bad environment stops the job before the model loads
        from rollout.envs import EnvSpec, load_factory

        spec = EnvSpec(load_factory(job.rollout.env))
    reward_fn = None if spec is not None and spec.has_reward else get_reward_fn(job.rollout.reward)
    start = setup.start_point(job, writer)
    if start.round >= job.rollout.rounds:
        log.info("nothing to do: %d of %d rounds already in %s", start.round, job.rollout.rounds, writer.dir)
        return writer.dir
    params = job.sampling.to_params()
    floor = int((start.state or {}).get("policy_version", 0))  # the version the rounds written reached
    watcher = SnapshotWatcher(job.rollout.weights_from, floor) if job.rollout.weights_from is not None else None
    model_dir = settings_model.model_dir(job.model)
    tokenizer = load_tokenizer(model_dir, job.model.tokenizer)
    dataset = load_prompt_dataset(job.data, tokenizer, require_answer=reward_fn is not None)
    writer.set_data_columns(dataset.column_types())  # trajectories keep every column of their dataset row
    bandwidth = setup.copy_bandwidth(job)  # before the engine takes its memory
    engine = setup.load_engine(job, model_dir, tokenizer)
    dataset.check(setup.prompt_limits(engine), params, where=f"data.path={job.data.path or 'embedded'!r}")
    new_wandb_dir = not (writer.dir / "wandb").exists()
    logger = WandbLogger(job.logger.wandb, writer.dir, job.to_dict())  # may refuse (online, no account)
    run_dir = logger.run_dir
    driver: Any
    if spec is not None:
        from rollout.job.env_rounds import EnvRoundDriver, env_limits

        ro = job.rollout
        driver = EnvRoundDriver(engine, dataset, params, job.data.num_prompts, spec, env_limits(ro, params), reward_fn,
                                start_round=start.round, seed=start.job_seed, mode=ro.mode,
                                max_inflight_groups=ro.max_inflight_groups, max_staleness=ro.max_staleness,
                                stale_groups=ro.stale_groups, recompute_running=ro.recompute_running,
                                state=start.state)
    else:
        driver = RoundDriver(
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
            num_rounds=job.rollout.rounds,
        )
    exit_code, wrote = 1, False
    threads = torch_threads(job.rollout.torch_threads)
    try:
        for r in range(start.round, job.rollout.rounds):
            if watcher is not None:
                watcher.load_newest(driver)  # between rounds: the round's tokens carry its step
            result = driver.run_round()
            if r == start.round:  # only now: a run refused or failing before its first round leaves no trace
                writer.save_config(setup.config_record(job, start.job_seed))
            writer.write_round(result.round, result.trajectories, result.metrics, driver.state())
            wrote = True
            lengths = [len(t.completion_ids) for t in result.trajectories]
            logger.log_round(result.metrics, {"completion_len": lengths, "staleness": result.staleness})
            log.info(_summary(result.metrics))
        exit_code = 0
    finally:
        if spec is not None:
            driver.close()
        torch_threads(threads)
        logger.finish(exit_code)
        if start.round == 0 and not wrote:  # the first round failed: leave output_dir as it was
            _forget_first_round(writer, (writer.dir / "wandb") if new_wandb_dir else run_dir)
    where = f" (wandb run: {run_dir})" if run_dir is not None else ""
    log.info("wrote %d trajectories to %s%s", writer.num_rows, writer.rounds_dir, where)
    return writer.dir


def _forget_first_round(writer: Any, wandb_dir: Path | None) -> None:
    """Remove what a run whose first round failed wrote (config.json, its W&B run or the wandb/ dir it
    created), so a rerun starts fresh."""
    from rollout.job.trajectory_writer import CONFIG

    (writer.dir / CONFIG).unlink(missing_ok=True)
    if wandb_dir is not None:
        shutil.rmtree(wandb_dir, ignore_errors=True)


def torch_threads(n: int | None) -> int:
    """Set torch's intra-op thread count (None leaves it); returns the previous one, to restore after."""
    import torch

    previous = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    return previous


def _summary(m: dict[str, Any]) -> str:
    reward = f", reward {m['reward_mean']:.3f}" if "reward_mean" in m else ""
    if "turns_mean" in m:
        reward += f", {m['turns_mean']:.2f} turns, {m['tool_calls']} tool calls ({m['tool_failures']} failed)"
    carried = f", {m['carried_over_groups']} groups carried over" if m["carried_over_groups"] else ""
    dropped = f", {m['dropped_groups']} dropped as stale" if m["dropped_groups"] else ""
    return (
        f"round {m['round']}: {m['num_samples']} samples, {m['generated_tokens']} tokens in "
        f"{m['round_time_s']:.2f}s ({m['generated_tokens_per_s']:.0f} tok/s){reward}{carried}{dropped}"
    )


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    quiet_progress_bars()
    run_or_exit(run, cfg, log)
