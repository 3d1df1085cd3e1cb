"""The job config: conf/ mirrors the dataclasses, and every bad value is refused naming key, value, range."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from rollout.config import EngineConfig
from rollout.job.config import JobConfig
from rollout.rl.rewards import exact_match, get_reward_fn, last_integer
from rollout.sampling_params import SamplingParams
from tests.script_helpers import compose


def composed(*overrides: str) -> dict:
    return OmegaConf.to_container(compose("config", "output_dir=/tmp/x", *overrides), resolve=True)


def test_conf_defaults_mirror_the_dataclasses() -> None:
    """Every group's keys and defaults are the dataclass's (engine: EngineConfig's field names)."""
    conf = composed()
    defaults = JobConfig(output_dir="/tmp/x").to_dict()
    assert set(conf) == set(defaults)
    for group in ("model", "sampling", "data", "rollout", "logger"):
        assert conf[group] == defaults[group], group
    assert set(conf["engine"]) == set(defaults["engine"])
    EngineConfig(**conf["engine"])  # the CPU-friendly defaults are valid engine options


def test_overrides_reach_the_dataclasses() -> None:
    job = JobConfig.from_dict(
        composed(
            "model.path=/ckpt", "sampling.n=3", "sampling.max_tokens=5", "sampling.temperature=0",
            "data.path=/d.jsonl", "data.num_prompts=5", "rollout.rounds=7", "logger.wandb.mode=disabled",
            "engine.max_num_seqs=8", "sampling.stop=[x,yz]",
        )
    )
    s = job.sampling
    assert (job.model.path, s.n, s.max_tokens, s.temperature) == ("/ckpt", 3, 5, 0)
    assert (job.data.path, job.data.num_prompts, job.rollout.rounds) == ("/d.jsonl", 5, 7)
    assert job.logger.wandb.mode == "disabled" and job.engine.max_num_seqs == 8
    assert job.output_dir == "/tmp/x"
    params = job.sampling.to_params()
    assert isinstance(params, SamplingParams) and params.temperature == 0 and params.n == 3
    assert params.stop == ["x", "yz"]


def test_round_trip() -> None:
    job = JobConfig.from_dict(composed("logger.wandb.tags=[a,b]"))
    assert JobConfig.from_dict(job.to_dict()) == job
    assert job.logger.wandb.tags == ("a", "b")


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("sampling.n=0", "sampling.n=0 is invalid: must be an int >= 1"),
        ("sampling.n=abc", "sampling.n='abc' is invalid"),
        ("sampling.max_tokens=0", "sampling.max_tokens=0 is invalid: must be an int >= 1"),
        ("sampling.temperature=-1", "sampling.temperature=-1 is invalid: must be a number >= 0"),
        ("sampling.top_p=0", "sampling.top_p=0 is invalid: must be a number in (0, 1]"),
        ("sampling.min_tokens=99", "sampling.min_tokens=99 is invalid: must be an int in [0, max_tokens]"),
        ("sampling.logprobs_mode=foo", "sampling.logprobs_mode='foo' is invalid: must be one of"),
        ("data.num_prompts=0", "data.num_prompts=0 is invalid: must be an int >= 1"),
        ("data.apply_chat_template=maybe", "data.apply_chat_template='maybe' is invalid: must be one"),
        ("data.prompt_field=''", "data.prompt_field='' is invalid: must be a non-empty string"),
        ("rollout.rounds=0", "rollout.rounds=0 is invalid: must be an int >= 1"),
        ("rollout.resume=3", "rollout.resume=3 is invalid: must be true or false"),
        ("rollout.reward=f1", "rollout.reward='f1' is invalid: must be one of ['digit_fraction', 'exact_match']"),
        ("logger.wandb.mode=sometimes", "logger.wandb.mode='sometimes' is invalid: must be one of ['online'"),
        ("logger.log_every_steps=0", "logger.log_every_steps=0 is invalid"),
        ("model.dtype=fp8", "model.dtype='fp8' is invalid: must be one of ['auto', 'bfloat16'"),
        ("engine.block_size=3", "engine.block_size must be a power of two, got 3"),
        ("engine.max_num_seqs=0", "engine.max_num_seqs must be >= 1, got 0"),
        ("+sampling.beam_width=2", "unknown key(s) ['sampling.beam_width']"),
        # bools are YAML bools everywhere, and the error says so (issue 8, item 11)
        ("engine.async_mode=maybe", "engine.async_mode='maybe' is invalid: must be true, false or null (a YAML"),
        ("engine.enable_prefix_caching=maybe", "engine.enable_prefix_caching='maybe' is invalid: must be true or"),
        ("engine.cuda_graphs=maybe", "engine.cuda_graphs='maybe' is invalid: must be true, false or null"),
        ("engine.async_mode=1", "engine.async_mode=1 is invalid: must be true, false or null"),
        ("data.shuffle=1", "data.shuffle=1 is invalid: must be true or false (a YAML bool: 1, 0 and strings"),
        ("engine.gpu_memory_utilization=abc", "engine.gpu_memory_utilization='abc' is invalid: must be a finite"),
        ("engine.cpu_kv_cache_gib=inf", "engine.cpu_kv_cache_gib=inf is invalid: must be a finite number"),
        ("engine.attention_backend=3", "engine.attention_backend=3 is invalid: must be a non-empty string"),
        ("model.device=tpu", "model.device='tpu' is invalid: must be null (cuda if available, else cpu), 'cpu'"),
        ("sampling.temperature=inf", "sampling.temperature=inf is invalid"),
        ("rollout.mode=eager", "rollout.mode='eager' is invalid: must be one of ['drain', 'partial']"),
        ("rollout.max_staleness=1", "rollout.max_staleness=1 is invalid: must be null with rollout.mode=drain"),
        ("rollout.stale_groups=keep", "rollout.stale_groups='keep' is invalid: must be one of ['drop', 'regen"),
        ("rollout.recompute_running=1", "rollout.recompute_running=1 is invalid: must be true or false"),
        (f"sampling.seed={2**64 + 5}", f"sampling.seed={2**64 + 5} is invalid: must be an int in [0, 2**64) or null"),
        ("sampling.seed=-1", "sampling.seed=-1 is invalid: must be an int in [0, 2**64) or null"),
    ],
)
def test_bad_values_name_key_value_and_range(override: str, needle: str) -> None:
    with pytest.raises(ValueError) as info:
        JobConfig.from_dict(composed(override))
    assert needle in str(info.value)


@pytest.mark.parametrize("device", ["cpu", "cuda", "cuda:1", None])
def test_device_values_accepted(device) -> None:
    assert JobConfig.from_dict({"output_dir": "/x", "model": {"device": device}}).model.device == device


def test_partial_mode_keys() -> None:
    job = JobConfig.from_dict(
        composed("rollout.mode=partial", "rollout.max_staleness=2", "rollout.stale_groups=regenerate",
                 "rollout.max_inflight_groups=16", "rollout.recompute_running=false")
    )
    r = job.rollout
    assert (r.mode, r.max_staleness, r.stale_groups, r.max_inflight_groups, r.recompute_running) == (
        "partial", 2, "regenerate", 16, False
    )
    with pytest.raises(ValueError, match="rollout.max_staleness=-1 is invalid: must be an int >= 0 or null"):
        JobConfig.from_dict(composed("rollout.mode=partial", "rollout.max_staleness=-1"))


def test_output_dir_is_required() -> None:
    with pytest.raises(ValueError, match="output_dir is missing"):
        JobConfig.from_dict({})


def test_resume_mismatches_ignore_where_and_how_long() -> None:
    saved = JobConfig.from_dict(composed()).to_dict()
    same = JobConfig.from_dict(composed("rollout.rounds=9", "rollout.resume=true", "logger.progress=false"))
    assert same.resume_mismatches(saved) == []
    other = JobConfig.from_dict(composed("sampling.n=3", "data.num_prompts=2"))
    want = ["data.num_prompts: saved 8, now 2", "sampling.n: saved 4, now 3"]
    assert other.resume_mismatches(saved) == want


@pytest.mark.parametrize(
    ("text", "answer", "reward"),
    [
        ("The answer is 19.", "19", 1.0),
        ("7 + 12 = 19", "19", 1.0),
        ("19 or maybe 20", "19", 0.0),
        ("it is -35", "-35", 1.0),
        ("1,234", "1234", 1.0),
        ("no digits here", "19", 0.0),
        ("19", None, 0.0),
        ("19", "nineteen", 0.0),
    ],
)
def test_exact_match(text: str, answer: str | None, reward: float) -> None:
    assert exact_match(text, answer) == reward


def test_reward_lookup() -> None:
    assert get_reward_fn(None) is None
    assert get_reward_fn("exact_match") is exact_match
    assert last_integer("a 3 b 44") == 44
    with pytest.raises(ValueError, match="rollout.reward='nope'"):
        get_reward_fn("nope")


def test_pool_group_is_validated() -> None:
    from rollout.job.config import JobConfig
    from rollout.settings.schema import PoolConfig

    assert JobConfig.from_dict({"output_dir": "x"}).pool == PoolConfig(replicas=1, address="local", gpus_per_replica=1)
    assert JobConfig.from_dict({"output_dir": "x", "pool": {"replicas": 2}}).pool.replicas == 2
    for bad in ({"replicas": 0}, {"address": ""}, {"gpus_per_replica": -1}, {"gpu": 1}):
        with pytest.raises(ValueError, match="pool"):
            JobConfig.from_dict({"output_dir": "x", "pool": bad})
