"""A tensor-parallel worker process: one rank's shard, KV cache and runner, driven by the engine.

Everything a worker needs is imported at the top: the fork server imports this module once, and
every worker forked from it starts with torch and transformers already loaded.

It runs the very runner the engine's own rank runs (on CUDA: streams, IO slots, carry-over, graphs
with the collectives captured inside), on the same plans in the same order, so every collective
meets its peers. Its samples equal rank 0's (the vocabulary-parallel sampler ends with the same
tokens everywhere), which its own carry-over needs; only rank 0 hands them to the engine.
"""

from __future__ import annotations

import dataclasses
import pickle
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

from rollout.distributed.group import TPGroup
from rollout.engine import loading
from rollout.engine.runners import build_runner
from rollout.engine.runners.kv_cache import KVCache
from rollout.layers.backends import AttentionSpec
from rollout.models.weights import WeightMapper

STORE_TIMEOUT = timedelta(minutes=10)


@dataclasses.dataclass(frozen=True, slots=True)
class WorkerSpec:
    """What every worker needs to build its shard (pickled to it at spawn)."""

    hf_config: Any
    checkpoint: str | None  # each rank reads its shard from here; None: rank 0 broadcasts the weights
    dtype: torch.dtype
    device: str  # rank 0's device: "cpu", or "cuda:k" (rank r then runs on cuda:k+r)
    world_size: int
    store_port: int  # rank 0's TCPStore, for the process group's rendezvous
    num_threads: int  # torch CPU threads per worker
    symm_mem: Any = None  # a SymmMemSpec: tp_all_reduce="symm_mem"'s buffer; None: NCCL all-reduces only


def worker_device(rank0_device: str, rank: int) -> torch.device:
    dev = torch.device(rank0_device)
    if dev.type != "cuda":
        return dev
    return torch.device("cuda", (dev.index or 0) + rank)


def worker_main(rank: int, spec: WorkerSpec, conn: Connection) -> None:
    """Process entry point: build the shard, say "ready", then serve commands until told to stop."""
    try:
        torch.set_num_threads(spec.num_threads)
        device = worker_device(spec.device, rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        store = dist.TCPStore("127.0.0.1", spec.store_port, spec.world_size, is_master=False,
                              timeout=STORE_TIMEOUT)
        tp = TPGroup.create(store, rank, spec.world_size, device, symm_mem=spec.symm_mem)
        worker = Worker(spec, tp, device)
        _reply(conn, "ok", None)
        worker.serve(conn)
    except (EOFError, KeyboardInterrupt):
        pass  # the engine went away
    except BaseException:
        try:
            _reply(conn, "error", f"rank {rank}:\n{traceback.format_exc()}")
        finally:
            raise SystemExit(1) from None


def _reply(conn: Connection, kind: str, value: object) -> None:
    conn.send_bytes(pickle.dumps((kind, value), protocol=pickle.HIGHEST_PROTOCOL))


class Worker:
    def __init__(self, spec: WorkerSpec, tp: TPGroup, device: torch.device) -> None:
        self.tp, self.device = tp, device
        self.model = loading.build_shard(spec.hf_config, spec.checkpoint, spec.dtype, device, tp)
        self.mapper = WeightMapper(self.model)
        self.kv: Any = None
        self.runner: Any = None
        self._manifest: list[tuple[str, tuple[int, ...], torch.dtype]] = []
        self._last: Any = None  # the previous step, collected after the next is queued (as rank 0 does)

    def serve(self, conn: Connection) -> None:
        while True:
            command, *args = pickle.loads(conn.recv_bytes())
            if command == "shutdown":
                return
            if command == "execute":
                self.execute(*args)  # no reply: the engine does not wait for workers
                continue
            _reply(conn, "ok", getattr(self, command)(*args))

    # ---- the loop ----------------------------------------------------------------------------
    def init_kv(self, config: Any, attn: AttentionSpec, max_model_len: int, num_blocks: int) -> None:
        """The same cache geometry and runner as rank 0 (same block count, graph sizes, and the attention
        backend rank 0 decided: a rank does not decide "auto" again)."""
        config = dataclasses.replace(config, num_blocks=num_blocks)
        dtype = next(self.model.parameters()).dtype
        self.kv = KVCache(self.model, config, self.device, dtype, max_model_len, attn)
        self.runner = build_runner(self.model, self.kv, config, attn, self.device, max_model_len)

    def execute(self, plan: Any) -> None:
        pending = self.runner.execute(plan)
        last, self._last = self._last, pending
        if last is not None:
            last.result()  # keeps the runner's step clock; the tokens are rank 0's to report

    def reset(self) -> None:
        self._last = None
        self.runner.reset()

    def release(self) -> None:
        self._last = None
        self.runner.release()
        self.kv.release()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def restore(self) -> None:
        self.kv.allocate()
        self.runner.restore()

    def offload(self, to_host: bool) -> None:
        """engine.sleep(level=2) / wake_up: weights to the CPU and back, storage swapped in place."""
        target = torch.device("cpu") if to_host else self.device
        with torch.no_grad():
            for t in list(self.model.parameters()) + list(self.model.buffers()):
                t.data = t.data.to(target)
        if to_host and self.device.type == "cuda":
            torch.cuda.empty_cache()

    def compute_seconds(self) -> float | None:
        if self._last is not None:
            self._last.result()
            self._last = None
        return self.runner.compute_seconds if self.runner is not None else None

    # ---- weights: validate, agree, copy ------------------------------------------------------
    def validate_weights(self, manifest: list[tuple[str, tuple[int, ...], torch.dtype]]) -> str | None:
        """Check names and full shapes against this rank's mapper; the problem's text, or None."""
        for name, shape, dtype in manifest:
            try:
                self.mapper.validate(name, torch.empty(shape, dtype=dtype, device="meta"))
            except (TypeError, ValueError) as e:
                return f"rank {self.tp.rank}: {e}"
        self._manifest = manifest
        return None

    def copy_weights(self) -> int:
        """Receive every tensor of the agreed manifest from rank 0 and keep this rank's part."""
        manifest, self._manifest = self._manifest, []
        with torch.no_grad():
            for name, shape, dtype in manifest:
                buf = self.tp.broadcast(torch.empty(shape, dtype=dtype, device=self.device), src=0)
                self.mapper.resolve(name).write(buf)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return len(manifest)
