"""SGLang's weight-update group: ``torch.distributed``'s TCP rendezvous and a named process group.

slime and AReaL create it on the trainer with the helper SGLang and OpenRLHF share (rendezvous at
``tcp://master_address:master_port``, a ``PrefixStore`` named after the group, then torch's own group
constructor), and every engine joins with the same calls, so both ends must build it exactly this way:
``TransferGroup`` (ours) is not compatible with it. Tensors then travel one broadcast each, in the order
the metadata names them.
"""

from __future__ import annotations

import datetime
import socket
import time

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import PrefixStore, _new_process_group_helper, _world, rendezvous

# Reaching the trainer's store: slime sends /init_weights_update_group, then starts its rank 0 (which listens at
# once), so a few seconds cover the race; nobody listening by then fails with this, not the group's timeout.
CONNECT_S = 5.0


class RendezvousUnreachable(ConnectionError):
    """Nothing accepts connections at the group's ``master_address:master_port``."""


class NamedGroup:
    """This process's rank of a group created with SGLang's ``init_custom_process_group`` convention."""

    def __init__(self, master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
                 backend: str, device: torch.device, timeout_s: float) -> None:
        if not 1 <= rank < world_size:
            raise ValueError(f"rank_offset must be in [1, world_size={world_size}), got {rank}")
        if backend not in ("nccl", "gloo"):
            raise ValueError(f"backend must be 'nccl' or 'gloo', got {backend!r}")
        if backend == "nccl" and device.type != "cuda":
            raise ValueError(f"backend 'nccl' needs a CUDA engine; this one is on {device}: use 'gloo'")
        if group_name in _world.pg_names.values():
            raise ValueError(f"a weight-update group named {group_name!r} already exists in this server; "
                             "destroy it first (POST /destroy_weights_update_group)")
        timeout = datetime.timedelta(seconds=timeout_s)
        host = f"[{master_address}]" if ":" in master_address else master_address
        wait_listening(master_address, master_port, min(timeout_s, CONNECT_S), group_name)
        store, rank, world_size = next(rendezvous(f"tcp://{host}:{master_port}", rank, world_size, timeout=timeout))
        store.set_timeout(timeout)
        self.device = device if backend == "nccl" else torch.device("cpu")
        self.timeout = timeout
        self.group_name, self.backend, self.rank = group_name, backend, rank
        self.pg = _new_group(world_size, rank, backend, PrefixStore(group_name, store), group_name, timeout)

    def receive(self, tensor: torch.Tensor) -> None:
        """One broadcast from rank 0 into ``tensor`` (contiguous, on ``device``)."""
        dist.broadcast(tensor, src=0, group=self.pg)

    def close(self) -> None:
        pg, self.pg = self.pg, None
        if pg is not None:
            try:
                dist.destroy_process_group(pg)
            except Exception:  # noqa: BLE001 - best effort on a group that may be broken already
                pass


def wait_listening(address: str, port: int, within_s: float, group_name: str) -> None:
    """Return once something accepts TCP connections at ``address:port`` (a TCPStore ignores a probe that
    connects and closes); RendezvousUnreachable after ``within_s`` otherwise."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            with socket.create_connection((address, port), timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
                return
        except OSError:
            if time.monotonic() >= deadline:
                raise RendezvousUnreachable(
                    f"nobody is listening at {address}:{port} for weight-update group {group_name!r} (waited "
                    f"{within_s:g} s): the trainer's rank 0 must create the group there (slime: "
                    "init_process_group / SGLang's init_custom_process_group with this master_address, master_port "
                    "and group_name) while or before this request runs") from None
            time.sleep(0.1)


def _new_group(world_size: int, rank: int, backend: str, store: PrefixStore, group_name: str,
               timeout: datetime.timedelta) -> dist.ProcessGroup:
    """torch's own group constructor, as SGLang's helper calls it (its keyword changed name across versions)."""
    try:
        pg, _ = _new_process_group_helper(world_size, rank, [], backend, store, group_name=group_name,
                                          backend_options=None, timeout=timeout)
    except TypeError:
        pg, _ = _new_process_group_helper(world_size, rank, [], backend, store, group_name=group_name,
                                          pg_options=None, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg
