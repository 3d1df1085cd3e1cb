"""rollout/envs pieces on their own: the protocol (TRL's), tool-call parsing, reply rendering, the two examples."""

from __future__ import annotations

import pytest

from rollout.envs import EnvSpec, load_factory
from rollout.envs.calculator import CalculatorEnv, evaluate
from rollout.envs.guess import GuessNumberEnv
from rollout.envs.loop import EnvLimits, truncate
from rollout.envs.render import ChatRenderer
from rollout.envs.tool_calls import parse_tool_calls


def test_spec_reads_tools_schemas_and_kind_like_trl() -> None:
    spec = EnvSpec(load_factory("rollout.envs.calculator:CalculatorEnv"))
    assert not spec.is_step and spec.has_reward and spec.tool_names == ["calculate"]
    fn = spec.schemas[0]["function"]
    assert fn["name"] == "calculate" and fn["parameters"]["required"] == ["expression"]
    assert "arithmetic" in fn["description"]
    step = EnvSpec(GuessNumberEnv)
    assert step.is_step and step.has_reward and step.schemas == []
    first = step.make()
    assert isinstance(first, GuessNumberEnv) and step.make() is not first  # the probe is handed out once


@pytest.mark.parametrize("spec, needle", [
    ("nocolon", "must be an import path"),
    ("rollout.envs.nothere:X", "cannot import"),
    ("rollout.envs.guess:Nope", "has no attribute 'Nope'"),
    ("rollout.envs.guess:TRIES", "is not callable"),
])
def test_load_factory_refuses_with_the_value(spec, needle) -> None:
    with pytest.raises(ValueError, match=needle):
        load_factory(spec)


def test_spec_refuses_envs_without_reset_or_tools() -> None:
    class NoReset:
        def tool(self, x: int) -> int:
            """T.

            Args:
                x: X.
            """
            return x

    class NoTools:
        def reset(self, **row):
            return None

    class BadDoc:
        def reset(self, **row):
            return None

        def tool(self, x):
            return x

    with pytest.raises(ValueError, match="must define a callable reset"):
        EnvSpec(NoReset)
    with pytest.raises(ValueError, match="neither tools"):
        EnvSpec(NoTools)
    with pytest.raises(ValueError, match="tool 'tool'"):
        EnvSpec(BadDoc)


def test_tool_calls_fallback_form(tokenizer) -> None:
    text = ('think <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call> and '
            '<tool_call>{"name": "x", "arguments": "{\\"q\\": 1}"}</tool_call><tool_call>{oops</tool_call>'
            '<tool_call>{"arguments": {}}</tool_call>')
    calls = parse_tool_calls(tokenizer, text)
    assert calls[0] == {"name": "add", "arguments": {"a": 1, "b": 2}}
    assert calls[1] == {"name": "x", "arguments": {"q": 1}}
    assert "not valid JSON" in calls[2]["error"] and "no function name" in calls[3]["error"]
    assert parse_tool_calls(tokenizer, "no calls here") == []


def test_tool_calls_use_the_tokenizers_response_schema() -> None:
    class Tok:
        response_schema = {"x": 1}

        def parse_response(self, ids, prefix=None, tools=None):
            assert ids == [1, 2] and prefix == [9]
            return {"role": "assistant", "tool_calls": [{"type": "function",
                                                        "function": {"name": "f", "arguments": {"k": 1}}}]}

    assert parse_tool_calls(Tok(), "", [1, 2], [9]) == [{"name": "f", "arguments": {"k": 1}}]


def test_render_reply_closes_an_unfinished_turn_with_eos(tokenizer) -> None:
    r = ChatRenderer(tokenizer)
    eos = tokenizer.eos_token_id
    ended = r.reply([{"role": "user", "content": "Lower."}], eos)
    cut = r.reply([{"role": "user", "content": "Lower."}], 7)
    assert tokenizer.decode(ended) == "<|user|>Lower.<|eos|><|assistant|>" and cut == [eos, *ended]
    text, ids = r.prompt([{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}], " R")
    assert text.endswith("<|user|>Q R<|eos|><|assistant|>") and ids == tokenizer(text, add_special_tokens=False)[
        "input_ids"]


def test_truncate_marks_the_cut() -> None:
    assert truncate("abc", 5) == "abc"
    assert truncate("x" * 10, 4) == "xxxx[... truncated: 4 of 10 characters shown]"
    with pytest.raises(ValueError, match="max_turns must be an int >= 1"):
        EnvLimits(max_turns=0)
    with pytest.raises(ValueError, match="tool_timeout_s must be a number > 0"):
        EnvLimits(tool_timeout_s=0)


def test_calculator_env() -> None:
    assert evaluate("3 * (4 + 5)") == 27 and evaluate("-7 // 2") == -4
    for bad in ("__import__('os')", "2 ** 3", "1 +", "10**100*10**100"):
        with pytest.raises(ValueError):
            evaluate(bad)
    env = CalculatorEnv()
    assert "calculate" in env.reset(prompt="What is 6 * 7?", answer="42")
    assert env.get_reward() == 0.0 and env.calculate("6 * 7") == "42" and env.get_reward() == 1.0
    assert env.calculate("84 / 2") == "42" and env.get_reward() == 1.0


def test_guess_env_tells_higher_or_lower_and_rewards_early_hits() -> None:
    env = GuessNumberEnv()
    assert "between 0 and 99" in env.reset(prompt="p", answer="142")  # secret 42
    assert env.step("I guess 10") == "Higher." and env.step("50") == "Lower." and env.step("41") is None
    assert env.get_reward() == 0.0
    env.reset(answer="42")
    assert env.step("maybe 42") is None and env.get_reward() == 1.0
    env.reset(answer="42")
    assert env.step("no idea") == "That is not a number. Guess again." and env.step("42") is None
    assert env.get_reward() == 0.5
