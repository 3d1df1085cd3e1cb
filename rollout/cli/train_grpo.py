"""GRPO with TRL, generating with the rollout engine, which follows the trainer's weights step by step.

    rollout-train-grpo                                        # embedded tiny Llama, CPU, about a minute
    rollout-train-grpo model=qwen3-0.6b engine=h200 train.steps=100 train.reward=exact_match
    rollout-train-grpo train.reward=my_pkg.rewards:score      # any TRL-signature reward function
    rollout-train-grpo +train.grpo.loss_type=dr_grpo +train.grpo.epsilon_high=0.28 # any GRPOConfig field
    rollout-train-grpo train.trainer=async_grpo               # TRL's AsyncGRPOTrainer, engine in-process
    rollout-train-grpo train.sleep_level=1                    # co-located: the engine frees its KV cache
                                                              # while the trainer trains
    rollout-train-grpo pool.replicas=2 pool.colocate_with_trainer=true train.sleep_level=1  # replica 0 does
    rollout-train-grpo rollout.mode=server rollout.url=http://127.0.0.1:8000  # against rollout-serve
    rollout-train-grpo rollout.mode=partial rollout.max_staleness=2           # partial rollouts: no step waits
                                                              # for its batch's longest group

(``python scripts/train_grpo.py ...`` from the repo root does the same.) Configured like the main job
(rollout/conf/train_grpo.yaml reuses its groups and presets). The engine's logprobs feed TRL's importance-sampling
correction (``EngineGRPOTrainer``). Logs a line per step (Hydra's log file too), writes output_dir/
metrics.jsonl and step_times.json (generation / weight push / training seconds per step), and logs to the
trainer's W&B run (offline by default) with the engine's ``rollout/*`` metrics and its resolved config.
Everything a user can get wrong is checked before loading; the script then logs ``error: ...`` and exits
with status 2.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig
from transformers import TrainerCallback

from rollout.cli import quiet_progress_bars, resolved_config, run_or_exit
from rollout.settings.checks import check_choice
from rollout.settings.schema import RunConfig, check_partial_keys
from trainer_hooks import train_setup as setup
from trainer_hooks.engine_metrics import StepTimes

log = logging.getLogger("rollout.train")
TRAINERS = ("grpo", "async_grpo")
# GRPOConfig fields this script derives from other keys: set those keys instead.
DERIVED = {
    "output_dir": "output_dir", "max_steps": "train.steps", "learning_rate": "train.learning_rate",
    "logging_steps": "train.logging_steps", "seed": "train.seed", "max_grad_norm": "train.max_grad_norm",
    "beta": "train.beta", "num_generations": "sampling.n", "max_completion_length": "sampling.max_tokens",
    "temperature": "sampling.temperature", "top_p": "sampling.top_p", "top_k": "sampling.top_k",
    "min_p": "sampling.min_p", "generation_kwargs": "sampling.*", "per_device_train_batch_size":
    "data.num_prompts (x sampling.n, split by train.grpo.gradient_accumulation_steps)", "report_to":
    "logger.wandb.mode", "run_name": "logger.wandb.name", "shuffle_dataset": "data.shuffle",
    "disable_tqdm": "logger.progress", "use_vllm": "(the engine generates)",
}


@dataclass(frozen=True, slots=True)
class TrainConfig:
    trainer: str = "grpo"
    steps: int = 40
    learning_rate: float = 5e-3
    reward: str = "digit_fraction"
    beta: float = 0.0
    max_grad_norm: float = 1.0
    logging_steps: int = 1
    seed: int = 0
    torch_threads: int | None = 1
    sleep_level: int = 0
    grpo: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        setup.check("trainer", self.trainer in TRAINERS, self.trainer, f"one of {list(TRAINERS)}")
        setup.check_common(self)
        setup.check("beta", setup.is_num(self.beta) and self.beta >= 0, self.beta, "a number >= 0")
        if self.trainer == "async_grpo":
            setup.check("beta", self.beta == 0, self.beta, "0 with train.trainer=async_grpo (no reference model)")
            setup.check("sleep_level", self.sleep_level == 0, self.sleep_level,
                        "0 with train.trainer=async_grpo (the engine generates while the trainer trains)")
        setup.check("grpo", isinstance(self.grpo, dict), self.grpo, "a mapping of GRPOConfig fields")


ROLLOUT_MODES = ("engine", "partial", "server")


@dataclass(frozen=True, slots=True)
class RolloutMode:
    """Where and how generation runs. ``engine``: in this process, each step waits for all its groups;
    ``partial``: in this process, partial rollouts (the main job's ``rollout.mode=partial``: complete groups
    handed out as they finish, the rest carried into later steps; ``TRLRollout(mode="partial")`` / the async
    worker's staleness control); ``server``: a running rollout-serve at ``url``. The other keys are the
    main job's partial-mode keys (rollout/conf/rollout/default.yaml)."""

    mode: str = "engine"
    url: str = "http://127.0.0.1:8000"
    max_inflight_groups: int | None = None  # partial, grpo: groups in the engine at a step's start; null = 2x its
    max_staleness: int | None = None  # partial: max versions between a group's oldest token and the weights
    stale_groups: str = "drop"  # partial, grpo: a group over max_staleness is dropped (counted) | regenerated
    recompute_running: bool = True  # partial: carried-over KV recomputed under new weights (one prefill each)

    def __post_init__(self) -> None:
        check_choice("rollout.mode", self.mode, ROLLOUT_MODES)
        if not isinstance(self.url, str) or not self.url.startswith("http://"):
            raise ValueError(f"rollout.url={self.url!r} is invalid: must be an http://host:port address")
        check_partial_keys(self, self.mode == "partial")

    def rollout_kwargs(self) -> dict[str, Any]:
        """``TRLRollout``'s partial-mode arguments (none in the other modes: their defaults)."""
        if self.mode != "partial":
            return {}
        return {"mode": "partial", "max_inflight_groups": self.max_inflight_groups,
                "max_staleness": self.max_staleness, "stale_groups": self.stale_groups,
                "recompute_running": self.recompute_running}


def load_config(raw: dict[str, Any]) -> tuple[RunConfig, TrainConfig, RolloutMode]:
    """The shared groups through RunConfig (same checks and messages as the main job), plus ``train``
    and ``rollout`` (where generation runs)."""
    raw = dict(raw)
    rollout = dict(raw.pop("rollout", None) or {})
    allowed = [f.name for f in dataclasses.fields(RolloutMode)]
    unknown = sorted(set(rollout) - set(allowed))
    if unknown:
        raise ValueError(f"unknown key(s) {[f'rollout.{k}' for k in unknown]}; allowed: {allowed}")
    mode = RolloutMode(**rollout)
    job, train = setup.load_job(raw, TrainConfig)
    if job.sampling.n < 2:
        raise ValueError(f"sampling.n={job.sampling.n} is invalid for GRPO: must be >= 2 (a group needs a baseline)")
    check_passthrough(train, config_class(train.trainer))  # before anything loads
    if mode.mode == "server" and train.trainer != "grpo":
        raise ValueError("rollout.mode=server needs train.trainer=grpo (TRLRollout over a RolloutClient)")
    if mode.mode == "server" and train.sleep_level:
        raise ValueError("train.sleep_level must be 0 with rollout.mode=server (the server has its own GPUs)")
    if mode.mode == "partial":
        if train.sleep_level:
            raise ValueError("train.sleep_level must be 0 with rollout.mode=partial (carried-over groups keep "
                             "their KV cache between steps)")
        if train.trainer == "async_grpo" and (mode.max_inflight_groups is not None or mode.stale_groups != "drop"):
            raise ValueError("rollout.max_inflight_groups must be null and rollout.stale_groups drop with "
                             "train.trainer=async_grpo (its worker keeps AsyncGRPOConfig's in-flight count and "
                             "drops stale groups)")
    if job.pool.replicas > 1:
        if mode.mode != "engine" or train.trainer != "grpo":
            raise ValueError(f"pool.replicas={job.pool.replicas} needs rollout.mode=engine and train.trainer=grpo "
                             "(TRLRollout over the pool)")
    return job, train, mode


def run(cfg: DictConfig) -> Path:
    """Train as the composed config says; returns output_dir. Used by main() and by tests."""
    return train_grpo(*load_config(resolved_config(cfg)))


def train_grpo(job: RunConfig, train: TrainConfig, mode: RolloutMode | None = None) -> Path:
    from transformers import PrinterCallback

    from rollout.rl.rewards import load_reward

    out = Path(job.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    setup.torch_threads(train.torch_threads)
    checkpoint = setup.model_dir(job)
    tokenizer = setup.load_tokenizer(job, checkpoint)
    dataset = setup.build_dataset(job.data, tokenizer, train.reward)
    reward = load_reward(train.reward, "train.reward")
    device = setup.trainer_device(job)
    if mode is not None and mode.mode == "server":  # the server holds the engine; weights go to it each step
        from trainer_hooks.client import RolloutClient

        engine: Any = RolloutClient(mode.url)
        if not engine.health():
            raise ValueError(f"rollout.url={mode.url!r}: no rollout server answers there (start rollout-serve)")
    else:
        engine = setup.make_engine(job, checkpoint, tokenizer, train.torch_threads)
    args = trainer_args(job, train, device, report_to=setup.wandb_env(job.logger.wandb, out))
    run_config = {"job": job.to_dict(), "train": dataclasses.asdict(train)}
    rollout = None
    if train.trainer == "grpo":
        import torch
        from transformers import AutoModelForCausalLM

        from trainer_hooks.grpo import EngineGRPOTrainer
        from trainer_hooks.trl import TRLRollout

        model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32)
        rollout = TRLRollout(engine, sleep_level=train.sleep_level, run_config=run_config,
                             **(mode.rollout_kwargs() if mode is not None else {}))
        trainer = EngineGRPOTrainer(model=model, reward_funcs=[reward], args=args, train_dataset=dataset,
                                    processing_class=tokenizer, rollout_func=rollout)
    else:
        from trainer_hooks.async_trainer import EngineAsyncGRPOTrainer

        partial = mode is not None and mode.mode == "partial"
        trainer = EngineAsyncGRPOTrainer(str(checkpoint), engine, [reward], args, dataset, tokenizer,
                                         run_config=run_config, max_staleness=mode.max_staleness if partial else None,
                                         recompute_running=mode.recompute_running if partial else True)
    steps = StepCallback(out, train.reward, rollout)
    trainer.add_callback(steps)
    trainer.remove_callback(PrinterCallback)  # its raw dict per step is replaced by StepLog's line
    log.info("GRPO (%s) on %s: %d steps x %d prompts x %d samples, reward %s, trainer on %s",
             train.trainer, checkpoint.name, train.steps, job.data.num_prompts, job.sampling.n, train.reward, device)
    exit_code = 1
    try:
        trainer.train()
        if rollout is not None:
            rollout.close()  # partial mode: the groups still in flight are never handed out
        exit_code = 0
    finally:
        setup.finish_wandb(exit_code)
        setup.close_engine(job, engine)  # a pool's Ray actors
    log.info(steps.log.summary())
    return out


def config_class(trainer: str) -> type:
    if trainer == "grpo":
        from trl import GRPOConfig

        return GRPOConfig
    from trl.experimental.async_grpo import AsyncGRPOConfig

    return AsyncGRPOConfig


def check_passthrough(train: TrainConfig, cls: type) -> None:
    """``train.grpo.*`` must name fields of the trainer's config class that this script does not derive."""
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    for key in train.grpo:
        if key in DERIVED:
            raise ValueError(f"train.grpo.{key} is set by this script from {DERIVED[key]}; set that instead")
        if key not in fields:
            close = difflib.get_close_matches(key, sorted(fields), n=3)
            hint = f"; did you mean {close}?" if close else ""
            raise ValueError(f"train.grpo.{key} is not a field of trl.{cls.__name__} (train.trainer="
                             f"{train.trainer}){hint} Allowed: any of its {len(fields)} fields except "
                             f"{sorted(DERIVED)}")


def trainer_args(job: RunConfig, train: TrainConfig, device: Any, report_to: list[str]) -> Any:
    """GRPOConfig (or AsyncGRPOConfig): one optimizer step per generation batch of num_prompts groups."""
    s = job.sampling
    extra = dict(train.grpo)
    batch = job.data.num_prompts * s.n
    accumulation = int(extra.pop("gradient_accumulation_steps", 1))
    if accumulation < 1 or batch % accumulation:
        raise ValueError(f"train.grpo.gradient_accumulation_steps={accumulation} must be >= 1 and divide "
                         f"data.num_prompts * sampling.n = {batch}")
    values: dict[str, Any] = dict(
        output_dir=job.output_dir, max_steps=train.steps, learning_rate=train.learning_rate,
        logging_steps=train.logging_steps, seed=train.seed, max_grad_norm=train.max_grad_norm,
        num_generations=s.n, max_completion_length=s.max_tokens, temperature=s.temperature, top_p=s.top_p,
        top_k=s.top_k, min_p=s.min_p or None, per_device_train_batch_size=batch // accumulation,
        gradient_accumulation_steps=accumulation, use_cpu=device.type == "cpu",
        bf16=device.type == "cuda", report_to=report_to, save_strategy="no",
        disable_tqdm=not job.logger.progress, run_name=job.logger.wandb.name,
    )
    kwargs = {"min_tokens": s.min_tokens, "stop": list(s.stop) or None, "ignore_eos": s.ignore_eos, "seed": s.seed}
    cls = config_class(train.trainer)
    if train.trainer == "grpo":
        values.update(beta=train.beta, shuffle_dataset=job.data.shuffle, generation_kwargs=kwargs,
                      vllm_importance_sampling_mode="token_truncate")  # truncated IS per token, as TRL for vLLM
    else:
        if any(v not in (None, 0, False) for v in kwargs.values()):
            raise ValueError("sampling.min_tokens / stop / ignore_eos / seed are not used by train.trainer=async_grpo")
        values.update(gradient_checkpointing=False, token_budget=0)
    values.update(extra)
    try:
        return cls(**values)
    except (TypeError, ValueError) as e:
        raise ValueError(f"trl.{cls.__name__} refused the settings (train.grpo.* and the derived ones): {e}") from None


class StepCallback(TrainerCallback):
    """Per logged step: StepLog's line + metrics.jsonl; per optimizer step (GRPO): the time split."""

    def __init__(self, out: Path, reward_name: str, rollout: Any = None) -> None:
        self.log = setup.StepLog(out / "metrics.jsonl", reward_name)
        self.rollout = rollout
        self.times = StepTimes(out / "step_times.json")
        self._t0 = 0.0
        self._seconds: dict[str, float] = {}

    def on_step_begin(self, args: Any, state: Any, control: Any, **_: Any) -> None:
        self._t0 = time.perf_counter()
        self._seconds = dict(self.rollout.seconds) if self.rollout is not None else {}

    def on_step_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
        if self.rollout is None:
            return
        now = self.rollout.seconds
        self.times.add(state.global_step, time.perf_counter() - self._t0,
                       now["generation"] - self._seconds["generation"],
                       now["weight_push"] - self._seconds["weight_push"])

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **_: Any) -> None:
        if logs:
            self.log.add(state.global_step, logs)


@hydra.main(version_base="1.3", config_path="../conf", config_name="train_grpo")
def main(cfg: DictConfig) -> None:
    quiet_progress_bars()
    run_or_exit(run, cfg, log)


if __name__ == "__main__":
    main()
