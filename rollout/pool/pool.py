"""``RolloutPool``: N Ray actors, each owning an ``Engine``, behind ``Engine.generate``'s shape.

    pool = RolloutPool(2, EngineFactory("Qwen/Qwen2.5-1.5B", dtype="bfloat16"), gpus_per_replica=1)
    outs = pool.generate(prompts, SamplingParams(n=8, max_tokens=512))   # list[RequestOutput], input order
    pool.update_weights(model.named_parameters(), version=step)         # broadcast to every replica

Work is handed out group by group as replicas free up (``dispatch.Dispatcher``). A request without a
seed gets one from the pool's own generator before it is dispatched, so its tokens do not depend on
which replica runs it, and a group resubmitted after a replica died comes back with the same tokens.

Single requests: ``submit(prompt, params, routing_key)`` (``rollout.RequestBackend``) sends one request to one
replica at once and returns a future; requests with the same ``routing_key`` (an environment conversation's
turns) go to the same replica while it takes work (``dispatch.Affinity``), whose prefix cache then serves the
earlier turns. A replica that dies is replaced and the requests it held are sent again to a live one (their seed
is fixed when submitted, so the tokens are the same); only a bad request fails.

Faults: a replica whose actor dies mid-round (``ray.kill``, a crashed process, a lost node) has its
unfinished groups put back at the head of the queue for the others; a replacement actor starts in the
background, copies a survivor's weights and version (``Replica.export_state``) and only then takes work.
The round's ``last_round`` metrics name the failed replica and the resubmitted groups.

Weights: the process that calls ``update_weights`` (the trainer) is rank 0 of a ``TransferGroup`` and
the replicas are ranks 1..N (gloo on CPU, NCCL on GPUs); the bytes travel as ``rollout.weights``' flat
buckets and each replica applies them with ``Engine.update_weights``, the server's code path. No
group is dispatched while a push is in flight, so every replica is at the same ``policy_version``
before any takes new work. With ``colocate_with_trainer`` replica 0 runs on the trainer's own device
(``colocate``) and takes the same push by handle (CUDA IPC / shared memory) instead of by broadcast.

Memory: ``sleep(level, replicas)`` / ``wake_up(replicas)`` / ``is_sleeping`` are ``Engine``'s, per replica
(``pool.sleep``: a sleeping replica takes no work, a push reaches it, one that dies comes back asleep).
``sleep()`` without ``replicas`` sleeps ``sleep_replicas`` (default: all); ``wake_up()`` wakes every one.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, fields, replace
from typing import Any

from rollout.api import BackendLimits
from rollout.engine.stats import EngineStats
from rollout.engine.validation import normalize_params, normalize_prompts
from rollout.outputs import RequestOutput
from rollout.pool import colocate, ray_setup
from rollout.pool import sleep as pool_sleep
from rollout.pool.colocate import TrainerPlace
from rollout.pool.dispatch import Affinity, Dispatcher, Slot
from rollout.pool.replica import Replica
from rollout.pool.round_queue import RoundQueue
from rollout.pool.transfer import PoolTransfer
from rollout.sampling_params import SamplingParams
from rollout.weights.names import named_weights


@dataclass
class _Member:
    """One replica slot: its current actor (replaced after a death) and where it stands."""

    actor: Any = None
    generation: int = 0
    state: str = "starting"  # starting -> catching_up -> [falling_asleep ->] active
    pending: Any = None  # ObjectRef of ready() or load_state() while starting / catching up
    capacity: int = 0
    colocated: bool = False  # on the trainer's device: weights by handle, not by broadcast
    info: dict[str, Any] | None = None  # the actor's ready() answer (device, GPU uuid, node, pid)
    sleep_level: int = 0  # 0 awake; 1 or 2 as sleep() asked: a replacement is brought to it too


class RolloutPool:
    def __init__(self, replicas: int, engine_factory: Callable[[], Any], address: str = "local",
                 gpus_per_replica: float = 0, cpus_per_replica: float = 1, max_inflight_seqs: int | None = None,
                 seed: int = 0, transfer_timeout_s: float = 600.0, start_timeout_s: float = 600.0,
                 torch_threads: int | None = None, colocate_with_trainer: bool = False,
                 trainer_device: Any = None, sleep_replicas: list[int] | None = None) -> None:
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
            raise ValueError(f"replicas must be an int >= 1, got {replicas!r}")
        if not callable(engine_factory):
            raise TypeError(f"engine_factory must be a callable returning an Engine, got {engine_factory!r}")
        if max_inflight_seqs is not None and (not isinstance(max_inflight_seqs, int) or max_inflight_seqs < 1):
            raise ValueError(f"max_inflight_seqs must be an int >= 1 or None, got {max_inflight_seqs!r}")
        if not isinstance(colocate_with_trainer, bool):
            raise TypeError(f"colocate_with_trainer must be a bool, got {colocate_with_trainer!r}")
        # Which replicas sleep() puts to sleep when not told: the training scripts pass the co-located one
        # only (trainer_hooks.train_setup.make_pool says why); None = all, as one Engine sleeps whole.
        self.sleep_replicas = None if sleep_replicas is None else pool_sleep.check_indices(
            sleep_replicas, replicas, "sleep_replicas")
        self.ray = ray_setup.init(address, num_cpus=replicas * cpus_per_replica + 1)
        ray_setup.check_gpus(self.ray, replicas, gpus_per_replica)
        self.address = address
        self.engine_factory, self.torch_threads = engine_factory, torch_threads
        self.max_inflight_seqs = max_inflight_seqs
        self.start_timeout_s = start_timeout_s
        actor = dict(num_cpus=cpus_per_replica, num_gpus=gpus_per_replica, max_restarts=0, max_concurrency=1000)
        self._actor_cls = self.ray.remote(Replica).options(**actor)
        self.place: TrainerPlace | None = None  # the trainer's device and node, with a co-located replica
        if colocate_with_trainer:
            self.place = TrainerPlace.here(self.ray, trainer_device)
            actor.update(colocate.actor_options(self.ray, self.place, gpus_per_replica))
            self._colocated_cls = self.ray.remote(Replica).options(**actor)
        self._rng = random.Random(seed)
        self._lock = threading.RLock()  # dispatch vs weight pushes
        self._round = 0
        self._rounds_open = 0  # generate_iter calls not yet finished: sleep() waits for none
        self.last_round: dict[str, Any] = {}
        self.failures: list[dict[str, Any]] = []  # every replica death seen, all rounds
        self.members: list[_Member] = []
        self._rounds = RoundQueue(self)  # the step surface: add_request / step / abort
        self._affinity = Affinity()  # submit(): which replica takes a request sent on its own
        self._route_lock = threading.Lock()  # submit() vs its requests' completion callbacks (Ray's threads)
        self._submitted = 0
        self.transfer = PoolTransfer(self, transfer_timeout_s)
        try:
            for i in range(replicas):
                self.members.append(self._start(i, _Member(colocated=colocate_with_trainer and i == 0)))
                if i == 0 and colocate_with_trainer and actor["num_gpus"]:
                    # Ray hands out the lowest free GPU first, and does not know this process (the trainer,
                    # typically on cuda:0) uses one: replica 0 must get it, not a broadcast replica, so the
                    # others start once replica 0 holds it (its UUID is checked against the trainer's)
                    self.ray.wait([self.members[0].pending], timeout=start_timeout_s)
            self.wait_ready()
        except BaseException:
            self.shutdown()  # a replica that cannot start (or sits on the wrong device) takes the pool down
            raise

    # ---- membership ------------------------------------------------------------------------------
    def _start(self, index: int, member: _Member) -> _Member:
        if member.colocated:
            assert self.place is not None
            member.actor = self._colocated_cls.remote(self.engine_factory, index, self.torch_threads,
                                                      self.place.device_uuid)
        else:
            member.actor = self._actor_cls.remote(self.engine_factory, index, self.torch_threads)
        member.generation += 1
        member.state, member.pending = "starting", member.actor.ready.remote()
        return member

    def wait_ready(self, timeout_s: float | None = None) -> None:
        """Block until every replica is active (started and at the pool's weights)."""
        deadline = time.monotonic() + (timeout_s or self.start_timeout_s)
        while any(m.state != "active" for m in self.members):
            pending = [m.pending for m in self.members if m.pending is not None]
            if time.monotonic() > deadline:
                raise TimeoutError(f"replicas not ready within {timeout_s or self.start_timeout_s} s: "
                                   f"{[m.state for m in self.members]}")
            self.ray.wait(pending, num_returns=1, timeout=1.0)
            self._advance_members()

    def _advance_members(self) -> None:
        """Move starting / catching-up replicas on when their pending call has answered (never blocks)."""
        with self._lock:
            for i, m in enumerate(self.members):
                if m.pending is None or not self.ray.wait([m.pending], timeout=0)[0]:
                    continue
                try:
                    answer = self.ray.get(m.pending)
                except self.ray.exceptions.RayActorError:
                    self._replace(i, "died while starting", [])
                    continue
                m.pending = None
                if m.state == "starting":
                    m.info = answer
                    if self.place is not None:
                        colocate.check_replica(i, answer, self.place, m.colocated)
                    # Default: a running batch plus one batch waiting inside the engine, so a slot freed
                    # by a finished sample is refilled at once, not after the driver's round trip.
                    m.capacity = self.max_inflight_seqs or 2 * answer["max_num_seqs"]
                    self._catch_up(i, m, answer["policy_version"])
                elif m.state == "catching_up":
                    self._catch_up(i, m, answer)
                elif m.state == "falling_asleep":
                    m.state = "active"

    def _catch_up(self, index: int, m: _Member, version: int) -> None:
        """Active if at the pool's version (after sleeping first, in a sleeping slot); else copy a survivor's
        state (again, if a push raced it)."""
        if version == self.policy_version:
            if m.sleep_level:
                m.state, m.pending = "falling_asleep", m.actor.sleep.remote(m.sleep_level)
            else:
                m.state = "active"
            return
        donors = [d for d in self.members if d.state == "active"]
        if not donors:
            raise RuntimeError(f"replica {index} needs weights at version {self.policy_version} but no replica "
                               "holds them any more; push the weights again")
        state = donors[0].actor.export_state.remote()
        m.state, m.pending = "catching_up", m.actor.load_state_from.remote(state)

    def _replace(self, index: int, reason: str, resubmitted: list[int]) -> None:
        m = self.members[index]
        self.failures.append({"replica": index, "generation": m.generation, "reason": reason,
                              "resubmitted": resubmitted, "round": self._round})
        try:
            self.ray.kill(m.actor, no_restart=True)
        except Exception:  # noqa: BLE001 - it is gone already
            pass
        self.transfer.invalidate()  # the weight group counted the dead rank: rebuilt on the next push
        self._start(index, m)

    # ---- generation ------------------------------------------------------------------------------
    def generate(self, prompts: Any, sampling_params: Any = None, use_tqdm: bool = False) -> list[RequestOutput]:
        """``Engine.generate`` across the pool: one RequestOutput per prompt, in input order."""
        if isinstance(prompts, str):
            prompts = [prompts]
        results: list[RequestOutput | None] = [None] * len(prompts)
        for i, out in self.generate_iter(prompts, sampling_params):
            results[i] = out
        return results  # type: ignore[return-value]

    # The step surface (SteppedBackend): a round of queued requests, one finished group per step().
    def add_request(self, prompt: Any, sampling_params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        return self._rounds.add_request(prompt, sampling_params, request_id)

    def step(self) -> list[RequestOutput]:
        return self._rounds.step()

    def abort(self, request_id: str) -> None:
        self._rounds.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self._rounds.has_unfinished_requests()

    # The request surface (RequestBackend): one request answered on its own, sent at once (the environment
    # loop's turns). A request with a routing_key goes to the replica that key went to before (its prefix cache
    # holds the key's earlier requests: a conversation's earlier turns), else to the least busy one.
    def submit(self, prompt: Any, sampling_params: SamplingParams | None = None,
               routing_key: str | None = None) -> Future[RequestOutput]:
        """One prompt's request on one replica, sent now; the future holds its ``RequestOutput`` or the error (a
        bad prompt's ValueError). A replica that dies with the request is replaced and the request sent again
        to a live one (at most once per replica; the seed is fixed here, so the tokens are the same)."""
        params = self._seeded(sampling_params or SamplingParams())
        if self.sleeping_replicas:
            raise RuntimeError(f"replicas {self.sleeping_replicas} are asleep (sleep() was called); call wake_up() "
                               "before submit()")
        result: Future[RequestOutput] = Future()
        self._send(prompt, params, routing_key, result, len(self.members))
        return result

    def _send(self, prompt: Any, params: SamplingParams, key: str | None, result: Future, resends: int) -> None:
        self._advance_members()
        if not any(self._takes_work(m) for m in self.members):
            self.wait_ready()
        with self._lock, self._route_lock:
            active = [i for i, m in enumerate(self.members) if self._takes_work(m)]
            i = self._affinity.pick(key, active)
            self._submitted += 1
            m = self.members[i]
            ref, generation = m.actor.run.remote(f"s{self._submitted}", prompt, params), m.generation
        ref.future().add_done_callback(
            lambda fut: self._sent(fut, i, generation, (prompt, params, key, result), resends))

    def _sent(self, fut: Future, replica: int, generation: int, request: tuple, resends: int) -> None:
        """A submitted request's answer, on Ray's own thread (no Ray call may run here): hand it over, or resend
        it from a thread of its own if its replica died."""
        self._request_done(replica)
        result: Future = request[3]
        error = fut.exception()
        if isinstance(error, self.ray.exceptions.RayActorError) and resends > 0:
            threading.Thread(target=self._resend, args=(replica, generation, request, resends - 1), daemon=True,
                             name="rollout-pool-resend").start()
        elif error is not None:
            result.set_exception(error)
        else:
            result.set_result(fut.result())

    def _resend(self, replica: int, generation: int, request: tuple, resends: int) -> None:
        try:
            with self._lock:
                if self.members[replica].generation == generation:  # not replaced yet (by a round or a request)
                    self._replace(replica, "actor died (a submitted request)", [])
            self._send(*request, resends)
        except BaseException as e:  # noqa: BLE001 - the caller's future carries it
            request[3].set_exception(e)

    def _request_done(self, replica: int) -> None:
        with self._route_lock:
            self._affinity.done(replica)

    def generate_iter(self, prompts: Any, sampling_params: Any = None) -> Iterator[tuple[int, RequestOutput]]:
        """(input index, RequestOutput) as groups finish: each group exactly once, whatever replicas die."""
        prompts = normalize_prompts(prompts)
        if not prompts:
            return
        params = [self._seeded(p) for p in normalize_params(sampling_params, len(prompts))]
        asleep = self.sleeping_replicas
        if asleep:
            raise RuntimeError(f"replicas {asleep} are asleep (sleep() was called); call wake_up() before generate()")
        self._validate(prompts, params)
        self._round += 1
        self._rounds_open += 1
        try:
            yield from self._run_round(list(prompts), params)
        finally:
            self._rounds_open -= 1

    def _seeded(self, p: SamplingParams) -> SamplingParams:
        return p if p.seed is not None else replace(p, seed=self._rng.getrandbits(63))

    def _validate(self, prompts: list[Any], params: list[SamplingParams]) -> None:
        """Refuse a bad prompt before anything is dispatched (an active replica checks them all)."""
        for _ in range(len(self.members) + 1):
            self.wait_ready()
            i, m = next((i, m) for i, m in enumerate(self.members) if m.state == "active")
            try:
                self.ray.get(m.actor.validate.remote(prompts, params))
                return
            except self.ray.exceptions.RayActorError:
                with self._lock:
                    self._replace(i, "actor died (found idle)", [])
            except self.ray.exceptions.RayTaskError as e:
                raise e.as_instanceof_cause() from None
        raise RuntimeError("every replica died while checking the prompts")

    def _reap_dead(self) -> list[int]:
        """Replace every active replica whose actor no longer answers; their indices."""
        probes = [(i, m.actor.ready.remote()) for i, m in enumerate(self.members) if m.state == "active"]
        dead = []
        for i, ref in probes:
            try:
                self.ray.get(ref, timeout=60)
            except self.ray.exceptions.RayActorError:
                dead.append(i)
                self._replace(i, "actor died (found idle)", [])
        return dead

    def _run_round(self, prompts: list[Any], params: list[SamplingParams]) -> Iterator[tuple[int, RequestOutput]]:
        ray = self.ray
        t0 = time.perf_counter()
        slots = {i: Slot(m.capacity, active=self._takes_work(m)) for i, m in enumerate(self.members)}
        longest_first = sorted(range(len(params)), key=lambda g: -params[g].max_tokens)  # stable: ties in order
        disp = Dispatcher([p.n for p in params], slots, longest_first)
        inflight: dict[Any, tuple[int, int, int]] = {}  # ref -> (group, replica, actor generation)
        failed0 = len(self.failures)
        per_replica = {i: 0 for i in slots}
        tokens = 0
        while not disp.finished:
            self._advance_members()
            with self._lock:
                for i, m in enumerate(self.members):
                    slots[i].active = self._takes_work(m)
                while (a := disp.next_assignment()) is not None:
                    g, i = a
                    m = self.members[i]
                    ref = m.actor.run.remote(f"r{self._round}-g{g}", prompts[g], params[g])
                    inflight[ref] = (g, i, m.generation)
            waiting = list(inflight) + [m.pending for m in self.members if m.pending is not None]
            if not waiting:
                raise RuntimeError("no replica is alive or starting; the round cannot finish")
            done, _ = ray.wait(waiting, num_returns=1, timeout=1.0)
            for ref in done:
                if ref not in inflight:
                    continue  # a member's ready / catch-up: handled by _advance_members
                g, i, gen = inflight.pop(ref)
                try:
                    out = ray.get(ref)
                except ray.exceptions.RayActorError:
                    self._on_death(i, gen, disp, inflight)
                    continue
                except ray.exceptions.RayTaskError as e:
                    raise e.as_instanceof_cause() from None
                if disp.finish(g, i):
                    per_replica[i] += 1
                    tokens += sum(len(c.token_ids) for c in out.outputs)
                    yield g, out
        wall = time.perf_counter() - t0
        self.last_round = {
            "round": self._round, "groups": len(prompts), "wall_s": wall, "generated_tokens": tokens,
            "tokens_per_s": tokens / wall if wall > 0 else 0.0, "groups_per_replica": per_replica,
            "failures": self.failures[failed0:],
            "resubmitted_groups": sorted(g for f in self.failures[failed0:] for g in f["resubmitted"]),
        }

    @staticmethod
    def _takes_work(m: _Member) -> bool:
        return m.state == "active" and not m.sleep_level

    def _on_death(self, index: int, generation: int, disp: Dispatcher, inflight: dict[Any, tuple[int, int, int]]
                  ) -> None:
        """A replica's actor died: requeue its unfinished groups, forget their refs, start a replacement."""
        with self._lock:
            m = self.members[index]
            if m.generation != generation:
                return  # an older actor of this slot: already handled
            lost = disp.fail(index)
            for ref in [r for r, (_, i, _) in inflight.items() if i == index]:
                del inflight[ref]
            self._replace(index, "actor died", lost)

    # ---- weights ---------------------------------------------------------------------------------
    @property
    def policy_version(self) -> int:
        """The version every replica's engine reported after the last push (0 before any)."""
        return self.transfer.version

    def update_weights(self, named_tensors: Any, version: int | None = None, recompute_running: bool = True,
                       bucket_bytes: int | None = None) -> int:
        """Broadcast (name, tensor) pairs from this process to every replica; returns the shared new version."""
        pairs = list(named_weights(named_tensors))  # references, walked by each attempt
        with self._lock:
            for attempt in (0, 1):
                self.wait_ready()
                try:
                    new = self.transfer.push(pairs, version, recompute_running, bucket_bytes)
                    break
                except self.ray.exceptions.RayActorError:
                    # A replica died before or during the push; every other one kept its old weights.
                    # Replace it (the replacement copies a survivor's state) and push once more.
                    self.transfer.close()
                    if not self._reap_dead() or attempt:
                        raise
            return new

    # ---- memory ----------------------------------------------------------------------------------
    def sleep(self, level: int = 1, replicas: list[int] | None = None) -> int:
        """``Engine.sleep`` on ``replicas`` (default ``sleep_replicas``: all unless the pool was told);
        the bytes released. Refused while a round runs; returns once each of them is asleep."""
        indices = pool_sleep.check_indices(replicas if replicas is not None else
                                           self.sleep_replicas or range(len(self.members)), len(self.members))
        return pool_sleep.put_to_sleep(self, level, indices)

    def wake_up(self, replicas: list[int] | None = None) -> None:
        """``Engine.wake_up`` on ``replicas`` (default: every sleeping one); returns once they are awake."""
        n = len(self.members)
        pool_sleep.wake(self, pool_sleep.check_indices(range(n) if replicas is None else replicas, n))

    @property
    def is_sleeping(self) -> bool:
        """True while any replica sleeps (``generate`` then refuses, as a sleeping ``Engine``'s does)."""
        return bool(self.sleeping_replicas)

    @property
    def sleeping_replicas(self) -> list[int]:
        return [i for i, m in enumerate(self.members) if m.sleep_level]

    # ---- metrics ---------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Per-replica engine stats plus tokens/s and KV usage, and the pool's totals and last round."""
        refs = [(i, m.actor.stats.remote()) for i, m in enumerate(self.members) if m.state == "active"]
        replicas = []
        for i, ref in refs:
            try:
                replicas.append({**self.ray.get(ref, timeout=60), "sleep_level": self.members[i].sleep_level})
            except self.ray.exceptions.RayActorError:
                replicas.append({"index": i, "alive": False})
        live = [r for r in replicas if r.get("alive", True)]
        pooled = {
            "replicas": len(self.members), "alive": len(live), "policy_version": self.policy_version,
            "generated_tokens": sum(r["num_generated_tokens"] for r in live),
            "tokens_per_s": self.last_round.get("tokens_per_s", 0.0),
            "sum_replica_tokens_per_s": sum(r["tokens_per_s"] for r in live),
            "kv_cache_usage": sum(r["kv_cache_usage"] for r in live) / len(live) if live else 0.0,
            "failures": len(self.failures), "sleeping": self.sleeping_replicas,
        }
        return {"pool": pooled, "replicas": replicas, "last_round": self.last_round}

    def get_stats(self) -> EngineStats:
        """``Engine.get_stats``'s shape over the pool: counters summed, KV usage and GPU busy averaged."""
        pool = self.stats()
        replicas = [r for r in pool["replicas"] if r.get("alive", True)]
        k = max(len(replicas), 1)
        averaged = ("kv_cache_usage", "gpu_busy_frac", "gpu_compute_s", "policy_version", "pool")
        summed = {f.name: sum(r.get(f.name) or 0 for r in replicas) for f in fields(EngineStats)
                  if f.name not in averaged}
        busy = [r["gpu_busy_frac"] for r in replicas if r.get("gpu_busy_frac") is not None]
        compute = [r["gpu_compute_s"] for r in replicas if r.get("gpu_compute_s") is not None]
        return EngineStats(
            kv_cache_usage=sum(r["kv_cache_usage"] for r in replicas) / k,
            gpu_busy_frac=sum(busy) / len(busy) if busy else None,
            gpu_compute_s=sum(compute) / len(compute) if compute else None,  # mean: a window's busy stays <= 1
            policy_version=self.policy_version, pool=pool, **summed,
        )

    @property
    def limits(self) -> BackendLimits:
        """The smallest replica's limits (every group must fit wherever it is sent)."""
        infos = [m.info for m in self.members if m.info]
        if not infos:
            raise RuntimeError("the pool has no started replica")
        return BackendLimits(min(i["max_model_len"] for i in infos), min(i["vocab_size"] for i in infos),
                             min(i["max_num_seqs"] for i in infos), min(i["kv_cache_tokens"] for i in infos),
                             replicas=len(self.members))

    def describe(self) -> dict[str, Any]:
        factory = self.engine_factory
        return {**dict(getattr(factory, "options", {}) or {}), "dtype": getattr(factory, "dtype", None),
                "pool_replicas": len(self.members), "pool_address": self.address,
                "replica_devices": [m.info.get("device") if m.info else None for m in self.members]}

    def close(self) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        self.transfer.close()
        for m in self.members:
            try:
                self.ray.kill(m.actor, no_restart=True)
            except Exception:  # noqa: BLE001 - best effort
                pass
        self.members = []
