"""A scripted stand-in for the engine, for the job's tests (actor, partial rollouts, writer)."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

from rollout.api import BackendLimits
from rollout.engine.engine import EngineStats
from rollout.outputs import CompletionOutput, RequestOutput


def zero_stats() -> EngineStats:
    """The engine's own stats record, all counters at zero (the fake engine mutates it as it steps)."""
    return EngineStats(**{f.name: (None if "gpu" in f.name else 0) for f in dataclasses.fields(EngineStats)})


def default_length(prompt: list[int], index: int) -> int:
    return 1 + (index + len(prompt)) % 5


@dataclass
class FakeEngine:
    """Scripted engine: every running sample emits one token (7, logprob -0.5, the current policy version)
    per step and stops after ``length(prompt, i)`` tokens ("length" if that reaches max_tokens). Text is
    the answer-ish ``so <len(prompt)>``. Aborted requests come back from the next step, as the engine's do.
    ``crash_at_step``: raise from that step (a simulated crash)."""

    policy_version: int = 0
    tokenizer: object = None
    stats: EngineStats = field(default_factory=zero_stats)
    requests: dict = field(default_factory=dict)
    added: list = field(default_factory=list)
    refuse_after: int | None = None
    length: Callable[[list[int], int], int] = default_length
    crash_at_step: int | None = None
    updates: list = field(default_factory=list)  # (version, recompute_running, running request ids)
    pool: object = None  # stands in for a RolloutPool's per-replica stats (``stats()``)
    limits: BackendLimits = BackendLimits(max_model_len=1 << 20, vocab_size=1 << 20, max_num_seqs=1 << 10,
                                          kv_cache_tokens=1 << 20)
    is_sleeping: bool = False
    _aborted: list = field(default_factory=list)

    def add_request(self, prompt, params, request_id=None):
        if self.refuse_after is not None and len(self.requests) >= self.refuse_after:
            raise ValueError("prompt too long")
        assert request_id not in self.requests, f"request_id {request_id!r} is already in use"
        self.added.append((request_id, list(prompt), params))
        wanted = [min(self.length(list(prompt), i), params.max_tokens) for i in range(params.n)]
        outs = [CompletionOutput(i) for i in range(params.n)]
        self.requests[request_id] = (prompt, params, wanted, outs)
        self.stats.num_prompt_tokens += len(prompt)
        return request_id

    def abort(self, request_id):
        request = self.requests.pop(request_id, None)
        if request is not None:
            for out in request[3]:
                out.finish_reason = out.finish_reason or "abort"
            self._aborted.append(RequestOutput(request_id, list(request[0]), request[3], None, True))

    def has_unfinished_requests(self):
        return bool(self.requests) or bool(self._aborted)

    def step(self):
        if self.crash_at_step is not None and self.stats.num_steps >= self.crash_at_step:
            raise RuntimeError("simulated crash")
        self.stats.num_steps += 1
        done, self._aborted = self._aborted, []
        for rid, (prompt, params, wanted, outs) in list(self.requests.items()):
            for out, want in zip(outs, wanted):
                if out.finish_reason is None:
                    out.token_ids.append(7)
                    out.logprobs.append(-0.5)
                    out.policy_versions.append(self.policy_version)
                    self.stats.num_generated_tokens += 1
                    self.stats.num_scheduled_seqs += 1
                    if out.index == 0 and len(out.token_ids) == 1:  # the request's first token
                        self.stats.num_first_tokens += 1
                        self.stats.num_started_prompt_tokens += len(prompt)
                    if len(out.token_ids) == want:
                        out.finish_reason = "length" if want == params.max_tokens else "stop"
                        out.text = f"so {len(prompt)}"
            if all(o.finish_reason for o in outs):
                done.append(RequestOutput(rid, list(prompt), outs, None, True))
                del self.requests[rid]
        self.stats.num_running_seqs = sum(
            sum(o.finish_reason is None for o in r[3]) for r in self.requests.values()
        )
        self.stats.kv_cache_usage = self.stats.num_running_seqs / 100
        return done

    def partial_output(self, request_id):
        request = self.requests.get(request_id)
        if request is None:
            return None
        return RequestOutput(request_id, list(request[0]), copy.deepcopy(request[3]), None, False)

    def get_stats(self):
        pool = self.pool.stats() if self.pool is not None else None
        return dataclasses.replace(self.stats, policy_version=self.policy_version, pool=pool)

    def generate(self, prompts, sampling_params=None, use_tqdm=False):
        raise NotImplementedError("the job drives the fake step by step")

    def sleep(self, level=1):
        return 0

    def wake_up(self):
        pass

    def close(self):
        pass

    def describe(self):
        return {"fake": True}

    def update_weights(self, named_tensors, version=None, recompute_running=True):
        self.policy_version = self.policy_version + 1 if version is None else version
        self.updates.append((self.policy_version, recompute_running, sorted(self.requests)))
        return self.policy_version
