"""The weight-transfer core without a server: layout, buckets, verdicts, over a real gloo group (two threads)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from rollout.weights.broadcast import _pieces, send_weights
from rollout.weights.group import PushRejected, TransferGroup, await_verdicts
from rollout.weights.layout import ALIGN, chunk_bounds, dtype_name, layout, make_specs
from rollout.weights.receiver import WeightReceiver


def _specs(pairs):
    return make_specs([n for n, _ in pairs], [dtype_name(t.dtype) for _, t in pairs], [list(t.shape) for _, t in pairs])


def test_layout_aligns_and_pieces_cover_every_byte_once():
    torch.manual_seed(0)
    pairs = [("a", torch.randn(3, 5)), ("e", torch.empty(0)), ("b", torch.randn(1000).bfloat16()),
             ("c", torch.randn(7, 33).half()), ("z", torch.empty(0, 4))]
    specs = _specs(pairs)
    offsets, total = layout(specs)
    assert all(o % ALIGN == 0 for o in offsets) and total == offsets[-1]
    for bucket in (ALIGN, 300, 4096, 1 << 20):
        bounds = chunk_bounds(total, bucket)
        covered = {i: 0 for i in range(len(specs))}
        for (a, b), pieces in zip(bounds, _pieces(offsets, [s.nbytes for s in specs], bounds)):
            assert b - a <= bucket
            for i, lo, hi, dst in pieces:
                assert lo == covered[i] and 0 <= dst and dst + hi - lo <= b - a  # in order, inside the chunk
                covered[i] = hi
        assert covered == {i: s.nbytes for i, s in enumerate(specs)}


@pytest.mark.parametrize(
    "names, dtypes, shapes, message",
    [
        (["a"], ["int8"], [[2]], "dtype_names\\[0\\]"),
        (["a", "b"], ["float32"], [[2], [3]], "one entry per tensor"),
        (["a"], ["float32"], [[2, -1]], "shapes\\[0\\]"),
        (["a", "a"], ["float32", "float32"], [[2], [2]], "unique"),
        ([], [], [], "at least one"),
        ("a", ["float32"], [[1]], "names must be a list"),
    ],
)
def test_bad_metadata_is_named(names, dtypes, shapes, message):
    with pytest.raises((TypeError, ValueError), match=message):
        make_specs(names, dtypes, shapes)


def _pair(check=lambda name, t: None):
    """A connected (trainer group, receiver) over gloo on loopback, made from two threads."""
    mapper = SimpleNamespace(validate=check)  # the engine's WeightMapper, as far as the receiver asks
    engine = SimpleNamespace(device=torch.device("cpu"), weights=SimpleNamespace(mapper=mapper))
    receiver = WeightReceiver(engine)
    joined: list = []

    def on_listening(port):
        t = threading.Thread(target=lambda: joined.append(receiver.join("127.0.0.1", port, 2, timeout_s=30)))
        t.start()
        joined.append(t)

    trainer = TransferGroup.open_trainer("cpu", timeout_s=30, on_listening=on_listening)
    joined[0].join()
    return trainer, receiver


def _receive(receiver, specs, bucket, push_id):
    """Start a receive in a thread; the returned list gets the views or the exception."""
    box: list = []

    def run():
        try:
            box.append(receiver.receive_views(specs, bucket, push_id))
        except Exception as e:  # noqa: BLE001 - handed to the test
            box.append(e)

    t = threading.Thread(target=run)
    t.start()
    return t, box


def test_round_trip_over_gloo_in_buckets_with_a_rejection_between():
    torch.manual_seed(1)
    pairs = [("w1", torch.randn(17, 9)), ("w2", torch.randn(300).bfloat16()), ("empty", torch.empty(0)),
             ("w3", torch.randn(5, 5).double())]
    specs = _specs(pairs)
    allowed = {n for n, _ in pairs}

    def check(name, t):
        assert t.device.type == "meta"
        if name not in allowed:
            raise ValueError(f"unknown weight name {name!r}")

    trainer, receiver = _pair(check)
    try:
        assert not dist.is_initialized()  # the default process group is never touched
        for push_id, bucket in enumerate((ALIGN, 1000, 1 << 20)):
            t, got = _receive(receiver, specs, bucket, push_id)
            await_verdicts(trainer, push_id)
            send_weights(trainer, specs, iter(pairs), bucket)
            t.join()
            for (n, v), (m, want) in zip(got[0], pairs):
                assert n == m and v.dtype == want.dtype and torch.equal(v, want)
        bad = _specs([("nope", torch.zeros(2))])
        t, errors = _receive(receiver, bad, ALIGN, 9)
        with pytest.raises(PushRejected, match="unknown weight name 'nope'"):
            await_verdicts(trainer, 9)
        t.join()
        assert isinstance(errors[0], PushRejected)
        # The group is still usable after a rejection: a cast push (float32 -> bfloat16 on the wire).
        cast = make_specs(["w1"], ["bfloat16"], [[17, 9]])
        t, got = _receive(receiver, cast, ALIGN, 10)
        await_verdicts(trainer, 10)
        send_weights(trainer, cast, [("w1", pairs[0][1])], ALIGN)
        t.join()
        assert torch.equal(got[0][0][1], pairs[0][1].bfloat16())
    finally:
        receiver.close()
        trainer.close()


def test_sender_checks_the_announced_order():
    trainer, receiver = _pair()
    try:
        specs = _specs([("a", torch.zeros(4)), ("b", torch.zeros(2))])
        t, box = _receive(receiver, specs, ALIGN, 0)
        await_verdicts(trainer, 0)
        with pytest.raises(ValueError, match="tensor 0 is 'b'"):
            send_weights(trainer, specs, [("b", torch.zeros(2)), ("a", torch.zeros(4))], ALIGN)
    finally:
        trainer.close()  # the receiver's wait fails on the closed connection
        t.join(30)
        assert not t.is_alive() and isinstance(box[0], RuntimeError)  # TransferError: the sender went away
        receiver.close()
