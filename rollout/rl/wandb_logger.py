"""Weights & Biases logging for the rollout job and the PPO script: offline by default, the run dir under output_dir.

wandb is imported only when ``mode != "disabled"``, so tests and users without it pay nothing. Round
metrics go against a ``round`` axis and step metrics against an ``engine_step`` axis (define_metric), so
the two cadences never fight over wandb's own step counter.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rollout.settings.schema import WandbConfig


class WandbLogger:
    def __init__(self, cfg: WandbConfig, output_dir: str | Path, config: Mapping[str, Any]) -> None:
        self.cfg = cfg
        self.run: Any = None
        self.wandb_module: Any = None  # the imported wandb package (None when disabled): tests may stand in for it
        if cfg.mode == "disabled":
            return
        import wandb

        self.wandb_module = wandb
        settings = wandb.Settings(
            silent=cfg.mode == "offline",  # online keeps wandb's own lines: they carry the run URL
            console="off",  # no stdout capture: keeps the tqdm bar intact
            disable_git=True,
            save_code=False,
        )
        try:
            self.run = wandb.init(
                project=cfg.project,
                entity=cfg.entity,
                name=cfg.name,
                group=cfg.group,
                tags=list(cfg.tags) or None,
                mode=cfg.mode,
                dir=str(output_dir),
                config=dict(config),
                settings=settings,
                reinit="create_new",
            )
        except Exception as e:  # wandb raises its own types (UsageError, CommError, ...): name the switch
            raise ValueError(
                f"logger.wandb.mode={cfg.mode!r}: wandb.init failed ({type(e).__name__}: {e}); "
                "use logger.wandb.mode=offline or disabled to run without a W&B account"
            ) from None
        self.run.define_metric("round")
        self.run.define_metric("round/*", step_metric="round")
        self.run.define_metric("pool/*", step_metric="round")
        self.run.define_metric("engine_step")
        self.run.define_metric("step/*", step_metric="engine_step")

    @property
    def enabled(self) -> bool:
        return self.run is not None

    @property
    def run_dir(self) -> Path | None:
        """The run's own directory (holding the .wandb file), or None when disabled."""
        return Path(self.run.dir).parent if self.run is not None else None

    def log_round(self, metrics: Mapping[str, Any], histograms: Mapping[str, Sequence[float]]) -> None:
        """Scalars as ``round/<key>`` (a pool's ``pool/...`` keys as they are); each list in ``histograms``
        (e.g. completion_len, staleness) as ``round/<name>_hist`` (metrics.jsonl keeps its own dict form,
        such as staleness_hist)."""
        if self.run is None:
            return
        row: dict[str, Any] = {"round": metrics["round"]}
        for key, value in metrics.items():
            if key != "round" and value is not None and not isinstance(value, Mapping):
                row[key if key.startswith("pool/") else f"round/{key}"] = value
        for name, values in histograms.items():
            if values:
                row[f"round/{name}_hist"] = self.wandb_module.Histogram(list(values))
        self.run.log(row)

    def log_step(self, metrics: Mapping[str, float]) -> None:
        if self.run is not None:
            self.run.log(dict(metrics))

    def finish(self, exit_code: int = 0) -> None:
        if self.run is not None:
            self.run.finish(exit_code=exit_code)
            self.run = None
