"""GRPO with TRL, generating with the rollout engine, which follows the trainer's weights step by step.

    python scripts/train_grpo.py                              # embedded tiny Llama, CPU, a few minutes
    python scripts/train_grpo.py train.steps=100 train.reward=exact_match model.path=/ckpt
    python scripts/train_grpo.py train.trainer=async_grpo     # TRL's AsyncGRPOTrainer, engine in-process
    python scripts/train_grpo.py rollout.mode=server rollout.url=http://127.0.0.1:8000  # against scripts/serve.py

Configured like the main job (conf/train_grpo.yaml reuses its groups). Prints the reward of every step,
writes output_dir/metrics.jsonl (one line per logged step) and logs to W&B (offline by default).
Everything a user can get wrong is checked before loading; the script then prints ``error: ...`` and
exits with status 2.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# scripts/rollout.py is named like the package: drop this directory from the path so `import rollout`
# finds the package.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or os.curdir).resolve() != _HERE]

import hydra  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402
from omegaconf.errors import OmegaConfBaseException  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from rollout.job.config import DataConfig, JobConfig, WandbConfig  # noqa: E402
from rollout.job.rewards import exact_match  # noqa: E402
from trainer_hooks.trl import digit_fraction  # noqa: E402

TRAINERS = ("grpo", "async_grpo")
TRAIN_REWARDS = {"digit_fraction": digit_fraction, "exact_match": exact_match}
USER_ERRORS = (ValueError, FileNotFoundError)


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

    def __post_init__(self) -> None:
        _check("trainer", self.trainer in TRAINERS, self.trainer, f"one of {list(TRAINERS)}")
        _check("reward", self.reward in TRAIN_REWARDS, self.reward, f"one of {sorted(TRAIN_REWARDS)}")
        for key in ("steps", "logging_steps"):
            _check(key, _is_int(getattr(self, key)) and getattr(self, key) >= 1, getattr(self, key), "an int >= 1")
        _check("seed", _is_int(self.seed) and self.seed >= 0, self.seed, "an int >= 0")
        for key in ("learning_rate", "max_grad_norm"):
            value = getattr(self, key)
            _check(key, _is_num(value) and value > 0, value, "a number > 0")
        _check("beta", _is_num(self.beta) and self.beta >= 0, self.beta, "a number >= 0")
        if self.trainer == "async_grpo":
            _check("beta", self.beta == 0, self.beta, "0 with train.trainer=async_grpo (no reference model)")
        threads = self.torch_threads
        _check("torch_threads", threads is None or (_is_int(threads) and threads >= 1), threads, "an int >= 1 or null")


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v


def _check(key: str, ok: bool, value: object, allowed: str) -> None:
    if not ok:
        raise ValueError(f"train.{key}={value!r} is invalid: must be {allowed}")


@dataclass(frozen=True, slots=True)
class RolloutMode:
    mode: str = "engine"  # engine: in this process; server: a running scripts/serve.py at `url`
    url: str = "http://127.0.0.1:8000"

    def __post_init__(self) -> None:
        if self.mode not in ("engine", "server"):
            raise ValueError(f"rollout.mode={self.mode!r} is invalid: must be one of ['engine', 'server']")
        if not isinstance(self.url, str) or not self.url.startswith("http://"):
            raise ValueError(f"rollout.url={self.url!r} is invalid: must be an http://host:port address")


def load_config(raw: dict[str, Any]) -> tuple[JobConfig, TrainConfig, RolloutMode]:
    """The shared groups through JobConfig (same checks and messages as the main job), plus ``train``
    and ``rollout`` (where generation runs)."""
    raw = dict(raw)
    rollout = dict(raw.pop("rollout", None) or {})
    unknown = sorted(set(rollout) - {"mode", "url"})
    if unknown:
        raise ValueError(f"unknown key(s) {[f'rollout.{k}' for k in unknown]}; allowed: ['mode', 'url']")
    train = dict(raw.pop("train", None) or {})
    unknown = sorted(set(train) - {f.name for f in dataclasses.fields(TrainConfig)})
    if unknown:
        raise ValueError(f"unknown key(s) {[f'train.{k}' for k in unknown]}; allowed: "
                         f"{sorted(f.name for f in dataclasses.fields(TrainConfig))}")
    job = JobConfig.from_dict(raw)
    if job.sampling.logprobs_mode != "policy":
        raise ValueError(f"sampling.logprobs_mode={job.sampling.logprobs_mode!r} is invalid for training: "
                         "must be 'policy' (the logprob the trainer recomputes)")
    if job.sampling.n < 2:
        raise ValueError(f"sampling.n={job.sampling.n} is invalid for GRPO: must be >= 2 (a group needs a baseline)")
    mode = RolloutMode(**rollout)
    if mode.mode == "server" and train.get("trainer", "grpo") != "grpo":
        raise ValueError("rollout.mode=server needs train.trainer=grpo (TRLRollout over a RolloutClient)")
    return job, TrainConfig(**train), mode


def run(cfg: DictConfig) -> Path:
    """Train as the composed config says; returns output_dir. Used by main() and by tests."""
    try:
        raw = OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as e:
        raise ValueError(f"the config does not resolve: {e} (outside a Hydra run, set output_dir=...)") from None
    return train_grpo(*load_config(raw))  # type: ignore[arg-type]


def train_grpo(job: JobConfig, train: TrainConfig, mode: RolloutMode | None = None) -> Path:
    import torch
    from transformers import AutoTokenizer

    from rollout import Engine
    from rollout.assets import check_checkpoint_dir, materialize_default_model
    from trainer_hooks.trl import trl_reward

    out = Path(job.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    if train.torch_threads is not None:
        torch.set_num_threads(train.torch_threads)
    model_dir = (check_checkpoint_dir(job.model.path) if job.model.path is not None
                 else materialize_default_model(job.model.cache_dir, seed=job.model.seed))
    tokenizer = AutoTokenizer.from_pretrained(str(job.model.tokenizer or model_dir))
    dataset = build_dataset(job.data, tokenizer, need_answer=train.reward == "exact_match")
    if mode is not None and mode.mode == "server":  # the server holds the engine; weights go to it each step
        from trainer_hooks.client import RolloutClient

        engine: Any = RolloutClient(mode.url)
        if not engine.health():
            raise ValueError(f"rollout.url={mode.url!r}: no rollout server answers there (start scripts/serve.py)")
        engine.device = torch.device(job.model.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    else:
        engine = Engine.from_pretrained(str(model_dir), dtype=job.model.dtype, device=job.model.device,
                                        tokenizer=tokenizer, **dataclasses.asdict(job.engine))
    reward = trl_reward(TRAIN_REWARDS[train.reward], train.reward)
    args = trainer_args(job, train, engine, report_to=wandb_env(job.logger.wandb, out))
    if train.trainer == "grpo":
        from transformers import AutoModelForCausalLM
        from trl import GRPOTrainer

        from trainer_hooks.trl import TRLRollout

        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=args, train_dataset=dataset,
                              processing_class=tokenizer, rollout_func=TRLRollout(engine))
    else:
        from trainer_hooks.async_grpo import build_async_grpo_trainer

        trainer = build_async_grpo_trainer(str(model_dir), engine, [reward], args, dataset, tokenizer)
    printer = StepPrinter(out / "metrics.jsonl", train.reward)
    trainer.add_callback(printer)
    where = f"server {mode.url}" if mode is not None and mode.mode == "server" else f"engine on {engine.device}"
    print(f"GRPO ({train.trainer}) on {model_dir.name}: {train.steps} steps x {job.data.num_prompts} prompts x "
          f"{job.sampling.n} samples, reward {train.reward}, {where}", flush=True)
    trainer.train()
    print(printer.summary(), flush=True)
    return out


def build_dataset(cfg: DataConfig, tokenizer: Any, need_answer: bool) -> Any:
    """``prompt`` (chat messages when templated, as TRL expects) and ``answer`` columns from data.*."""
    from rollout.job.data import load_rows

    rows = load_rows(cfg)
    fields = list(rows.column_names)
    where = cfg.path or "the embedded dataset"
    if cfg.prompt_field not in fields:
        raise ValueError(f"data.prompt_field={cfg.prompt_field!r} is not a field of {where!r}; its fields are {fields}")
    answer = cfg.answer_field if cfg.answer_field in fields else None
    if need_answer and answer is None:
        raise ValueError(f"train.reward=exact_match needs answers but data.answer_field={cfg.answer_field!r} "
                         f"is not a field of {where!r}; its fields are {fields}")
    has_template = getattr(tokenizer, "chat_template", None) is not None
    template = has_template if cfg.apply_chat_template == "auto" else bool(cfg.apply_chat_template)

    def convert(row: dict[str, Any]) -> dict[str, Any]:
        prompt = row[cfg.prompt_field]
        messages = isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt)
        if not (isinstance(prompt, str) or messages):
            raise ValueError(f"data.prompt_field={cfg.prompt_field!r}: training needs text or chat messages, "
                             f"got {prompt!r:.100}")
        if isinstance(prompt, str) and template:
            prompt = [{"role": "user", "content": prompt}]
        return {"prompt": prompt, "answer": None if answer is None else str(row[answer])}

    return rows.map(convert, remove_columns=fields)


def trainer_args(job: JobConfig, train: TrainConfig, engine: Any, report_to: list[str]) -> Any:
    """GRPOConfig (or AsyncGRPOConfig): one optimizer step per generation batch of num_prompts groups."""
    s = job.sampling
    values: dict[str, Any] = dict(
        output_dir=job.output_dir, max_steps=train.steps, learning_rate=train.learning_rate,
        logging_steps=train.logging_steps, seed=train.seed, max_grad_norm=train.max_grad_norm,
        num_generations=s.n, max_completion_length=s.max_tokens, temperature=s.temperature, top_p=s.top_p,
        top_k=s.top_k, min_p=s.min_p or None, per_device_train_batch_size=job.data.num_prompts * s.n,
        gradient_accumulation_steps=1, use_cpu=engine.device.type == "cpu", bf16=False, report_to=report_to,
        save_strategy="no", disable_tqdm=not job.logger.progress, run_name=job.logger.wandb.name,
    )
    extra = {"min_tokens": s.min_tokens, "stop": list(s.stop) or None, "ignore_eos": s.ignore_eos, "seed": s.seed}
    if train.trainer == "grpo":
        from trl import GRPOConfig

        return GRPOConfig(**values, beta=train.beta, shuffle_dataset=job.data.shuffle, generation_kwargs=extra)
    from trl.experimental.async_grpo import AsyncGRPOConfig

    if any(v not in (None, 0, False) for v in extra.values()):
        raise ValueError("sampling.min_tokens / stop / ignore_eos / seed are not used by train.trainer=async_grpo")
    return AsyncGRPOConfig(**values, gradient_checkpointing=False, token_budget=0)


def wandb_env(cfg: WandbConfig, output_dir: Path) -> list[str]:
    """``report_to`` for the trainer; transformers' W&B callback reads the rest from the environment."""
    if cfg.mode == "disabled":
        return ["none"]
    env = {"WANDB_MODE": cfg.mode, "WANDB_PROJECT": cfg.project, "WANDB_DIR": str(output_dir),
           "WANDB_DISABLE_GIT": "true", "WANDB_CONSOLE": "off"}
    if cfg.mode == "offline":
        env["WANDB_SILENT"] = "true"
    for key, value in (("WANDB_ENTITY", cfg.entity), ("WANDB_RUN_GROUP", cfg.group),
                       ("WANDB_TAGS", ",".join(cfg.tags) or None)):
        if value:
            env[key] = value
    os.environ.update(env)
    return ["wandb"]


class StepPrinter(TrainerCallback):
    """Prints the reward of every logged step and appends the step's logs to metrics.jsonl."""

    def __init__(self, path: Path, reward_name: str) -> None:
        self.path, self.reward_name = path, reward_name
        self.rewards: list[float] = []

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **_: Any) -> None:
        if not logs or "reward" not in logs:
            return
        self.rewards.append(float(logs["reward"]))
        length = logs.get("completions/mean_length", logs.get("rollout/completion_len_mean", float("nan")))
        print(f"step {state.global_step:4d}  reward {logs['reward']:.3f} (std {logs.get('reward_std', 0):.3f})  "
              f"completion length {length:.1f}", flush=True)
        with self.path.open("a") as f:
            f.write(json.dumps({"step": state.global_step, **logs}, default=float) + "\n")

    def summary(self) -> str:
        r = self.rewards
        if not r:
            return "no reward was logged"
        k = max(1, len(r) // 5)
        return (f"{self.reward_name}: mean of the first {k} steps {sum(r[:k]) / k:.3f} -> "
                f"last {k} steps {sum(r[-k:]) / k:.3f}")


@hydra.main(version_base="1.3", config_path="../conf", config_name="train_grpo")
def main(cfg: DictConfig) -> None:
    try:
        run(cfg)
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)


if __name__ == "__main__":
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    main()
