"""PPO on the rollout engine: policy + value model, GAE, clipped losses, KL to a frozen reference.

    rollout-train-ppo                                         # embedded tiny Llama, CPU, a couple of minutes
    rollout-train-ppo model=qwen3-0.6b engine=h200 train.steps=200 train.reward=exact_match
    rollout-train-ppo train.reward=my_pkg.rewards:score train.ppo.kl_coef=0.05 train.sleep_level=1
    rollout-train-ppo pool.replicas=2 pool.gpus_per_replica=0 # a RolloutPool of 2 Ray actors generates

(``python scripts/train_ppo.py ...`` from the repo root does the same.) The engine samples with the
policy's weights, pushed after every optimizer step (``trainer_hooks.ppo_loop.EnginePPO``); its logprobs
are the behaviour policy's. ``pool.replicas`` > 1 generates with a ``RolloutPool`` built as for
train_grpo.py (``train_setup.make_engine``); each push is broadcast to every replica. Logs a line per step
(Hydra's log file too), writes output_dir/metrics.jsonl and step_times.json, and a W&B run (offline by
default) with ``ppo/*``, ``rollout/*`` (a pool's per replica under ``rollout/pool/``) and the engine's
resolved config. User errors are checked before loading; the script logs ``error: ...`` and exits with 2.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig

from rollout.cli import quiet_progress_bars, resolved_config, run_or_exit
from rollout.settings.schema import RunConfig
from trainer_hooks import train_setup as setup
from trainer_hooks.engine_metrics import StepTimes
from trainer_hooks.ppo import PPO_FIELDS, PPOConfig

log = logging.getLogger("rollout.train")


@dataclass(frozen=True, slots=True)
class TrainConfig:
    steps: int = 20
    learning_rate: float = 5e-3
    reward: str = "digit_fraction"
    max_grad_norm: float = 1.0
    logging_steps: int = 1
    seed: int = 0
    torch_threads: int | None = 1
    sleep_level: int = 0
    bf16: bool | None = None
    ppo: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        setup.check_common(self)
        setup.check("bf16", self.bf16 is None or isinstance(self.bf16, bool), self.bf16, "true, false or null")
        setup.check("ppo", isinstance(self.ppo, dict), self.ppo, "a mapping of PPOConfig fields")
        for key in self.ppo:
            if key in ("learning_rate", "max_grad_norm"):
                raise ValueError(f"train.ppo.{key}: set train.{key} instead")
            if key not in PPO_FIELDS:
                raise ValueError(f"unknown key train.ppo.{key}; allowed: "
                                 f"{sorted(set(PPO_FIELDS) - {'learning_rate', 'max_grad_norm'})}")

    def ppo_config(self) -> PPOConfig:
        return PPOConfig(**self.ppo, learning_rate=self.learning_rate, max_grad_norm=self.max_grad_norm)


def load_config(raw: dict[str, Any]) -> tuple[RunConfig, TrainConfig]:
    job, train = setup.load_job(raw, TrainConfig)
    train.ppo_config()  # its checks run before anything loads
    if job.sampling.temperature <= 0:
        raise ValueError(f"sampling.temperature={job.sampling.temperature} is invalid for PPO: must be > 0")
    return job, train


def run(cfg: DictConfig, on_push: Any = None) -> Path:
    """Train as the composed config says; returns output_dir. Used by main() and by tests (``on_push``
    is called with the ``EnginePPO`` after every weight push)."""
    job, train = load_config(resolved_config(cfg))
    return train_ppo(job, train, on_push)


def train_ppo(job: RunConfig, train: TrainConfig, on_push: Any = None) -> Path:
    import torch
    from transformers import AutoModelForCausalLM

    from rollout.rl.rewards import load_reward
    from rollout.rl.wandb_logger import WandbLogger
    from trainer_hooks.ppo import ValueModel
    from trainer_hooks.ppo_loop import EnginePPO, batches

    out = Path(job.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    setup.torch_threads(train.torch_threads)
    torch.manual_seed(train.seed)
    checkpoint = setup.model_dir(job)
    tokenizer = setup.load_tokenizer(job, checkpoint)
    dataset = setup.build_dataset(job.data, tokenizer, train.reward)
    reward = load_reward(train.reward, "train.reward")
    engine = setup.make_engine(job, checkpoint, tokenizer, train.torch_threads)
    device = setup.trainer_device(job)
    cuda = device.type == "cuda"
    policy = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).to(device)
    ref = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.bfloat16 if cuda else torch.float32)
    value = ValueModel.from_pretrained(str(checkpoint), dtype=torch.float32).to(device)
    bf16 = cuda if train.bf16 is None else train.bf16
    ppo = EnginePPO(engine, policy, value, ref.to(device), tokenizer, reward, train.ppo_config(),
                    job.sampling.to_params(), sleep_level=train.sleep_level, bf16=bf16, on_push=on_push)
    config = {"job": job.to_dict(), "train": dataclasses.asdict(train), "engine": engine.describe()}
    wandb = WandbLogger(job.logger.wandb, out, config)
    steps_log, times = setup.StepLog(out / "metrics.jsonl", train.reward), StepTimes(out / "step_times.json")
    log.info("PPO on %s: %d steps x %d prompts x %d samples, reward %s, engine on %s", checkpoint.name, train.steps,
             job.data.num_prompts, job.sampling.n, train.reward, device)
    exit_code = 1
    try:
        rows = batches(dataset, job.data.num_prompts, job.data.seed, job.data.shuffle)
        for step in range(1, train.steps + 1):
            before, t0 = dict(ppo.seconds), time.perf_counter()
            metrics = ppo.step(next(rows))
            split = times.add(step, time.perf_counter() - t0, ppo.seconds["generation"] - before["generation"],
                              ppo.seconds["weight_push"] - before["weight_push"])
            metrics.update({f"time/{k}": v for k, v in split.items() if k != "step"})
            if step % train.logging_steps == 0 or step == train.steps:
                steps_log.add(step, metrics)
                wandb.log_step({"train/global_step": step, **metrics})
        exit_code = 0
    finally:
        wandb.finish(exit_code)
        setup.close_engine(job, engine)  # a pool's Ray actors
    log.info(steps_log.summary())
    return out


@hydra.main(version_base="1.3", config_path="../conf", config_name="train_ppo")
def main(cfg: DictConfig) -> None:
    quiet_progress_bars()
    run_or_exit(run, cfg, log)


if __name__ == "__main__":
    main()
