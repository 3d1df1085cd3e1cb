"""Presets (rollout/conf/model, rollout/conf/engine), hub names, console entry points: compose, validate."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest
import tomllib
from omegaconf import OmegaConf

from rollout.job.config import JobConfig
from tests.script_helpers import CONF, ROOT, compose

MODEL_PRESETS = {  # preset -> (hub name, max_model_len)
    "qwen3-0.6b": ("Qwen/Qwen3-0.6B", 40960), "qwen3-8b": ("Qwen/Qwen3-8B", 40960),
    "qwen2.5-1.5b": ("Qwen/Qwen2.5-1.5B-Instruct", 32768), "qwen2.5-7b": ("Qwen/Qwen2.5-7B-Instruct", 32768),
    "llama3-8b": ("meta-llama/Llama-3.1-8B-Instruct", 32768),
    "mistral-7b": ("mistralai/Mistral-7B-Instruct-v0.3", 32768),
}


def _raw(config_name: str, *overrides: str) -> dict:
    return OmegaConf.to_container(compose(config_name, "output_dir=/tmp/unused", *overrides), resolve=True)


@pytest.mark.parametrize("config_name, preset", [("config", p) for p in sorted(MODEL_PRESETS)]
                         + [("train_grpo", "qwen3-8b"), ("train_ppo", "mistral-7b")])
def test_model_presets_compose_and_validate(config_name, preset):
    raw = _raw(config_name, f"model={preset}", "engine=h200")
    if config_name == "config":
        job = JobConfig.from_dict(raw)
    else:
        job = importlib.import_module(f"rollout.cli.{config_name}").load_config(raw)[0]
    assert (job.model.path, job.engine.max_model_len) == MODEL_PRESETS[preset]
    assert job.data.apply_chat_template is True and job.model.dtype == "auto"
    assert job.engine.max_num_seqs == 256  # the engine preset still applies
    over = JobConfig.from_dict(_raw("config", f"model={preset}", "engine.max_model_len=4096"))
    assert over.engine.max_model_len == 4096  # the command line wins over the preset


def test_engine_presets():
    cpu = JobConfig.from_dict(_raw("config", "engine=cpu")).engine
    assert (cpu.async_mode, cpu.cuda_graphs, cpu.attention_backend) == (False, False, "torch")
    assert cpu.cpu_kv_cache_gib == 2.0
    from rollout.cli import train_ppo

    h200 = train_ppo.load_config(_raw("train_ppo", "engine=h200"))[0].engine
    assert (h200.max_num_seqs, h200.max_graph_batch_size, h200.gpu_memory_utilization) == (256, 512, 0.9)


def test_unknown_preset_lists_what_exists():
    from hydra.errors import MissingConfigException

    with pytest.raises(MissingConfigException) as info:
        compose("train_grpo", "model=qwen4")
    assert all(name in str(info.value) for name in [*MODEL_PRESETS, "default"]), str(info.value)
    with pytest.raises(MissingConfigException, match="h200"):
        compose("config", "engine=b200")


def test_hub_name_offline_says_so(monkeypatch):
    import huggingface_hub

    from rollout.settings.model import is_hub_name, resolve_model_path

    def offline(**_):
        raise huggingface_hub.errors.LocalEntryNotFoundError("outgoing traffic has been disabled")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    assert is_hub_name("Qwen/Qwen3-0.6B") and not is_hub_name(str(CONF))
    with pytest.raises(ValueError, match=r"model.path='Qwen/Qwen3-0.6B' .*snapshot_download could not fetch it "
                                         r"\(LocalEntryNotFoundError.*Offline"):
        resolve_model_path("Qwen/Qwen3-0.6B")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model_path("/no/such/dir")


def test_console_entry_points_are_modules():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"rollout-run": "rollout.job.main:main", "rollout-serve": "rollout.cli.serve:main",
                       "rollout-train-grpo": "rollout.cli.train_grpo:main",
                       "rollout-train-ppo": "rollout.cli.train_ppo:main"}
    for name in ("train_grpo", "train_ppo", "serve"):  # scripts/ only wraps the module's main
        text = (ROOT / "scripts" / f"{name}.py").read_text()
        assert f"from rollout.cli.{name} import main" in text and "runpy" not in text and len(text.splitlines()) < 15
        assert "sys.path.insert" not in text and "sys.path.append" not in text
    # `--cfg job` through the entry point: Hydra composes from rollout/conf and prints the job config.
    code = ("import sys; sys.argv = ['rollout-train-grpo', '--cfg', 'job', 'model=qwen3-0.6b', 'engine=h200']; "
            "from rollout.cli.train_grpo import main; main()")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code], cwd="/", env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    printed = OmegaConf.create(done.stdout)
    assert printed.model.path == "Qwen/Qwen3-0.6B" and printed.engine.max_model_len == 40960
    assert printed.train.trainer == "grpo"


def test_an_unresolvable_config_is_a_user_error():
    from rollout.cli import resolved_config

    assert resolved_config(OmegaConf.create({"a": "${b}", "b": 1})) == {"a": 1, "b": 1}
    unresolved = OmegaConf.create({"output_dir": "${hydra:runtime.output_dir}"})
    with pytest.raises(ValueError, match=r"(?s)^the config does not resolve: .*\(outside a Hydra run, set output_dir="):
        resolved_config(unresolved)
    with pytest.raises(ValueError, match=r"(?s)^the config does not resolve: (?!.*outside a Hydra run)"):
        resolved_config(unresolved, hint="")
