"""The engine: requests in, finished outputs out. The loop is schedule -> run -> postprocess.

In async mode the order becomes schedule N+1 -> launch N+1 -> collect N -> postprocess N, so the
host prepares the next batch while the device computes; a stop is then seen one step late and the
extra token is dropped by ``Scheduler.finish``.
"""

from __future__ import annotations

import itertools
import random
import threading
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from rollout.config import EngineConfig
from rollout.engine import loading
from rollout.engine.block_manager import BlockManager
from rollout.engine.cuda_runner import CudaModelRunner
from rollout.engine.kv_cache import KVCache
from rollout.engine.model_runner import ModelRunner, PendingStep
from rollout.engine.scheduler import Scheduler, SchedulerLimits
from rollout.engine.sequence import Request, Sequence
from rollout.engine.stop import check_stop, truncate_at_stop
from rollout.engine.validation import check_lengths, normalize_params, to_token_ids
from rollout.engine.weight_sync import WeightSync
from rollout.layers.backends import make_attention_backend
from rollout.outputs import CompletionOutput, RequestOutput
from rollout.sampling_params import SamplingParams


@dataclass(slots=True)
class EngineStats:
    num_running_seqs: int
    num_waiting_seqs: int
    kv_cache_usage: float
    num_steps: int
    num_preemptions: int
    num_generated_tokens: int
    num_prompt_tokens: int
    num_scheduled_seqs: int
    gpu_busy_frac: float | None  # compute-stream time / wall time, first to latest step (None on CPU)
    policy_version: int
    gpu_compute_s: float | None = None  # cumulative compute-stream time: a window's busy = delta / its wall
    bytes_read: int = 0  # cumulative bytes the steps had to read (weights + live KV): the byte floor's numerator
    kv_cache_usage_sum: float = 0.0  # kv_cache_usage summed over steps: a window's mean = delta / delta num_steps


class Engine:
    def __init__(self, model: torch.nn.Module, hf_config: object, config: EngineConfig, device: torch.device,
                 tokenizer: object | None = None, eos_ids: frozenset[int] = frozenset()) -> None:
        self.model, self.hf_config, self.config, self.device = model, hf_config, config, device
        self.tokenizer, self.eos_ids = tokenizer, eos_ids
        self.dtype = next(model.parameters()).dtype
        limit = getattr(hf_config, "max_position_embeddings", None) or 2048
        if config.max_model_len is not None and config.max_model_len > limit:
            raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's max_position_embeddings "
                             f"{limit}; allowed: 1 .. {limit}")
        self.max_model_len = config.max_model_len or limit
        self.kv = KVCache(model, config, device, self.dtype, self.max_model_len)
        self.num_blocks = self.kv.num_blocks
        self.async_mode = (device.type == "cuda") if config.async_mode is None else config.async_mode
        self.block_manager = BlockManager(self.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerLimits(config.max_num_seqs, config.max_num_batched_tokens), self.block_manager
        )
        self._sleep_level = 0
        self.kv_caches = self.kv.layers
        self.attn_backend = make_attention_backend(config.attention_backend, device, config.block_size)
        self.runner = self._make_runner()
        self.weights = WeightSync(model)
        self.policy_version = 0
        self._rng = random.Random(config.seed)
        self._seq_ids = itertools.count()
        self._arrivals = itertools.count()
        self._inflight: PendingStep | None = None
        self._lock = threading.RLock()
        self._finished: list[RequestOutput] = []
        self._stats = dict(steps=0, generated=0, prompt=0, scheduled=0, bytes=0, kv_usage=0.0)
        self._weight_bytes = model.weight_bytes_per_step()
        self._t_first: float | None = None
        self._t_last = 0.0

    def _make_runner(self) -> ModelRunner | CudaModelRunner:
        c = self.config
        if self.device.type != "cuda":
            return ModelRunner(self.model, self.kv_caches, c.block_size, self.attn_backend, self.device)
        graphs = c.cuda_graphs if c.cuda_graphs is not None else self.attn_backend.name != "torch"
        if graphs and self.attn_backend.name == "torch":
            raise ValueError("cuda_graphs=True needs a graph-capturable attention backend ('triton'), not 'torch'")
        return CudaModelRunner(
            self.model, self.kv_caches, c.block_size, self.attn_backend, self.device,
            max_num_seqs=c.max_num_seqs, max_num_batched_tokens=c.max_num_batched_tokens,
            max_model_len=self.max_model_len, cuda_graphs=graphs, max_graph_batch_size=c.max_graph_batch_size,
        )

    @classmethod
    def from_pretrained(cls, model: object, dtype: str | torch.dtype = "auto", device: str | None = None,
                        tokenizer: object | None = None, **engine_options: object) -> Engine:
        config = EngineConfig.from_options(**engine_options)
        dev = loading.resolve_device(device)
        net, hf_config = loading.build_model(model, dtype, dev)
        tok = loading.load_tokenizer(model, tokenizer)
        return cls(net, hf_config, config, dev, tok, loading.eos_token_ids(model, hf_config, tok))

    # ---- requests ----------------------------------------------------------------------------
    def add_request(self, prompt: object, sampling_params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        params = normalize_params(sampling_params, 1)[0]
        ids = to_token_ids(prompt, self.tokenizer, self.model.vocab_size)
        check_lengths(len(ids), params, self.max_model_len, self.kv.num_tokens)
        with self._lock:
            request_id = request_id if request_id is not None else uuid.uuid4().hex
            if request_id in self.scheduler.requests:
                raise ValueError(f"request_id {request_id!r} is already in use")
            self.scheduler.add(self._make_request(request_id, ids, params, prompt))
        return request_id

    def _make_request(self, request_id: str, ids: list[int], params: SamplingParams, prompt: object) -> Request:
        arrival = next(self._arrivals)
        base_seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        stop_ids = tuple(sorted(params.stop_set | (frozenset() if params.ignore_eos else self.eos_ids)))
        seqs: list[Sequence] = []
        for i in range(params.n):
            seq = Sequence(next(self._seq_ids), request_id, i, list(ids), len(ids), params, arrival,
                           parent=seqs[0] if seqs else None, stop_ids=stop_ids)
            seq.sample_seed = (base_seed + 0x9E3779B97F4A7C15 * i) & ((1 << 63) - 1)
            seqs.append(seq)
        return Request(request_id, ids, params, seqs, prompt if isinstance(prompt, str) else None, arrival)

    def abort(self, request_id: str) -> None:
        with self._lock:
            request = self.scheduler.abort(request_id)
            if request is not None:
                self._finished.append(self._output(self.scheduler.pop_finished(request_id)))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._inflight is not None or bool(self._finished)

    # ---- the loop ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One engine step; returns the requests that finished in it."""
        with self._lock:
            plan = self.scheduler.schedule(self.policy_version)
            if plan is not None and self._t_first is None:
                self._t_first = time.perf_counter()
            launched = self.runner.execute(plan) if plan is not None else None
            if plan is not None:
                self._stats["steps"] += 1
                self._stats["scheduled"] += len(plan.seqs)
                self._stats["kv_usage"] += self.block_manager.usage
                self._stats["bytes"] += self._weight_bytes + sum(sp.seq_len for sp in plan.seqs) * self.kv.token_bytes
                seqs = self.scheduler.seqs
                self._stats["prompt"] += sum(
                    max(0, min(s.seq_len, seqs[s.seq_id].num_prompt_tokens) - s.start_pos) for s in plan.seqs
                )
            if self.async_mode:
                previous, self._inflight = self._inflight, launched
                if previous is not None:
                    self._postprocess(previous)
            elif launched is not None:
                self._postprocess(launched)
            if plan is None and self._inflight is None and self.scheduler.has_unfinished():
                raise RuntimeError("scheduler has unfinished requests but nothing to run (bug)")
            self._t_last = time.perf_counter()
            done, self._finished = self._finished, []
            return done

    def _postprocess(self, pending: PendingStep) -> None:
        result = self.runner.collect(pending)
        for seq in self.scheduler.fill(pending.plan, result, pending.plan.policy_version):
            self._stats["generated"] += 1
            stop = check_stop(seq, self.eos_ids, self.tokenizer)
            if stop is not None:
                self.scheduler.finish(seq, *stop)
                request = self.scheduler.pop_finished(seq.request_id)
                if request is not None:
                    self._finished.append(self._output(request))

    def partial_output(self, request_id: str) -> RequestOutput | None:
        """A running request's tokens so far (``finished=False``), for streaming; None when unknown or done.

        Only tokens whose value has landed on the host are included (never an in-flight placeholder).
        """
        with self._lock:
            request = self.scheduler.requests.get(request_id)
            return None if request is None else self._output(request, finished=request.finished)

    def _output(self, request: Request, finished: bool = True) -> RequestOutput:
        outs = []
        for seq in request.seqs:
            known = seq.token_ids[seq.num_prompt_tokens : seq.num_known_tokens]
            out = CompletionOutput(seq.index, known, list(seq.logprobs), seq.finish_reason,
                                   None, list(seq.policy_versions), seq.stop_reason)
            if self.tokenizer is not None:
                out.text = self.tokenizer.decode(out.token_ids, skip_special_tokens=True)
                if isinstance(seq.stop_reason, str):
                    out.text = truncate_at_stop(out.text, seq.stop_reason)
            outs.append(out)
        return RequestOutput(request.request_id, request.prompt_token_ids, outs, request.prompt, finished)

    def generate(self, prompts: object, sampling_params: object = None, use_tqdm: bool = False) -> list[RequestOutput]:
        if isinstance(prompts, str):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise TypeError(f"prompts must be a list of str or of token-id lists, got {type(prompts).__name__}")
        if not prompts:
            return []
        params = normalize_params(sampling_params, len(prompts))
        # Validate everything before queueing anything: a bad prompt leaves the engine untouched.
        ids = [to_token_ids(p, self.tokenizer, self.model.vocab_size) for p in prompts]
        for i, (x, p) in enumerate(zip(ids, params)):
            try:
                check_lengths(len(x), p, self.max_model_len, self.kv.num_tokens)
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
        rids = [self.add_request(prompt, p) for prompt, p in zip(prompts, params)]
        wanted = set(rids)
        results: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(rids), desc="generate", unit="req")
        others: list[RequestOutput] = []
        while wanted - results.keys():
            for out in self.step():
                if out.request_id in wanted:
                    results[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
                else:
                    others.append(out)  # someone else's online request: handed to their next step()
        self._finished.extend(others)
        if bar is not None:
            bar.close()
        return [results[r] for r in rids]

    # ---- weights and memory ------------------------------------------------------------------
    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]] | dict, version: int | None = None,
        recompute_running: bool = True,
    ) -> int:
        """Validate every tensor, then copy all in place at a step boundary; returns the new version.

        A step still in flight is collected first (its tokens belong to the old version). Running
        sequences then drop their KV and are recomputed under the new weights, so every later token is
        exactly the new policy's given its whole context (``recompute_running=False`` keeps the old KV:
        cheaper, but later tokens then depend on KV the old weights computed).
        """
        if version is not None and (isinstance(version, bool) or not isinstance(version, int)):
            raise TypeError(f"version must be an int or None, got {version!r}")
        with self._lock:
            if self._inflight is not None:
                pending, self._inflight = self._inflight, None
                self._postprocess(pending)
            self.weights.apply(named_tensors)
            self.block_manager.reset_prefix_cache()
            if recompute_running:
                self.scheduler.recompute_running()
            self.policy_version = self.policy_version + 1 if version is None else version
            return self.policy_version

    def sleep(self, level: int = 1) -> int:
        """Free the KV cache (level 2: also move weights to the CPU) for a co-located trainer.

        Returns the bytes released on the engine's device. Requests must be finished or aborted first.
        """
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        with self._lock:
            if self.scheduler.has_unfinished() or self._inflight is not None:
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
            self.runner.restore(self.kv_caches)
            self._sleep_level = 0

    @property
    def is_sleeping(self) -> bool:
        return not self.kv.allocated

    def _offload_weights(self, device: torch.device | str) -> None:
        # Parameters move by swapping .data so module structure (and WeightMapper's handles) survive.
        with torch.no_grad():
            for t in list(self.model.parameters()) + list(self.model.buffers()):
                t.data = t.data.to(device, non_blocking=False)

    def get_stats(self) -> EngineStats:
        s = self._stats
        busy = None
        compute_ms = getattr(self.runner, "compute_ms_total", 0.0)
        if compute_ms and self._t_first is not None and self._t_last > self._t_first:
            busy = min(1.0, compute_ms / 1e3 / (self._t_last - self._t_first))
        return EngineStats(self.scheduler.num_running, self.scheduler.num_waiting, self.block_manager.usage,
                           s["steps"], self.scheduler.num_preemptions, s["generated"], s["prompt"],
                           s["scheduled"], busy, self.policy_version,
                           compute_ms / 1e3 if self.device.type == "cuda" else None, s["bytes"], s["kv_usage"])
