"""A replica co-located with the trainer takes weights by handle (CPU: /dev/shm buckets; CUDA IPC in tests/gpu).

First without Ray: the handle path's packing, mapping and release, and the engine's own validation on the
receiving side. Then one Ray pool of 2 CPU replicas of the tiny Llama, replica 0 co-located with this
process (the trainer): each push reaches replica 0 by handle and replica 1 by gloo broadcast.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from rollout import SamplingParams
from rollout.pool import EngineFactory
from rollout.pool.colocate import TrainerPlace, check_replica, check_source
from rollout.weights.group import PushRejected
from rollout.weights.handles import SHM_DIR, SHM_PREFIX, BucketHandle, cuda_index, export_weights, open_weights
from rollout.weights.layout import TensorSpec, bucket_ranges, dtype_name
from rollout.weights.receiver import WeightReceiver
from tests.engine_helpers import assert_matches_hf, make_engine
from tests.tiny_models import make_tiny_hf_model, save_tiny_checkpoint

OPTIONS = dict(max_model_len=128, num_blocks=64)
PROMPT = [5, 6, 7, 8]


def _greedy(max_tokens: int = 6) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _specs(pairs) -> list[TensorSpec]:
    return [TensorSpec(n, dtype_name(t.dtype), tuple(t.shape)) for n, t in pairs]


def _leftovers(pid: int | None = None) -> list[str]:
    """This trainer's bucket files still in /dev/shm."""
    return [f for f in os.listdir(SHM_DIR) if f.startswith(f"{SHM_PREFIX}{pid or os.getpid()}-")]


def _mapped(pid: int) -> list[str]:
    """Bucket files a process still maps (an unlinked file stays in memory while mapped)."""
    return [line for line in Path(f"/proc/{pid}/maps").read_text().splitlines() if SHM_PREFIX in line]


# ---- the handle path, in process -------------------------------------------------------------------
def test_buckets_hold_whole_tensors_and_views_round_trip() -> None:
    pairs = [("a", torch.randn(3, 5)), ("b", torch.randn(600).to(torch.bfloat16)), ("c", torch.empty(0)),
             ("d", torch.randn(70, 3))]
    specs = _specs(pairs)
    assert bucket_ranges(specs, 1024) == [(0, 1), (1, 2), (2, 4)]  # b (1200 B) alone; a tensor is never split
    assert bucket_ranges(specs, 1 << 20) == [(0, 4)]
    with export_weights(specs, pairs, "cpu", bucket_bytes=1024) as exported:
        assert [h.kind for h in exported.handles] == ["shm"] * 3 and len(_leftovers()) == 3
        views, buffers = open_weights(specs, exported.handles, "cpu")
        assert [n for n, _ in views] == ["a", "b", "c", "d"]
        assert all(v.dtype == t.dtype and torch.equal(v, t) for (_, v), (_, t) in zip(views, pairs))
        with pytest.raises(ValueError, match="cover"):
            open_weights(specs[:3], exported.handles, "cpu")
        del views, buffers
    assert _leftovers() == [] and _mapped(os.getpid()) == []  # unlinked and unmapped
    with pytest.raises(ValueError, match="announced"):  # a tensor other than announced: nothing left behind
        export_weights(specs, pairs[:1] + pairs[2:], "cpu")
    assert _leftovers() == []


def test_cuda_handles_need_the_trainers_gpu() -> None:
    specs = [TensorSpec("a", "float32", (1,))]
    with pytest.raises(ValueError, match="engine on the trainer's GPU"):
        open_weights(specs, [BucketHandle(0, 1, 4, "cuda", ("GPU-x", ()))], "cpu")
    with pytest.raises(ValueError, match="GPU GPU-x is not visible"):
        cuda_index("GPU-x")
    with pytest.raises(ValueError, match="not a weight bucket"):  # only our own files are ever mapped
        open_weights(specs, [BucketHandle(0, 1, 4, "shm", "/etc/passwd")], "cpu")


def test_receiver_validates_like_update_weights_and_keeps_old_weights() -> None:
    old, new = make_tiny_hf_model("llama", seed=0), make_tiny_hf_model("llama", seed=5)
    engine = make_engine(old, max_model_len=64, num_blocks=32)
    receiver = WeightReceiver(engine)
    before = engine.generate([PROMPT], _greedy())[0].outputs[0]

    bad_shape = [(n, t[:1] if n.endswith("k_proj.weight") else t) for n, t in new.named_parameters()]
    nan = [(n, torch.full_like(t, float("nan")) if n.endswith("up_proj.weight") else t)
           for n, t in new.named_parameters()]
    for bad, why in ((bad_shape, "k_proj"), (nan, "not finite")):
        pairs = [(n, t.detach()) for n, t in bad]
        with export_weights(_specs(pairs), pairs, "cpu") as exported:
            with pytest.raises(ValueError, match=why):
                receiver.receive_handles(_specs(pairs), exported.handles, version=3)
        assert engine.policy_version == 0 and _mapped(os.getpid()) == []
    assert engine.generate([PROMPT], _greedy())[0].outputs[0].token_ids == before.token_ids
    with pytest.raises(PushRejected):  # metadata refused before anything is mapped
        receiver.receive_handles(_specs([("nope", torch.zeros(1))]), [], version=3)

    pairs = [(n, t.detach()) for n, t in new.named_parameters()]
    with export_weights(_specs(pairs), pairs, "cpu") as exported:
        assert receiver.receive_handles(_specs(pairs), exported.handles, version=3) == 3
    assert _leftovers() == [] and _mapped(os.getpid()) == []
    assert_matches_hf(new, PROMPT, engine.generate([PROMPT], _greedy())[0].outputs[0], atol=1e-4)


def test_colocation_checks_name_the_problem() -> None:
    place = TrainerPlace(torch.device("cpu"), None, "node-a")
    check_replica(0, {"device": "cpu", "device_uuid": None, "node_id": "node-a"}, place, colocated=True)
    with pytest.raises(ValueError, match="one host"):  # handles across hosts
        check_replica(0, {"device": "cpu", "device_uuid": None, "node_id": "node-b"}, place, colocated=True)
    with pytest.raises(ValueError, match="its engine is on cuda:0"):
        check_replica(0, {"device": "cuda:0", "device_uuid": "GPU-1", "node_id": "node-a"}, place, colocated=True)
    gpu = TrainerPlace(torch.device("cuda", 0), "GPU-0", "node-a")
    with pytest.raises(ValueError, match="landed on the trainer's GPU"):  # NCCL would refuse it
        check_replica(1, {"device": "cuda:0", "device_uuid": "GPU-0", "node_id": "node-a"}, gpu, colocated=False)
    check_replica(1, {"device": "cuda:0", "device_uuid": "GPU-1", "node_id": "node-a"}, gpu, colocated=False)
    with pytest.raises(ValueError, match="'w' is on meta"):  # a trainer on another device
        check_source([("v", torch.zeros(1)), ("w", torch.zeros(1, device="meta"))], place)


def test_pool_config_marks_the_colocated_replica() -> None:
    from rollout.job.config import JobConfig
    from rollout.job.setup import load_pool

    job = JobConfig.from_dict({"output_dir": "x", "pool": {"replicas": 2, "colocate_with_trainer": True}})
    assert job.pool.colocate_with_trainer
    with pytest.raises(ValueError, match="no trainer process"):  # the main job: before any Ray starts
        load_pool(job, Path("x"), None, {})
    for bad, why in (({"replicas": 1, "colocate_with_trainer": True}, "replicas"),
                     ({"replicas": 2, "colocate_with_trainer": True, "gpus_per_replica": 2}, "one GPU"),
                     ({"replicas": 2, "colocate_with_trainer": "yes"}, "colocate_with_trainer")):
        with pytest.raises(ValueError, match=why):
            JobConfig.from_dict({"output_dir": "x", "pool": bad})


# ---- a Ray pool: replica 0 co-located (by handle), replica 1 by gloo broadcast ------------------------
@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    ray = pytest.importorskip("ray", reason="the pool needs Ray (pip install ray; see requirements.lock)")
    from rollout.pool import ray_setup
    from rollout.pool.pool import RolloutPool

    path = tmp_path_factory.mktemp("colocate") / "tiny-llama"
    save_tiny_checkpoint(make_tiny_hf_model("llama", seed=0), path)
    factory = EngineFactory(str(path), dtype="float32", device="cpu", options=OPTIONS)
    try:
        ray_setup.init("local", num_cpus=3)
    except Exception as e:  # noqa: BLE001 - no Ray on this box is a skip, not a failure
        if ray.is_initialized():
            ray.shutdown()
        pytest.skip(f"Ray could not start here: {e!r}")
    try:
        p = RolloutPool(2, factory, max_inflight_seqs=4, torch_threads=1, transfer_timeout_s=60, start_timeout_s=240,
                        colocate_with_trainer=True, trainer_device="cpu")
    except BaseException:
        ray.shutdown()
        raise
    yield p
    p.shutdown()
    ray.shutdown()


def _ask_each(pool, tag: str) -> list:
    return [pool.ray.get(m.actor.run.remote(f"{tag}-{i}", PROMPT, _greedy())).outputs[0]
            for i, m in enumerate(pool.members)]


def test_mixed_push_handle_and_gloo_reach_the_same_version_and_weights(pool) -> None:
    assert [m.colocated for m in pool.members] == [True, False]
    trainer = make_tiny_hf_model("llama", seed=7)
    assert pool.update_weights(trainer.named_parameters(), version=7) == 7
    assert pool.transfer.last_push["by_handle"] == 1 and pool.transfer.last_push["by_broadcast"] == 1
    assert [r["policy_version"] for r in pool.stats()["replicas"]] == [7, 7]
    outs = _ask_each(pool, "mixed")
    for out in outs:
        assert_matches_hf(trainer, PROMPT, out, temperature=0.0, atol=1e-4)
        assert set(out.policy_versions) == {7}
    assert outs[0].token_ids == outs[1].token_ids and outs[0].logprobs == outs[1].logprobs  # the same weights
    assert _leftovers() == [] and _mapped(pool.members[0].info["pid"]) == []  # trainer unlinked, replica unmapped


def test_bad_push_by_handle_leaves_old_weights_serving(pool) -> None:
    before = _ask_each(pool, "before")
    version = pool.policy_version
    new = make_tiny_hf_model("llama", seed=8)
    wrong_shape = [(n, t[:1] if n.endswith("q_proj.weight") else t) for n, t in new.named_parameters()]
    inf = [(n, torch.full_like(t, float("inf")) if n.endswith("down_proj.weight") else t)
           for n, t in new.named_parameters()]
    for bad, why in ((wrong_shape, "q_proj"), (inf, "not finite")):
        with pytest.raises(ValueError, match=why):
            pool.update_weights(bad, version=version + 1)
        assert [r["policy_version"] for r in pool.stats()["replicas"]] == [version, version]
        assert _leftovers() == [] and _mapped(pool.members[0].info["pid"]) == []
    with pytest.raises(ValueError, match="co-located"):  # tensors on a device other than the trainer's
        pool.update_weights([(n, t.to("meta")) for n, t in new.named_parameters()])
    after = _ask_each(pool, "after")
    assert [o.token_ids for o in after] == [o.token_ids for o in before] and pool.policy_version == version
    for a, b in zip(after, before):
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)


def test_a_pool_of_colocated_replicas_needs_no_group(pool) -> None:
    pool.members[1].colocated = True  # both replicas share this trainer's host: both map the buckets
    try:
        trainer = make_tiny_hf_model("llama", seed=9)
        assert pool.update_weights(trainer.named_parameters()) == pool.policy_version == 8
        assert pool.transfer.group is None and pool.transfer.last_push["by_handle"] == 2
        for out in _ask_each(pool, "handles"):
            assert_matches_hf(trainer, PROMPT, out, temperature=0.0, atol=1e-4)
        assert _leftovers() == [] and all(_mapped(m.info["pid"]) == [] for m in pool.members)
    finally:
        pool.members[1].colocated = False
    assert pool.update_weights(trainer.named_parameters(), version=10) == 10  # a new group for the broadcast
    assert pool.transfer.last_push["by_broadcast"] == 1
