"""KV cache sizing beside the step's workspace (the CUDA rule, fed numbers here; tests/gpu measures it
for real) and the CPU's unchanged budget rule."""

from types import SimpleNamespace

import pytest
import torch

from rollout.config import EngineConfig
from rollout.engine.runners.kv_cache import KVCache, KVCacheTooLarge, fit_num_blocks, resolve_kv_dtype
from rollout.layers.backends import AttentionSpec, resolve_attention

CPU_ATTN = AttentionSpec("torch", 16, "auto")

GIB = 2**30


def test_explicit_num_blocks_must_leave_the_workspace_and_headroom_free():
    config = EngineConfig(num_blocks=1000)
    # 10 GiB free, 2 GiB workspace, 2% of 80 GiB (1.6 GiB) for fragmentation, 10 MiB blocks: 655 fit
    with pytest.raises(KVCacheTooLarge, match="largest num_blocks that fits is 655") as err:
        fit_num_blocks(config, 10 * GIB, 80 * GIB, 2 * GIB, 10 * 2**20, enough=10**6)
    assert err.value.max_num_blocks == 655
    assert isinstance(err.value, ValueError)
    assert fit_num_blocks(EngineConfig(num_blocks=655), 10 * GIB, 80 * GIB, 2 * GIB, 10 * 2**20, 10**6) == 655


def test_explicit_num_blocks_named_as_fitting_keeps_room_beyond_the_measured_workspace():
    """The count a refusal names must run: on an H100 W2's cache at exactly (free - workspace) ran out of memory in
    its warm-up (30 MiB short, 0.6 GiB reserved but unallocated). The named count leaves the allocator room."""
    free, total, workspace, block = 69 * GIB, 80 * GIB, GIB, 16 * 2**20
    with pytest.raises(KVCacheTooLarge) as err:
        fit_num_blocks(EngineConfig(num_blocks=10**6), free, total, workspace, block, enough=10**6)
    left = free - workspace - err.value.max_num_blocks * block
    assert left >= 0.02 * total - block


def test_derived_num_blocks_subtracts_the_workspace_and_respects_utilization():
    config = EngineConfig(gpu_memory_utilization=0.9)
    # 50 GiB free of 80: utilization keeps 8 GiB back, the workspace 2 GiB more -> 40 GiB of 1 GiB blocks
    assert fit_num_blocks(config, 50 * GIB, 80 * GIB, 2 * GIB, GIB, enough=10**6) == 40
    assert fit_num_blocks(config, 50 * GIB, 80 * GIB, 2 * GIB, GIB, enough=7) == 7
    with pytest.raises(ValueError, match="no room for a KV cache"):
        fit_num_blocks(config, 9 * GIB, 80 * GIB, 2 * GIB, GIB, enough=10**6)


def test_cpu_keeps_its_budget_and_explicit_count():
    model = SimpleNamespace(num_layers=2, num_kv_heads=2, head_dim=16)
    kv = KVCache(model, EngineConfig(cpu_kv_cache_gib=0.001, max_num_seqs=4), torch.device("cpu"), torch.float32, 64,
                 CPU_ATTN)
    assert kv.num_blocks == 4 * 4 + 1 and kv.workspace_bytes == 0  # enough for every sequence, within budget
    kv = KVCache(model, EngineConfig(num_blocks=3), torch.device("cpu"), torch.float32, 64, CPU_ATTN)
    assert kv.num_blocks == 3 and kv.num_tokens == 48 and kv.storage.shape == (2, 2, 3, 16, 2, 16)


def test_resolve_kv_dtype():
    assert resolve_kv_dtype("auto", torch.bfloat16) is torch.bfloat16
    assert resolve_kv_dtype("float32", torch.bfloat16) is torch.float32
    assert resolve_kv_dtype("fp8", torch.bfloat16) is torch.float8_e4m3fn
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        resolve_kv_dtype("int4", torch.bfloat16)


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8"])
def test_workspace_dummy_steps_are_valid_batches(kv_dtype):
    """The steps the engine measures on CUDA (largest decode, largest mixed step, heaviest sampler) run
    on the CPU's torch backend too: shapes, block tables and the fp8 layout all line up."""
    from rollout.engine.loading import build_model
    from rollout.engine.runners.memory_profile import dummy_step, mixed_q_lens
    from tests.tiny_models import make_tiny_hf_model

    hf = make_tiny_hf_model("qwen2")
    model, _ = build_model(hf, "float32", torch.device("cpu"))
    config = EngineConfig(max_num_seqs=6, max_num_batched_tokens=40, block_size=8, kv_cache_dtype=kv_dtype)
    kv = KVCache(model, EngineConfig(num_blocks=1, block_size=8, kv_cache_dtype=kv_dtype), torch.device("cpu"),
                 torch.float32, 64, CPU_ATTN)
    backend = resolve_attention("auto", torch.device("cpu"), 8, kv_dtype).build()
    assert mixed_q_lens(config, 16) == [16, 16, 5, 1, 1, 1]  # 40 tokens, none past max_model_len
    for q_lens in ([1] * 6, mixed_q_lens(config, 16)):
        with torch.inference_mode():  # as measure_step_workspace runs it
            tokens, logprobs = dummy_step(model, kv.layers, backend, q_lens, 2, torch.device("cpu"))
        assert tokens.shape == logprobs.shape == (6,) and torch.isfinite(logprobs).all()
