"""The engine: requests in, finished outputs out. Each step is schedule -> execute -> update.

In async mode the order becomes schedule N+1 -> execute N+1 -> update N, so the host prepares the
next batch while the device computes; a stop is then seen one step late and the extra token is
dropped by the scheduler. A step that raises (an interrupt, out of memory, a kernel error) is rolled
back: every running sequence is recomputed from its known tokens, so the engine stays consistent.

Threads: every public method takes one lock. Outputs of requests a ``generate`` call is waiting for
go to that call; ``step()`` returns only the others (online requests from ``add_request``).
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import threading
import uuid
from collections.abc import Iterable

import torch

from rollout.api import BackendLimits
from rollout.config import EngineConfig
from rollout.engine import loading
from rollout.engine.block_manager import BlockManager
from rollout.engine.detokenize import decode_output
from rollout.engine.runners import build_runner
from rollout.engine.runners.base import PendingStep, Runner
from rollout.engine.runners.kv_cache import KVCache
from rollout.engine.scheduler import Scheduler, SchedulerLimits
from rollout.engine.scoring import prepare_score
from rollout.engine.sequence import Request, Sequence
from rollout.engine.stats import EngineStats, StepCounters
from rollout.engine.tp.runner import TPRunner, TPWeightSync, start_tensor_parallel
from rollout.engine.tp.workers import TPWorkers
from rollout.engine.validation import (
    check_features,
    check_lengths,
    check_priority,
    check_request_id,
    normalize_params,
    normalize_prompts,
    to_token_ids,
)
from rollout.layers.backends import resolve_attention
from rollout.outputs import CompletionOutput, RequestOutput
from rollout.sampling_params import SamplingParams
from rollout.weights.apply import WeightSync

__all__ = ["Engine", "EngineStats"]
MAX_VERSION = 1 << 63  # versions travel as int64 (token metadata, Arrow columns, JSON)


class Engine:
    def __init__(self, model: torch.nn.Module, hf_config: object, config: EngineConfig, device: torch.device,
                 tokenizer: object | None = None, eos_ids: frozenset[int] = frozenset(),
                 workers: TPWorkers | None = None) -> None:
        self.model, self.hf_config, self.config, self.device = model, hf_config, config, device
        self.workers = workers  # tensor-parallel ranks 1 .. N-1 (``model`` is then rank 0's shard)
        self.tokenizer, self.eos_ids = tokenizer, eos_ids
        self.dtype = next(model.parameters()).dtype
        limit = getattr(hf_config, "max_position_embeddings", None) or 2048
        if config.max_model_len is not None and config.max_model_len > limit:
            raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's max_position_embeddings "
                             f"{limit}; allowed: 1 .. {limit}")
        self.max_model_len = config.max_model_len or limit
        # decided once here; every tensor-parallel rank builds this same backend
        self.attn = resolve_attention(config.attention_backend, device, config.block_size, config.kv_cache_dtype)
        self.kv = KVCache(model, config, device, self.dtype, self.max_model_len, self.attn)
        self.num_blocks = self.kv.num_blocks
        self.async_mode = (device.type == "cuda") if config.async_mode is None else config.async_mode
        self.block_manager = BlockManager(self.num_blocks, config.block_size, config.enable_prefix_caching,
                                          num_host_blocks=self.kv.num_host_blocks)
        detokenize = None
        if tokenizer is not None:
            detokenize = lambda ids: tokenizer.decode(ids, skip_special_tokens=False)  # type: ignore[attr-defined]
        self.scheduler = Scheduler(
            SchedulerLimits(config.max_num_seqs, config.max_num_batched_tokens, config.turn_prefill_hold_steps,
                            config.turn_rows_max_tokens, config.num_rows),
            self.block_manager, detokenize
        )
        self.runner: Runner = self._make_runner()
        self.weights = WeightSync(model) if workers is None else TPWeightSync(model, workers)
        self.policy_version = 0
        self.counters = StepCounters(model.weight_bytes_per_step(), self.kv.token_bytes)
        self._sleep_level = 0
        self._rng = random.Random(config.seed)
        self._seq_ids = itertools.count()
        self._arrivals = itertools.count()
        self._inflight: PendingStep | None = None
        self.failed_request_ids: frozenset[str] = frozenset()  # the requests running when the last step failed
        self._lock = threading.RLock()
        self._claimed: dict[str, RequestOutput | None] = {}  # requests a generate() call waits for
        self._unclaimed: list[RequestOutput] = []  # finished online requests, for the next step() caller

    def _make_runner(self) -> Runner:
        runner = build_runner(self.model, self.kv, self.config, self.attn, self.device, self.max_model_len)
        if self.workers is None:
            return runner
        return TPRunner(runner, self.workers, self.config, self.attn, self.max_model_len, self.num_blocks)

    @classmethod
    def from_pretrained(cls, model: object, dtype: str | torch.dtype = "auto", device: str | None = None,
                        tokenizer: object | None = None, **engine_options: object) -> Engine:
        config = EngineConfig.from_options(**engine_options)
        dev = loading.resolve_device(device)
        workers = None
        if config.tensor_parallel_size > 1:
            net, hf_config, workers = start_tensor_parallel(model, dtype, dev, config)
        else:
            net, hf_config = loading.build_model(model, dtype, dev)
        try:
            tok = loading.load_tokenizer(model, tokenizer)
            return cls(net, hf_config, config, dev, tok, loading.eos_token_ids(model, hf_config, tok), workers)
        except BaseException:
            if workers is not None:
                workers.shutdown()
            loading.release(net, dev)
            raise

    # ---- requests ----------------------------------------------------------------------------
    def add_request(self, prompt: object, sampling_params: SamplingParams | None = None,
                    request_id: str | None = None, priority: int = 0) -> str:
        """Queue one request for ``step()`` (online use); returns its id. Bad input raises, nothing queued.

        ``priority``: lower is scheduled first among waiting requests (FCFS among equals), vLLM's meaning."""
        params = normalize_params(sampling_params, 1)[0]
        check_priority(priority)
        ids = self._prepare(prompt, params)
        with self._lock:
            return self._enqueue(request_id, ids, params, prompt, priority)

    def _prepare(self, prompt: object, params: SamplingParams) -> list[int]:
        """Everything about one request that can be refused, checked before anything is queued."""
        ids = to_token_ids(prompt, self.tokenizer, self.model.vocab_size)
        if params.truncate_prompt_tokens is not None:
            ids = ids[-params.truncate_prompt_tokens :]
        check_features(params, self.workers is not None)
        check_lengths(len(ids), params, self.max_model_len, self.kv.num_tokens, self.model.vocab_size)
        if params.stop and self.tokenizer is None:
            raise ValueError(f"stop strings {params.stop!r} need a tokenizer, and this engine has none; "
                             "use stop_token_ids, or load the model with a tokenizer")
        return ids

    def _enqueue(self, request_id: str | None, ids: list[int], params: SamplingParams, prompt: object,
                 priority: int = 0, score_only: bool = False, prompt_lp_start: int = 0) -> str:
        request_id = uuid.uuid4().hex if request_id is None else check_request_id(request_id)
        if request_id in self.scheduler.requests or request_id in self._claimed:
            raise ValueError(f"request_id {request_id!r} is already in use")
        arrival = next(self._arrivals)
        base_seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        stop_ids = tuple(sorted(params.stop_set | (frozenset() if params.ignore_eos else self.eos_ids)))
        seqs: list[Sequence] = []
        for i in range(params.n):
            seq = Sequence(next(self._seq_ids), request_id, i, list(ids), len(ids), params, arrival,
                           parent=seqs[0] if seqs else None, stop_ids=stop_ids, priority=priority)
            seq.sample_seed = (base_seed + 0x9E3779B97F4A7C15 * i) & ((1 << 63) - 1)
            if i == 0 and params.prompt_logprobs is not None:
                seq.prompt_lp_start, seq.score_only = prompt_lp_start, score_only
            seqs.append(seq)
        request = Request(request_id, ids, params, seqs, prompt if isinstance(prompt, str) else None)
        if params.prompt_logprobs is not None:
            request.prompt_logprobs = [None] * len(ids)
            # alternatives only when asked: 4K empty lists per request cost scoring 256 x 4K ~2 s of host time
            request.prompt_top_logprobs = [[] for _ in ids] if params.prompt_logprobs else None
        self.scheduler.add(request)
        return request_id

    def abort(self, request_id: str) -> None:
        """Finish the request now (``finish_reason="abort"``, tokens so far kept); unknown ids are ignored."""
        with self._lock:
            request = self.scheduler.abort(request_id)
            if request is not None:
                self._deliver(self._output(request))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._inflight is not None or bool(self._unclaimed)

    # ---- the loop ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One engine step; returns the online requests that finished (not those a generate() awaits)."""
        with self._lock:
            self._step()
            done, self._unclaimed = self._unclaimed, []
            return done

    def _step(self) -> None:
        if not self.kv.allocated:
            if self.scheduler.has_unfinished():
                raise RuntimeError("the engine is asleep (sleep() was called); call wake_up() before stepping")
            return
        plan = None
        try:
            plan = self.scheduler.schedule(self.policy_version)
            launched = None
            if plan is not None:
                launched = self.runner.execute(plan)
                self.counters.on_launch(plan, self.block_manager.usage)
            previous = launched
            if self.async_mode:
                previous, self._inflight = self._inflight, launched
            if previous is not None:
                self._update(previous)
        except BaseException:
            self._rollback()
            raise
        self.counters.on_step_end()
        # (a step that only collected the in-flight samples made progress: they may free blocks)
        if plan is None and previous is None and self._inflight is None and self.scheduler.has_unfinished():
            raise RuntimeError("scheduler has unfinished requests but nothing to run (bug)")

    def _update(self, pending: PendingStep) -> None:
        for request in self.scheduler.update_from_output(pending.plan, pending.result()):
            self._deliver(self._output(request))

    def _rollback(self) -> None:
        """A step raised: its samples and any in flight are lost; recompute every running sequence."""
        self._inflight = None
        self.failed_request_ids = frozenset(seq.request_id for seq in self.scheduler.running)
        self.scheduler.rollback()
        self.runner.reset()
        self.counters.failed += 1

    def _deliver(self, out: RequestOutput) -> None:
        if out.request_id in self._claimed:
            self._claimed[out.request_id] = out
        else:
            self._unclaimed.append(out)

    def partial_output(self, request_id: str, since: list[int] | None = None) -> RequestOutput | None:
        """A running request's tokens so far (``finished=False``), for streaming; None when unknown or done.

        Only tokens whose value has landed on the host are included (never an in-flight placeholder).
        ``since`` (tokens already seen, per sample index) returns only the later ones and no text: a stream's
        delta, O(new tokens) per step; its reader detokenizes incrementally.
        """
        with self._lock:
            request = self.scheduler.requests.get(request_id)
            return None if request is None else self._output(request, finished=request.finished, since=since)

    def _output(self, request: Request, finished: bool = True, since: list[int] | None = None) -> RequestOutput:
        outs = []
        for seq in request.seqs:
            skip = 0 if since is None else since[seq.index]
            known = seq.token_ids[seq.num_prompt_tokens + skip : seq.num_known_tokens]
            out = CompletionOutput(seq.index, known, seq.logprobs[skip:], seq.finish_reason,
                                   None, seq.policy_versions[skip:], seq.stop_reason)
            if seq.params.logprobs is not None:
                out.top_logprobs = seq.top_logprobs[skip : skip + len(known)]
            if self.tokenizer is not None and since is None:
                out.text = decode_output(self.tokenizer, out.token_ids, seq.params, seq.stop_reason)
            outs.append(out)
        plp, ptop = request.prompt_logprobs, request.prompt_top_logprobs  # copies: a running request's still fill
        cached = min(max(0, request.seqs[0].num_first_cached_tokens), len(request.prompt_token_ids))
        return RequestOutput(request.request_id, request.prompt_token_ids, outs, request.prompt, finished,
                             None if plp is None else list(plp), None if ptop is None else list(ptop),
                             num_cached_tokens=cached)

    def generate(self, prompts: object, sampling_params: object = None, use_tqdm: bool = False) -> list[RequestOutput]:
        """Run the prompts to completion; outputs in prompt order. Safe to call from several threads
        (each call gets its own outputs) and beside a thread calling ``step()``. If it raises (bad input:
        nothing was queued; a failed step or an interrupt: its requests are aborted), the engine is
        left consistent."""
        prompts = normalize_prompts(prompts)
        if not prompts:
            return []
        params = normalize_params(sampling_params, len(prompts))
        ids = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            try:
                ids.append(self._prepare(prompt, p))
            except (ValueError, TypeError) as e:
                raise type(e)(f"prompt {i}: {e}") from None
        with self._lock:
            if not self.kv.allocated:
                raise RuntimeError("the engine is asleep (sleep() was called); call wake_up() before generate()")
            rids = [self._enqueue(None, x, p, prompt) for x, p, prompt in zip(ids, params, prompts)]
            self._claimed.update((r, None) for r in rids)
        return self._wait(rids, use_tqdm, "generate")

    def score(self, sequences: object, logprob_start_len: int = 0, top_logprobs: int = 0,
              sampling_params: SamplingParams | None = None, use_tqdm: bool = False) -> list[RequestOutput]:
        """Teacher-forced logprobs of token sequences, batched through the engine's own prefill and kernels.

        Returns one ``RequestOutput`` per sequence (in order, no completions): ``prompt_logprobs[i]`` is token
        i's logprob given the tokens before it (None for token 0 and before ``logprob_start_len``), and
        ``prompt_top_logprobs[i]`` its ``top_logprobs`` most likely alternatives. The distribution is the one
        generation scores its tokens with: ``sampling_params``' temperature (0: greedy, T = 1),
        ``logprobs_mode`` and filters (default T = 1, ``policy``), so scoring prompt + completion of a
        generation gives back that generation's logprobs. Cached prefix blocks are reused up to
        ``logprob_start_len`` (tokens before it need no logits), and the scored blocks are cached in turn.
        """
        ids, params = prepare_score(sequences, logprob_start_len, top_logprobs, sampling_params, self.tokenizer,
                                    self.model.vocab_size, self.max_model_len, self.kv.num_tokens,
                                    self.workers is not None)
        if not ids:
            return []
        with self._lock:
            if not self.kv.allocated:
                raise RuntimeError("the engine is asleep (sleep() was called); call wake_up() before score()")
            rids = [self._enqueue(None, x, params, None, score_only=True, prompt_lp_start=logprob_start_len)
                    for x in ids]
            self._claimed.update((r, None) for r in rids)
        outs = self._wait(rids, use_tqdm, "score")
        for out in outs:
            out.outputs = []
        return outs

    def _wait(self, rids: list[str], use_tqdm: bool, desc: str) -> list[RequestOutput]:
        """Step until every claimed request is done; on an error abort the rest (the engine stays consistent)."""
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(rids), desc=desc, unit="req")
        try:
            while True:
                with self._lock:
                    done = sum(self._claimed[r] is not None for r in rids)
                    if bar is not None:
                        bar.update(done - bar.n)
                    if done == len(rids):
                        return [self._claimed.pop(r) for r in rids]  # type: ignore[misc]
                    self._step()
        except BaseException:
            with self._lock:
                for r in rids:
                    if self._claimed.get(r) is None:
                        self.scheduler.abort(r)
                    self._claimed.pop(r, None)
            raise
        finally:
            if bar is not None:
                bar.close()

    # ---- weights and memory ------------------------------------------------------------------
    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]] | dict, version: int | None = None,
        recompute_running: bool = True,
    ) -> int:
        """Validate every tensor, then copy all in place at a step boundary; returns the new version.

        ``version``: an int in [current, 2**63), or None for current + 1 (``check_version``); anything else
        raises ValueError before a tensor is read, the old weights untouched. Every weight path (server,
        pool, client, disk) ends here, and nothing else writes ``policy_version``.

        A step still in flight is collected first (its tokens belong to the old version). Running
        sequences then drop their KV and are recomputed under the new weights, so every later token is
        exactly the new policy's given its whole context (``recompute_running=False`` keeps the old KV:
        cheaper, but later tokens then depend on KV the old weights computed).
        """
        with self._lock:
            new = self.check_version(version)
            if self._inflight is not None:
                pending, self._inflight = self._inflight, None
                try:
                    self._update(pending)
                except BaseException:
                    self._rollback()
                    raise
            self.weights.apply(named_tensors)
            self.block_manager.reset_prefix_cache()
            if recompute_running:
                self.scheduler.recompute_running()
            self.policy_version = new  # the one place a policy version is written
            return new

    def check_version(self, version: object) -> int:
        """The version ``update_weights(..., version)`` would set: ``version`` itself, an int in
        [current, 2**63), or current + 1 for None; ValueError otherwise. Receivers ask before bytes move."""
        current = self.policy_version
        if version is None:
            version = current + 1
        if isinstance(version, bool) or not isinstance(version, int) or not current <= version < MAX_VERSION:
            raise ValueError(f"version must be an int in [{current}, 2**63) (not lower than the current policy "
                             f"version {current}) or None (current + 1), got {version!r}")
        return version

    def sleep(self, level: int = 1) -> int:
        """Free the KV cache (level 2: also move weights to the CPU) for a co-located trainer.

        Returns the bytes released on the engine's device. Requests must be finished or aborted first.
        """
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        with self._lock:
            if self.scheduler.has_unfinished() or self._inflight is not None or self.scheduler.parked:
                raise RuntimeError("sleep() while requests are running; finish or abort them first")
            if not self.kv.allocated:
                return 0
            self.block_manager.reset_prefix_cache()
            self.runner.release()
            released = self.kv.release()
            if level == 2:
                released += sum(p.numel() * p.element_size() for p in self.model.parameters())
                self._offload_weights("cpu")
            self._sleep_level = level
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            return released

    def wake_up(self) -> None:
        """Restore what ``sleep`` released; outputs afterwards equal those before the sleep."""
        with self._lock:
            if self.kv.allocated:
                return
            if self._sleep_level == 2:
                self._offload_weights(self.device)
            self.kv.allocate()
            self.runner.restore()
            self._sleep_level = 0

    @property
    def is_sleeping(self) -> bool:
        return not self.kv.allocated

    def _offload_weights(self, device: torch.device | str) -> None:
        # Parameters move by swapping .data so module structure (and WeightMapper's handles) survive.
        if self.workers is not None:
            self.workers.call("offload", torch.device(device).type == "cpu")
        with torch.no_grad():
            for t in list(self.model.parameters()) + list(self.model.buffers()):
                t.data = t.data.to(device, non_blocking=False)

    @property
    def limits(self) -> BackendLimits:
        return BackendLimits(self.max_model_len, int(self.model.vocab_size), self.config.max_num_seqs,
                             self.num_blocks * self.config.block_size)

    def describe(self) -> dict[str, object]:
        return {**dataclasses.asdict(self.config), "dtype": str(self.dtype).removeprefix("torch."),
                "device": str(self.device), "max_model_len": self.max_model_len, "num_blocks": self.num_blocks,
                "async_mode": self.async_mode, "attention_backend_resolved": self.attn.backend}

    def close(self) -> None:
        """Stop the tensor-parallel ranks (if any); the engine is not used afterwards."""
        if self.workers is not None:
            self.workers.shutdown()
            self.workers = None

    def get_stats(self) -> EngineStats:
        with self._lock:
            c, s = self.counters, self.scheduler
            compute = self.runner.compute_seconds
            kv_bytes = self.kv.storage.numel() * self.kv.storage.element_size() if self.kv.allocated else 0
            return EngineStats(s.num_running, s.num_waiting, self.block_manager.usage, c.steps, s.num_preemptions,
                               s.num_generated_tokens, c.prompt, c.scheduled, c.busy_frac(compute),
                               self.policy_version, compute, c.bytes, kv_bytes, self.kv.num_tokens, c.failed,
                               c.kv_usage, s.num_first_tokens, s.num_started_prompt_tokens, s.num_prefix_cached_tokens,
                               s.num_swap_outs,
                               s.num_swapped_out_blocks, s.num_swapped_out_blocks * self.kv.block_bytes,
                               s.num_swap_ins, num_prefill_tokens=s.num_prefill_tokens)

