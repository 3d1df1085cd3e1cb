"""A weights-only ``torch.distributed`` group between one trainer (rank 0) and engines (ranks 1..N).

A ``TCPStore`` plus ``ProcessGroupNCCL`` (CUDA) or ``ProcessGroupGloo`` (CPU), constructed directly and
never through ``init_process_group``, so the trainer's own default process group is untouched. The store
also carries each push's verdicts: receivers check the metadata before any byte moves and say so there,
and the sender waits for every verdict before broadcasting.
"""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from rollout.weights.torch_group import wait_listening

PROTOCOL_KEY = "rollout-weights/protocol"  # set by the trainer before anyone joins: says the handshake is ours
VLLM_KEY = "broadcast_from/0/0"  # vLLM's StatelessProcessGroup: rank 0's NCCL unique id (TRL, vLLM's trainer_init)
CONNECT_S = 15.0  # reaching the trainer's store
HANDSHAKE_S = 10.0  # and learning whose handshake it is: a foreign or silent store fails within this
LISTEN_S = 5.0  # something must accept connections at the trainer's address within this


class ForeignHandshake(ValueError):
    """The store at the address speaks another group protocol (``kind``); ``store`` is connected to it."""

    def __init__(self, kind: str, store: dist.TCPStore) -> None:
        super().__init__(f"the trainer's store speaks {kind}'s handshake")
        self.kind, self.store = kind, store


class TransferError(RuntimeError):
    """The transport failed (peer gone, timeout): the group is unusable and must be created anew."""


class PushRejected(ValueError):
    """A receiver refused the push's metadata before any byte moved; the group stays usable."""


class TransferGroup:
    """Rank ``rank`` of a weights-only group: rank 0 (the trainer) hosts the store, ranks >= 1 join it.

    Use ``open_trainer`` (rank 0) and ``join`` (the others); each blocks until every rank is in, so the
    trainer tells the receivers where to join (``on_listening``, e.g. an HTTP call) from another thread.
    """

    def __init__(self, store: dist.TCPStore, rank: int, world_size: int, device: torch.device | str,
                 timeout_s: float, master_address: str) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        self.store, self.rank, self.world_size = store, rank, world_size
        self.device = cuda_device(device)
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.port = store.port
        self.backend = "nccl" if self.device.type == "cuda" else "gloo"
        prefix = dist.PrefixStore("rollout-weights/", store)
        if self.backend == "nccl":
            torch.cuda.set_device(self.device)
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = 2 * self.timeout  # our own waits time out first and abort the group: the
            # NCCL watchdog, left to fire, would tear the whole server process down
            self.pg = _nccl_group(prefix, rank, world_size, opts)
        else:
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = self.timeout
            local = master_address in ("127.0.0.1", "localhost", "::1")
            dev = (dist.ProcessGroupGloo.create_device(hostname="127.0.0.1") if local
                   else dist.ProcessGroupGloo.create_default_device())
            opts._devices = [dev]
            self.pg = dist.ProcessGroupGloo(prefix, rank, world_size, opts)
        self.closed = False
        self.broadcast(torch.zeros(1, dtype=torch.uint8, device=self.device)).wait()  # connect now, not mid-push

    @classmethod
    def open_trainer(cls, device: torch.device | str, world_size: int = 2, master_address: str = "127.0.0.1",
                     master_port: int = 0, timeout_s: float = 600.0,
                     on_listening: Callable[[int], None] | None = None) -> TransferGroup:
        """Rank 0: host the store (port 0 = a free one), call ``on_listening(port)``, wait for every rank."""
        store = dist.TCPStore(master_address, master_port, world_size, is_master=True,
                              timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)
        store.set(PROTOCOL_KEY, "rollout-1")
        if on_listening is not None:
            on_listening(store.port)
        return cls(store, 0, world_size, device, timeout_s, master_address)

    @classmethod
    def join(cls, master_address: str, master_port: int, rank: int, world_size: int, device: torch.device | str,
             timeout_s: float = 600.0) -> TransferGroup:
        """Rank >= 1: connect to the trainer's store and group.

        Within ``HANDSHAKE_S`` the store must say it is ours; vLLM's (TRL's ``VLLMClient``) raises
        ForeignHandshake with the store, anything else ValueError: never a wait of ``timeout_s``."""
        if not 1 <= rank < world_size:
            raise ValueError(f"a receiver's rank must be in [1, world_size={world_size}), got {rank}")
        # nobody listening: fail in seconds (TCPStore itself retries its connect timeout, ~35 s)
        wait_listening(master_address, master_port, min(timeout_s, LISTEN_S), "rollout-weights")
        store = dist.TCPStore(master_address, master_port, world_size, is_master=False,
                              timeout=datetime.timedelta(seconds=min(timeout_s, CONNECT_S)))
        store.set_timeout(datetime.timedelta(seconds=timeout_s))
        kind = handshake_kind(store, min(timeout_s, HANDSHAKE_S))
        if kind != "rollout":
            raise ForeignHandshake(kind, store)
        return cls(store, rank, world_size, device, timeout_s, master_address)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> dist.Work:
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = src, 0
        return self.pg.broadcast([tensor], opts)

    def close(self) -> None:
        if getattr(self, "closed", True):
            return
        self.closed = True
        for method in ("abort", "shutdown") if self.backend == "nccl" else ():
            fn = getattr(self.pg, method, None)
            if fn is not None:
                try:
                    fn()
                    break
                except Exception:  # noqa: BLE001 - best effort on a group that may be broken already
                    pass
        self.pg = None  # type: ignore[assignment]
        self.store = None  # type: ignore[assignment]


def handshake_kind(store: dist.Store, within_s: float) -> str:
    """``rollout`` or ``vllm``: whose keys appear on the trainer's store within ``within_s``; ValueError if none."""
    deadline = time.monotonic() + within_s
    while True:
        if store.check([PROTOCOL_KEY]):
            return "rollout"
        if store.check([VLLM_KEY]):
            return "vllm"
        if time.monotonic() > deadline:
            raise ValueError(f"the store at the trainer's address gave no rollout or vLLM handshake within "
                             f"{within_s:g} s: not a weight-transfer trainer")
        time.sleep(0.02)


def cuda_device(device: torch.device | str) -> torch.device:
    """``device`` with its index: a bare ``cuda`` means this thread's current device, resolved now (worker
    threads start on device 0, whatever the thread that asked had set)."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _verdict_key(push_id: int, rank: int) -> str:
    return f"rollout-verdict/{push_id}/{rank}"


def post_verdict(group: TransferGroup, push_id: int, error: str | None) -> None:
    group.store.set(_verdict_key(push_id, group.rank), "ok" if error is None else "error: " + error)


def await_verdicts(group: TransferGroup, push_id: int, alive: Callable[[], bool] = lambda: True) -> None:
    """Sender: wait for every receiver's verdict; raise PushRejected with the first refusal's reason.

    ``alive`` is polled while waiting (the HTTP request that carries the metadata may fail before a
    verdict is posted); when it turns False the wait ends with TransferError.
    """
    keys = [_verdict_key(push_id, r) for r in range(1, group.world_size)]
    deadline = time.monotonic() + group.timeout.total_seconds()
    while not group.store.check(keys):
        if not alive():
            raise TransferError("the receiver gave no verdict (its request failed); nothing was sent")
        if time.monotonic() > deadline:
            raise TransferError(f"no verdict from the receivers within {group.timeout}")
        time.sleep(0.001)
    errors = [v for v in (group.store.get(k).decode() for k in keys) if v != "ok"]
    for k in keys:
        group.store.delete_key(k)
    if errors:
        raise PushRejected(errors[0].removeprefix("error: "))


def _nccl_group(prefix: dist.Store, rank: int, world_size: int, opts: object) -> dist.ProcessGroup:
    """A receiver (rank >= 1) must outlive a trainer that dies mid-push. By default the NCCL watchdog rethrows
    a peer's failure on its own thread, which terminates the whole process (seen on the H200 pair at 461e72e:
    the server died instead of keeping its old weights). ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` (clean up
    only) makes it abort the communicator and fail the pending work instead; it is read when the group is
    constructed, so it is set just for that. The trainer (rank 0) keeps torch's default."""
    if rank == 0:
        return dist.ProcessGroupNCCL(prefix, rank, world_size, opts)
    key = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
    old = os.environ.get(key)
    os.environ[key] = "2"
    try:
        return dist.ProcessGroupNCCL(prefix, rank, world_size, opts)
    finally:
        if old is None:
            del os.environ[key]
        else:
            os.environ[key] = old
