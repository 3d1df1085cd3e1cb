"""Pool replicas asleep on the GPU (skipped without CUDA / Ray): the co-located replica's ``sleep(level=2)`` gives
the trainer's GPU its memory back (seen from this process, the trainer), a push by CUDA IPC while it sleeps lands
in its weights parked on the CPU, and after ``wake_up`` it serves the pushed weights. With two GPUs, replica 1
sleeps too and takes the same push by NCCL, its staging buffer freed again afterwards.
"""

from __future__ import annotations

import pytest
import torch

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from rollout.pool import EngineFactory  # noqa: E402
from tests.gpu.test_pool_ipc_gpu import OPTIONS, _each, _reference, _same, hf_model  # noqa: E402

MiB = 2**20


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("pool-sleep") / "tiny"
    hf_model(0, "cpu").save_pretrained(path)
    return str(path)


def _pool(ckpt: str, replicas: int):
    from rollout.pool.pool import RolloutPool

    factory = EngineFactory(ckpt, dtype="bfloat16", options=OPTIONS)
    return RolloutPool(replicas, factory, gpus_per_replica=1, colocate_with_trainer=True, trainer_device="cuda:0",
                       transfer_timeout_s=60, start_timeout_s=300, sleep_replicas=[0])


def _free(device: int = 0) -> int:
    torch.cuda.synchronize(device)
    return torch.cuda.mem_get_info(device)[0]


def _sleep_push_wake(pool, by_handle: int, by_broadcast: int) -> None:
    trainer = hf_model(1)
    free = _free()
    released = pool.sleep(level=2)  # sleep_replicas: the co-located replica 0
    freed = _free() - free
    print(f"co-located sleep(level=2): released {released / MiB:.1f} MiB, trainer's GPU free memory +{freed / MiB:.1f}")
    assert pool.sleeping_replicas == [0] and released > 0 and freed >= 0.5 * released
    if len(pool.members) > 1:
        assert pool.sleep(level=2, replicas=[1]) > 0 and pool.sleeping_replicas == [0, 1]
    assert pool.update_weights(trainer.named_parameters(), version=5) == 5  # into weights parked on the CPU
    assert pool.transfer.last_push["by_handle"] == by_handle and pool.transfer.last_push["by_broadcast"] == by_broadcast
    stats = pool.stats()["replicas"]
    assert all(r["sleeping"] and r["policy_version"] == 5 and r["weight_staging_bytes"] == 0 for r in stats), stats
    pool.wake_up()
    assert not pool.is_sleeping
    ref = _reference(trainer)
    for s in _each(pool, "woken"):
        _same(s, ref)


def test_colocated_replica_sleeps_takes_a_push_by_ipc_and_wakes(ckpt):
    pool = _pool(ckpt, 1)
    try:
        _sleep_push_wake(pool, by_handle=1, by_broadcast=0)
    finally:
        pool.shutdown()
        ray.shutdown()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (NCCL to the second replica)")
def test_both_replicas_asleep_take_one_push_by_ipc_and_nccl(ckpt):
    pool = _pool(ckpt, 2)
    try:
        _sleep_push_wake(pool, by_handle=1, by_broadcast=1)
    finally:
        pool.shutdown()
        ray.shutdown()
