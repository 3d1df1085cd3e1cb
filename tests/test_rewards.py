"""Rewards: shipped ones by name, plug-ins by import path (TRL's signature), clear errors for the rest."""

from __future__ import annotations

import pytest

from rollout.job.config import RolloutConfig
from rollout.rl.rewards import REWARDS, check_reward_spec, get_reward_fn, load_reward

NOT_CALLABLE = 3


def length_penalty(prompts, completions, completion_ids, answer=None, **_):
    """A plug-in in TRL's signature: None marks an unscorable completion, as TRL allows."""
    return [None if c == "skip" else -float(len(ids)) for c, ids in zip(completions, completion_ids)]


def test_shipped_rewards_by_name_in_both_shapes():
    assert sorted(REWARDS) == ["digit_fraction", "exact_match"]
    batch = load_reward("exact_match")
    assert batch(prompts=["p", "q"], completions=["it is 7", [{"role": "assistant", "content": "8"}]],
                 answer=["7", "7"]) == [1.0, 0.0]
    assert get_reward_fn("digit_fraction")("12ab") == 0.5 and get_reward_fn(None) is None


def test_plug_in_by_import_path():
    batch = load_reward("tests.test_rewards:length_penalty")
    assert batch is length_penalty
    one = get_reward_fn("tests.test_rewards:length_penalty")  # the main job's per-sample form
    assert one("abc", "3", completion_ids=[5, 6]) == -2.0 and one("skip", None) is None
    assert RolloutConfig(reward="tests.test_rewards:length_penalty").reward.endswith("length_penalty")


@pytest.mark.parametrize("spec, message", [
    ("f1", "rollout.reward='f1' is invalid: must be one of ['digit_fraction', 'exact_match'], an import path"),
    ("tests.test_rewards:nothing_here", "module 'tests.test_rewards' has no attribute 'nothing_here'"),
    ("tests.no_such_module:score", "cannot import module 'tests.no_such_module'"),
    ("tests.test_rewards:NOT_CALLABLE", "is not callable"),
    ("my pkg:score", "is invalid: must be one of"),
])
def test_unknown_rewards_say_what_exists(spec, message):
    with pytest.raises(ValueError) as info:
        load_reward(spec)
    assert message in str(info.value)


def test_config_time_check_imports_nothing():
    check_reward_spec("not_installed_pkg.rewards:score")  # form only; load_reward imports it later
    with pytest.raises(ValueError, match=r"train.reward=3 is invalid"):
        check_reward_spec(3, "train.reward")
