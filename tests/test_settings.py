"""rollout.settings.schema.parse_section: the one parser of config sections the job, the server and the training
scripts share."""

from __future__ import annotations

import pytest

from rollout.config import EngineConfig
from rollout.serve.config import ServeConfig
from rollout.settings.schema import LoggerConfig, RunConfig, SamplingConfig, parse_section


def test_nested_sections_lists_and_nulls() -> None:
    logger = parse_section(LoggerConfig, "logger", {"progress": False, "wandb": {"tags": ["a", "b"]}})
    assert logger.wandb.tags == ("a", "b") and logger.progress is False
    assert parse_section(SamplingConfig, "sampling", None) == SamplingConfig()
    run = RunConfig.from_dict({"output_dir": "out", "logger": None, "engine": {"block_size": 32}})
    assert run.logger == LoggerConfig() and run.engine == EngineConfig(block_size=32)


@pytest.mark.parametrize(("cls", "raw", "message"), [
    (LoggerConfig, {"wandb": {"colour": 1}}, r"unknown key\(s\) \['logger.wandb.colour'\] in logger.wandb"),
    (EngineConfig, {"async_mode": "maybe"}, "engine.async_mode='maybe' is invalid"),
    (EngineConfig, {"block_size": 12}, "engine.block_size"),
    (SamplingConfig, [1], "sampling must be a mapping"),
])
def test_errors_name_the_key(cls: type, raw: object, message: str) -> None:
    prefix = {LoggerConfig: "logger", EngineConfig: "engine", SamplingConfig: "sampling"}[cls]
    with pytest.raises(ValueError, match=message):
        parse_section(cls, prefix, raw)


def test_every_entry_point_parses_the_same_sections() -> None:
    serve = ServeConfig.from_dict({"sampling": {"stop": ["x"]}, "server": {"port": 0}})
    run = RunConfig.from_dict({"output_dir": "out", "sampling": {"stop": ["x"]}})
    assert serve.sampling == run.sampling and serve.server.port == 0
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['rollout'\] in the config"):
        RunConfig.from_dict({"output_dir": "out", "rollout": {}})  # the main job's section, not the trainers'
    with pytest.raises(ValueError, match="output_dir is missing"):
        RunConfig.from_dict({})
