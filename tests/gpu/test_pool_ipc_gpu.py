"""A pool replica co-located with the trainer on its GPU takes weights by CUDA IPC (skipped without CUDA / Ray).

This process is the trainer, on cuda:0. One GPU: replica 0 is co-located (by CUDA IPC). Two GPUs: replica
0 by CUDA IPC and replica 1 on the other GPU by NCCL, in one push. Each replica's greedy tokens and
logprobs must equal an in-process engine's with the trainer's weights; a bad push changes nothing; the
trainer's buckets are freed after the push (its allocated CUDA memory is back where it was).
"""

from __future__ import annotations

import os

import pytest
import torch

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from rollout import Engine, SamplingParams  # noqa: E402
from rollout.pool import EngineFactory  # noqa: E402
from rollout.weights.handles import SHM_DIR, SHM_PREFIX, gpu_uuid  # noqa: E402

PROMPT = [5, 17, 300, 42, 9, 77, 1000, 3]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
OPTIONS = dict(max_model_len=1024, num_blocks=256, gpu_memory_utilization=0.3)


def hf_model(seed: int, device: str = "cuda:0"):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                      num_key_value_heads=2, vocab_size=4096, max_position_embeddings=4096, initializer_range=0.05)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("pool-ipc") / "tiny"
    hf_model(0, "cpu").save_pretrained(path)
    return str(path)


def _reference(model) -> tuple[list[int], list[float]]:
    engine = Engine.from_pretrained(model, dtype="bfloat16", device="cuda:0", **OPTIONS)
    c = engine.generate([PROMPT], GREEDY)[0].outputs[0]
    return c.token_ids, c.logprobs


def _each(pool, tag: str) -> list[tuple[list[int], list[float]]]:
    outs = [pool.ray.get(m.actor.run.remote(f"{tag}-{i}", PROMPT, GREEDY)).outputs[0]
            for i, m in enumerate(pool.members)]
    return [(c.token_ids, c.logprobs) for c in outs]


def _same(a, b) -> None:
    assert a[0] == b[0] and torch.allclose(torch.tensor(a[1]), torch.tensor(b[1]), atol=2e-2)


def _push_checks(pool, by_handle: int, by_broadcast: int) -> None:
    from rollout.pool.pool import RolloutPool

    assert isinstance(pool, RolloutPool)
    assert pool.members[0].info["device_uuid"] == gpu_uuid("cuda:0")  # replica 0 is on the trainer's GPU
    trainer = hf_model(1)
    assert pool.update_weights(hf_model(2).named_parameters(), version=2) == 2  # opens any group, warms up
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated(0)
    assert pool.update_weights(trainer.named_parameters(), version=3) == 3
    assert pool.transfer.last_push["by_handle"] == by_handle and pool.transfer.last_push["by_broadcast"] == by_broadcast
    assert torch.cuda.memory_allocated(0) == base  # the trainer's buckets are freed once the replicas answered
    ref = _reference(trainer)
    served = _each(pool, "ipc")
    for s in served:
        _same(s, ref)
    bad = [(n, p[:1] if n.endswith("q_proj.weight") else p) for n, p in trainer.named_parameters()]
    with pytest.raises(ValueError, match="q_proj"):
        pool.update_weights(bad, version=4)
    nan = [(n, torch.full_like(p, float("nan")) if n.endswith("up_proj.weight") else p)
           for n, p in trainer.named_parameters()]
    with pytest.raises(ValueError, match="not finite"):
        pool.update_weights(nan, version=4)
    assert [r["policy_version"] for r in pool.stats()["replicas"]] == [3] * len(pool.members)
    for s, before in zip(_each(pool, "after"), served):  # old weights serving (now from the prefix cache)
        _same(s, before)
    with pytest.raises(ValueError, match="co-located"):  # the trainer's tensors on another device
        pool.update_weights([(n, p.cpu()) for n, p in trainer.named_parameters()])
    assert not [f for f in os.listdir(SHM_DIR) if f.startswith(f"{SHM_PREFIX}{os.getpid()}-")]


def _pool(ckpt: str, replicas: int):
    from rollout.pool.pool import RolloutPool

    factory = EngineFactory(ckpt, dtype="bfloat16", options=OPTIONS)
    return RolloutPool(replicas, factory, gpus_per_replica=1, colocate_with_trainer=True, trainer_device="cuda:0",
                       transfer_timeout_s=60, start_timeout_s=300)


def test_cuda_ipc_push_into_a_colocated_replica(ckpt):
    pool = _pool(ckpt, 1)
    try:
        _push_checks(pool, by_handle=1, by_broadcast=0)
    finally:
        pool.shutdown()
        ray.shutdown()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (NCCL to the second replica)")
def test_mixed_pool_cuda_ipc_and_nccl_in_one_push(ckpt):
    pool = _pool(ckpt, 2)
    try:
        assert pool.members[1].info["device_uuid"] == gpu_uuid("cuda:1")
        _push_checks(pool, by_handle=1, by_broadcast=1)
    finally:
        pool.shutdown()
        ray.shutdown()
