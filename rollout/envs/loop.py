"""The environment loop: many conversations on one engine, each turn continuing from its resident KV.

``EnvLoop.run`` starts one environment per row (``reset`` first), then steps the engine. When a conversation's
turn ends its environment is called *off the engine thread* (sync methods in a thread pool, ``async def`` ones on
an asyncio loop) while every other conversation keeps decoding; the reply is rendered with the chat template in
the pool and appended to the same sequence (``Conversations.resume``: prefill tokens, logprob 0.0, env_mask 0).

The engine may also be a rollout server (``RolloutClient``): the loop then drives ``RemoteTurns`` instead of the
engine's ``Conversations`` (``rollout.envs.turns``): each turn is one request of the conversation so far, sent as
soon as it is ready, the earlier turns' KV served by the server's prefix cache; the rows are the same.

Faults stay in their own conversation (each documented as the row it gives):

- a tool that raises: its message is the tool's result, ``{'error': '...'}`` as TRL renders it; ``tool_failures``
  counts it and the conversation continues. The same for an unknown tool or a malformed call.
- a tool that does not return within ``tool_timeout_s``: ``{'error': 'timed out after N s'}`` (a failure); the
  call is abandoned (an ``async`` one cancelled; a sync one keeps its pool thread until it returns, and the pool
  is replaced when half its threads are held by abandoned calls).
- a result longer than ``max_tool_result_chars``: cut there, ending with ``[... truncated: N of M characters
  shown]``.
- ``reset`` (or ``step``, or ``get_reward``) raising or timing out: the conversation ends with
  ``finish_reason="env_error"`` and ``error`` naming the method and the exception (reward None).
- a reply that would not fit ``max_model_len`` (or the KV capacity) with one more model token, or a turn that
  fills it: ``finish_reason="length"``; the reply is not appended.
- a turn the server refuses or fails (over a ``RolloutClient``: ``RequestRejected``, ``ServerError``, a broken
  connection): ``finish_reason="env_error"``, ``error`` naming it; the tokens made so far stay in the row.
- a tool conversation ends (``"stop"``) at a turn with no tool call; a step one when ``step`` returns None;
  either ends with the last turn's reason at ``max_turns`` model turns (its tool calls are not executed, as in
  TRL; a step environment still sees the text, so it can score it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rollout.envs.calls import EnvCalls
from rollout.envs.protocol import EnvSpec
from rollout.envs.render import ChatRenderer
from rollout.envs.tool_calls import parse_tool_calls
from rollout.envs.turns import TurnFailed, turns_for
from rollout.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class EnvLimits:
    max_turns: int = 4  # model turns per conversation
    max_turn_tokens: int = 256  # tokens generated per turn
    tool_timeout_s: float = 60.0  # one environment call: a tool, reset, step or get_reward
    max_tool_result_chars: int = 16384  # a tool result or step reply longer than this is cut, with a marker
    env_workers: int = 64  # threads running sync environment methods
    max_completion_tokens: int | None = None  # model + env tokens after the prompt (TRL's max_completion_length)

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_turn_tokens", "max_tool_result_chars", "env_workers"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        m = self.max_completion_tokens
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
            raise ValueError(f"max_completion_tokens must be an int >= 1 or None, got {m!r}")
        if not isinstance(self.tool_timeout_s, (int, float)) or not self.tool_timeout_s > 0:
            raise ValueError(f"tool_timeout_s must be a number > 0, got {self.tool_timeout_s!r}")


@dataclass(slots=True)
class Episode:
    """One conversation's row: the completion holds model and environment tokens after the prompt."""

    index: int
    prompt: str = ""
    prompt_ids: list[int] = field(default_factory=list)
    completion_ids: list[int] = field(default_factory=list)
    env_mask: list[int] = field(default_factory=list)  # 1 model token, 0 environment token (TRL's)
    logprobs: list[float] = field(default_factory=list)  # 0.0 at environment tokens (TRL's)
    policy_versions: list[int] = field(default_factory=list)
    finish_reason: str = "stop"
    num_turns: int = 0  # model turns
    tool_calls: int = 0
    tool_failures: int = 0
    reward: float | None = None
    error: str | None = None  # why an env_error row ended
    # the completion as chat messages, TRL's shape: assistant turns (with their ``tool_calls``), tool / user replies
    messages: list[dict[str, Any]] = field(default_factory=list)


@dataclass(slots=True, eq=False)
class _Conv:
    ep: Episode
    env: Any
    row: dict[str, Any]
    params: SamplingParams
    rid: str = ""
    tools: dict[str, Callable[..., Any]] = field(default_factory=dict)
    last_token: int | None = None
    live: bool = False  # started on the turns backend and not ended


def truncate(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return f"{text[:limit]}[... truncated: {limit} of {len(text)} characters shown]"


class EnvLoop:
    def __init__(self, engine: Any, spec: EnvSpec | None, tokenizer: Any, limits: EnvLimits = EnvLimits(),
                 renderer: Any = None, **chat_template_kwargs: Any) -> None:
        """``spec`` None: conversations come with their prompt ids and tools (``run_prepared``, TRL's trainer
        path). ``renderer``: what turns prompts and replies into ids and ids into text (``ChatRenderer`` of the
        tokenizer by default; a benchmark on token ids passes its own). ``engine``: an in-process ``Engine`` or a
        ``RolloutClient`` (``rollout.envs.turns.turns_for``; anything else is a TypeError)."""
        self.turns = turns_for(engine)
        self.engine, self.spec, self.limits, self.tok = engine, spec, limits, tokenizer
        self.is_step = spec is not None and spec.is_step
        self.has_reward = spec is not None and spec.has_reward
        schemas = spec.schemas if spec is not None else None
        self.render = renderer or ChatRenderer(tokenizer, schemas, **chat_template_kwargs)
        self.calls = EnvCalls(limits.env_workers)
        self._rid_map: dict[str, _Conv] = {}  # conversations not done yet, by request id
        self._to_resume: list[tuple[_Conv, list[int]]] = []
        self._active = 0
        self.finished: list[Episode] = []  # done since the caller last cleared it, in the order they ended

    # ---- running --------------------------------------------------------------------------------------------
    def run(self, rows: list[dict[str, Any]], prompts: list[Any], params: list[SamplingParams],
            request_prefix: str = "conv") -> list[Episode]:
        """One conversation per row (``prompts[i]``: its prompt, a string or messages); rows in order."""
        rids = [f"{request_prefix}-{i}" for i in range(len(rows))]
        self.finished = []
        episodes = self.add(rows, prompts, params, rids)
        self.drive()
        return episodes

    def add(self, rows: list[dict[str, Any]], prompts: list[Any], params: list[SamplingParams],
            rids: list[str]) -> list[Episode]:
        """Start conversations (their ``reset`` first) without driving them; ``drive`` does. Their episodes fill
        in as they go and reach ``finished`` when done (partial rounds hand some out and carry the rest)."""
        convs = [_Conv(Episode(i), None, dict(row), p, rid=rid)
                 for i, (row, p, rid) in enumerate(zip(rows, params, rids, strict=True))]
        self._register(convs)
        for c, prompt in zip(convs, prompts, strict=True):
            try:
                c.env = self.spec.make()
                c.tools = {name: getattr(c.env, name) for name in self.spec.tool_names}
            except Exception as e:  # noqa: BLE001 - the user's factory
                self._fail(c, f"the environment factory raised {type(e).__name__}: {e}")
                continue
            self._call(c, c.env.reset, (), c.row, lambda r, e, c=c, p=prompt: self._reset_done(c, p, r, e), True)
        return [c.ep for c in convs]

    def run_prepared(self, prompt_ids: list[list[int]], tools: list[dict[str, Callable[..., Any]]],
                     params: list[SamplingParams], request_prefix: str = "conv") -> list[Episode]:
        """Conversations whose prompt is already rendered and whose environment is already reset (TRL's trainer
        makes and resets its ``environment_factory`` instances itself): ``tools[i]`` maps a tool's name to the
        callable conversation i may call. No ``get_reward`` here (the trainer scores)."""
        convs = [_Conv(Episode(i), None, {}, p, rid=f"{request_prefix}-{i}", tools=dict(t))
                 for i, (t, p) in enumerate(zip(tools, params, strict=True))]
        self.finished = []
        self._register(convs)
        for c, ids in zip(convs, prompt_ids, strict=True):
            self._start(c, ("", list(ids)), None)
        self.drive()
        return [c.ep for c in convs]

    def _register(self, convs: list[_Conv]) -> None:
        for c in convs:
            if c.rid in self._rid_map:
                raise ValueError(f"conversation id {c.rid!r} is already running")
            self._rid_map[c.rid] = c
        self._active += len(convs)

    def drive(self, until: Callable[[], bool] | None = None) -> None:
        """Step the engine (its turns) and the environments until every conversation is done (or ``until()`` holds,
        checked after each step: the others keep their state, KV and calls in flight, for a later ``drive``). If it
        raises, every conversation is ended (aborted) and forgotten."""
        self._to_resume = [x for x in self._to_resume if x[0].rid in self._rid_map]
        try:
            while self._active and not (until is not None and until()):
                self.calls.poll()  # may end the last conversations (their final calls' results)
                self._resume_ready()
                if not self._active:
                    break
                if self.turns.busy():
                    for out in self.turns.step():
                        self._turn_ended(out)
                elif not self.calls.num_pending and not self._to_resume:
                    raise RuntimeError(f"the environment loop stalled: {self._active} conversations neither run "
                                       "nor wait on their environment (bug)")
                else:
                    self.calls.wait()
        except BaseException:
            self.abandon()
            raise

    def abandon(self) -> None:
        """End every conversation now (aborted, KV freed) and forget them and their calls in flight."""
        for c in self._rid_map.values():
            if c.live:
                self.turns.abort(c.rid)
                c.live = False
        self._rid_map, self._to_resume, self._active = {}, [], 0
        self.calls.forget()  # their late results are dropped

    def close(self) -> None:
        self.calls.close()

    def _call(self, c: _Conv, fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any],
              then: Callable[[Any, BaseException | None], None], timed: bool) -> None:
        """``fn`` off this thread (``EnvCalls``); ``timed``: bounded by ``tool_timeout_s``."""
        self.calls.submit(fn, args, kwargs, then, self.limits.tool_timeout_s if timed else None)

    # ---- a conversation's life ------------------------------------------------------------------------------
    def _reset_done(self, c: _Conv, prompt: Any, result: Any, error: BaseException | None) -> None:
        if error is not None:
            return self._fail(c, f"reset raised {type(error).__name__}: {error}")
        if result is not None and not isinstance(result, str):
            return self._fail(c, f"reset must return a string or None, got {type(result).__name__}")
        self._call(c, self.render.prompt, (prompt, result), {}, lambda r, e: self._start(c, r, e), False)

    def _start(self, c: _Conv, rendered: Any, error: BaseException | None) -> None:
        if error is not None:
            return self._fail(c, f"the prompt could not be rendered: {type(error).__name__}: {error}")
        c.ep.prompt, c.ep.prompt_ids = rendered
        cap = self.turns.capacity
        budget = min(self.limits.max_turn_tokens, cap - len(c.ep.prompt_ids), self._completion_room(c))
        if budget < 1:
            return self._fail(c, f"the prompt has {len(c.ep.prompt_ids)} tokens; max_model_len is {cap}")
        try:
            self.turns.start(c.ep.prompt_ids, _turn_params(c.params, budget), c.rid)
        except ValueError as e:  # the engine refuses the prompt (a token outside the vocabulary...)
            return self._fail(c, f"the engine refused the prompt: {e}")
        c.live = True

    def _turn_ended(self, out: Any) -> None:
        c = self._rid_map.get(out.request_id)
        if c is None:  # another caller's request on a shared engine: not ours to handle
            return
        if isinstance(out, TurnFailed):
            return self._fail(c, out.message)
        comp = out.outputs[0]
        ep = c.ep
        new = comp.token_ids[len(ep.env_mask):]
        ep.env_mask += [1] * len(new)
        ep.completion_ids, ep.logprobs = list(comp.token_ids), list(comp.logprobs)
        ep.policy_versions = list(comp.policy_versions)
        ep.num_turns += 1
        c.last_token = comp.token_ids[-1] if comp.token_ids else None
        reason = comp.finish_reason or "abort"
        text = self.render.decode(new)
        ep.messages.append({"role": "assistant", "content": text})
        full = len(ep.prompt_ids) + len(comp.token_ids) >= self.turns.capacity or self._completion_room(c) < 1
        if reason == "abort" or full:
            return self._end(c, reason if reason == "abort" else "length")
        if self.is_step:
            last = ep.num_turns >= self.limits.max_turns
            self._call(c, c.env.step, (text,), {}, lambda r, e: self._stepped(c, r, e, reason, last), True)
            return
        if ep.num_turns >= self.limits.max_turns:
            return self._end(c, reason)
        before = ep.prompt_ids[-64:] + ep.completion_ids[: len(ep.completion_ids) - len(new)][-64:]
        calls = self.parse_calls(c.row, ep.num_turns, text, new, before[-64:])
        if not calls:
            return self._end(c, "stop")
        ep.messages[-1]["tool_calls"] = [{"type": "function", "function": {"name": k["name"],
                                                                           "arguments": k.get("arguments", {})}}
                                         for k in calls]
        self._run_tools(c, calls)

    def parse_calls(self, row: dict[str, Any], turn: int, text: str, ids: list[int] | None = None,
                    prefix: list[int] | None = None) -> list[dict[str, Any]]:
        """The tool calls of model turn ``turn`` (1-based; ``ids`` its tokens, ``prefix`` the tokens before it);
        tests override it with a scripted policy."""
        return parse_tool_calls(self.tok, text, ids, prefix, getattr(self.render, "tools", None))

    def _stepped(self, c: _Conv, result: Any, error: BaseException | None, reason: str, last: bool) -> None:
        if error is not None:
            return self._fail(c, f"step raised {type(error).__name__}: {error}")
        if result is None or last:
            return self._end(c, reason if last and result is not None else "stop")
        text = truncate(str(result), self.limits.max_tool_result_chars)
        self._reply(c, [{"role": "user", "content": text}])

    def _run_tools(self, c: _Conv, calls: list[dict[str, Any]]) -> None:
        results: list[Any] = [None] * len(calls)
        left = [len(calls)]

        def one_done(i: int, name: str, result: Any, error: BaseException | None) -> None:
            if error is not None:
                c.ep.tool_failures += 1
                result = {"error": str(error) or type(error).__name__}
            content = truncate(str(result), self.limits.max_tool_result_chars)
            results[i] = {"role": "tool", "name": name, "content": content}
            left[0] -= 1
            if left[0] == 0:
                self._reply(c, results)

        for i, call in enumerate(calls):
            c.ep.tool_calls += 1
            name = call["name"]
            then = lambda r, e, i=i, name=name: one_done(i, name, r, e)  # noqa: E731
            if "error" in call:
                then(None, ValueError(call["error"]))
            elif name not in c.tools:
                then(None, ValueError(f"Tool {name} not found."))
            else:
                self._call(c, c.tools[name], (), call["arguments"], then, True)

    def _reply(self, c: _Conv, messages: list[dict[str, Any]]) -> None:
        self._call(c, self.render.reply, (messages, c.last_token), {},
                   lambda r, e: self._append(c, r, e, messages), False)

    def _append(self, c: _Conv, ids: Any, error: BaseException | None, messages: list[dict[str, Any]]) -> None:
        if error is not None:
            return self._fail(c, f"the reply could not be rendered: {type(error).__name__}: {error}")
        if len(ids) + 1 > min(self.turns.room(c.rid), self._completion_room(c)):
            return self._end(c, "length")
        c.ep.messages += messages
        self._to_resume.append((c, ids))
        self._resume_ready()

    def _resume_ready(self) -> None:
        waiting, self._to_resume = self._to_resume, []
        for c, ids in waiting:
            budget = min(self.limits.max_turn_tokens, self._completion_room(c) - len(ids))
            if self.turns.resume(c.rid, ids, c.params, budget):
                c.ep.env_mask += [0] * len(ids)
            else:
                self._to_resume.append((c, ids))

    def _end(self, c: _Conv, reason: str) -> None:
        c.ep.finish_reason = reason
        if c.live:
            self.turns.end(c.rid)
            c.live = False
        if self.has_reward and c.env is not None:
            self._call(c, c.env.get_reward, (), {}, lambda r, e: self._rewarded(c, r, e), True)
        else:
            self._done(c)

    def _rewarded(self, c: _Conv, result: Any, error: BaseException | None) -> None:
        if error is None and result is not None:
            try:
                c.ep.reward = float(result)
            except (TypeError, ValueError):
                error = TypeError(f"it returned {result!r:.100}, not a number")
        if error is not None:
            c.ep.finish_reason, c.ep.error = "env_error", f"get_reward raised {type(error).__name__}: {error}"
        self._done(c)

    def _fail(self, c: _Conv, message: str) -> None:
        c.ep.finish_reason, c.ep.error = "env_error", message
        if c.live:
            self.turns.end(c.rid)
            c.live = False
        self._done(c)

    def _done(self, c: _Conv) -> None:
        self._active -= 1
        self._rid_map.pop(c.rid, None)
        self.finished.append(c.ep)

    def _completion_room(self, c: _Conv) -> int:
        m = self.limits.max_completion_tokens
        return 1 << 30 if m is None else m - len(c.ep.env_mask)


def _turn_params(params: SamplingParams, budget: int) -> SamplingParams:
    import dataclasses

    return dataclasses.replace(params, max_tokens=budget, min_tokens=min(params.min_tokens, budget))
