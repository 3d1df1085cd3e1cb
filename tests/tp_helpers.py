"""The tensor-parallel tests' harness: the model cases both TP test files check, and ``run_ranks``, which runs
a function on several CPU ranks over gloo.

Each rank is a fresh process (one torch thread), joined to a process group over a file store in a
temp dir (no ports to race for); a rank's exception comes back as the test failure, and a rank that hangs
is killed after ``timeout`` seconds.
"""

from __future__ import annotations

import os
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import wait
from pathlib import Path

import torch
import torch.distributed as dist

from rollout.distributed import TPGroup
from rollout.engine.tp.workers import worker_context

TOL = 1e-5  # float32 on the CPU: two ranks' numbers against one process's
# case -> (tiny model family, config overrides): every family; Llama with all biases; Qwen2 also with a
# single KV head, replicated on both ranks
CASES = {
    "llama": ("llama", dict(attention_bias=True, mlp_bias=True)),
    "qwen2": ("qwen2", {}),
    "qwen2_kv1": ("qwen2", dict(num_key_value_heads=1)),
    "qwen3": ("qwen3", {}),
    "mistral": ("mistral", {}),
}


def run_ranks(fn: Callable[..., None], world_size: int, *args: object, timeout: float = 120.0) -> None:
    """``fn(tp, *args)`` on ``world_size`` gloo ranks; raises if any rank fails or overruns."""
    ctx = worker_context()  # the engine's own: a fork server with torch and transformers loaded
    with tempfile.TemporaryDirectory() as d:
        init = os.path.join(d, "rendezvous")
        procs = [ctx.Process(target=_entry, args=(fn, r, world_size, init, d, args), daemon=True)
                 for r in range(world_size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        try:
            while any(p.is_alive() for p in procs):  # a failed rank ends the run: its peers would hang
                if any(p.exitcode not in (None, 0) for p in procs):
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"ranks still running after {timeout} s")
                wait([p.sentinel for p in procs if p.is_alive()], timeout=min(left, 1.0))
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join()
        errors = [(Path(d) / f"error{r}").read_text() for r in range(world_size) if (Path(d) / f"error{r}").exists()]
        if errors:
            raise AssertionError("a rank failed:\n" + "\n".join(errors))
        codes = [p.exitcode for p in procs]
        assert codes == [0] * world_size, f"rank exit codes {codes} (a peer of a failed rank is killed)"


def _entry(fn: Callable[..., None], rank: int, world_size: int, init: str, d: str, args: tuple) -> None:
    torch.set_num_threads(1)
    try:
        store = dist.FileStore(init, world_size)
        fn(TPGroup.create(store, rank, world_size, torch.device("cpu"), timeout=timedelta(seconds=60)), *args)
    except BaseException:
        Path(d, f"error{rank}").write_text(f"rank {rank}:\n{traceback.format_exc()}")
        raise SystemExit(1) from None
