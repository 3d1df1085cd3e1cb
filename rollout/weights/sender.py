"""The trainer's end of a push to other processes: rank 0 of a ``TransferGroup``, one class for every receiver.

``WeightSender(receivers)`` hosts the group, has the receivers join it, announces each push's metadata,
waits for every receiver's verdict (a refused push fails fast on both sides, the group stays usable) and
broadcasts the bytes in ``layout``'s flat buckets. What differs between the HTTP server and the Ray pool
is only how the receivers are reached, the ``Receivers`` given: HTTP calls (``trainer_hooks.client``) or
Ray calls (``rollout.pool.transfer``). A replica on the trainer's own GPU takes the same layout by handle
(``handles.export_weights``); a directory takes it as ``step_<N>/`` (``disk``). Every receiver ends in
``Engine.update_weights(pairs, version)``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any, Protocol

import torch

from rollout.weights.broadcast import send_weights
from rollout.weights.group import PushRejected, TransferError, TransferGroup, await_verdicts, cuda_device
from rollout.weights.layout import BUCKET_BYTES, TensorSpec


class Receivers(Protocol):
    """How a sender reaches its receivers (ranks 1..N): the control messages, never the bytes."""

    def join(self, address: str, port: int, world_size: int, backend: str, timeout_s: float) -> Callable[[bool], None]:
        """Ask every receiver to join; returns ``check(wait)``: raises a failure to join (``wait``: block for all)."""

    def announce(self, specs: list[TensorSpec], push_id: int, bucket_bytes: int, version: int | None,
                 recompute_running: bool) -> Any:
        """Send one push's metadata to every receiver; their pending answers (each one's new version)."""

    def alive(self, answers: Any) -> bool:
        """False once a receiver answered before its verdict (its request failed)."""

    def refused(self, answers: Any) -> None:
        """Raise the receivers' own reason for a refused (or verdict-less) push, when they have one; return only
        once every receiver is done with the push (or a bound passed), so that the next push cannot find one
        still inside this one."""

    def broken(self, answers: Any) -> None:
        """Raise the receivers' own reason for a transport that broke mid-push (a death), when they have one."""


class WeightSender:
    def __init__(self, receivers: Receivers, timeout_s: float = 600.0) -> None:
        self.receivers, self.timeout_s = receivers, timeout_s
        self.group: TransferGroup | None = None
        self.push_id = 0

    def open(self, device: torch.device | str, world_size: int, address: str, port: int = 0) -> TransferGroup:
        """Host a group of ``world_size`` ranks (this process is rank 0): NCCL on CUDA, gloo otherwise."""
        self.close()
        device = cuda_device(device)  # the caller's current CUDA device, not the opening thread's
        backend = "nccl" if device.type == "cuda" else "gloo"
        checks: list[Callable[[bool], None]] = []

        def on_listening(port: int) -> None:
            checks.append(self.receivers.join(address, port, world_size, backend, self.timeout_s))

        opening: Future = Future()
        args = (opening, TransferGroup.open_trainer, device, world_size, address, port, self.timeout_s, on_listening)
        threading.Thread(target=_run_into, args=args, daemon=True).start()
        while not opening.done():
            if checks:
                checks[0](False)  # a receiver that could not join: no point waiting for it
            time.sleep(0.005)
        self.group = opening.result()
        checks[0](True)
        self.push_id = 0
        return self.group

    def send(self, specs: list[TensorSpec], weights: Iterable[tuple[str, torch.Tensor]], version: int | None = None,
             recompute_running: bool = True, bucket_bytes: int = BUCKET_BYTES) -> Any:
        """One push over the open group: announce, every verdict, the bytes; the receivers' pending answers.

        A refusal raises (the group stays usable); a broken transport closes the group (the receivers fail
        fast and keep their old weights) and the next push opens a new one.
        """
        group = self.group
        if group is None:
            raise RuntimeError("no weight-transfer group: open() one first")
        push_id, self.push_id = self.push_id, self.push_id + 1
        answers = self.receivers.announce(specs, push_id, bucket_bytes, version, recompute_running)
        try:
            await_verdicts(group, push_id, alive=lambda: self.receivers.alive(answers))
        except PushRejected:
            self.receivers.refused(answers)
            raise
        except TransferError:
            self.close()
            self.receivers.refused(answers)
            raise
        try:
            send_weights(group, specs, weights, bucket_bytes)  # cast to each spec's dtype on the way
        except BaseException:
            self.close()
            self.receivers.broken(answers)
            raise
        return answers

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None


def _run_into(fut: Future, fn: Any, *args: Any) -> None:
    try:
        fut.set_result(fn(*args))
    except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
        fut.set_exception(e)
