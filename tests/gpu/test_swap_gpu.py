"""Swap on CUDA (skipped without CUDA): preemption by swap through the pinned host pool, async with graphs,
gives the tokens of a roomy engine, and recompute-only does too (float32 so the two agree exactly)."""

import pytest
import torch

from rollout import Engine, SamplingParams
from tests.gpu.test_engine_gpu import _hf, _prompts, _toks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_swap_and_recompute_match_roomy_engine():
    hf = _hf("llama", dtype=torch.float32)
    prompts = _prompts(12, 4096, lo=32, hi=160, seed=3)
    params = [SamplingParams(temperature=0.8, max_tokens=96, seed=7 + i, ignore_eos=True,
                             n=2 if i % 4 == 0 else 1) for i in range(len(prompts))]
    common = dict(dtype="float32", device="cuda", max_model_len=512, block_size=16, attention_backend="triton",
                  max_num_seqs=8, max_num_batched_tokens=512)
    roomy = Engine.from_pretrained(hf, **common)
    ref = _toks(roomy.generate(prompts, params))
    del roomy
    for swap in (0.0, 0.25):
        engine = Engine.from_pretrained(hf, num_blocks=48, swap_space_gib=swap, **common)
        outs = engine.generate(prompts, params)
        stats = engine.get_stats()
        assert stats.num_preemptions > 0
        assert (stats.num_swap_ins > 0) == bool(swap), stats
        assert _toks(outs) == ref
        assert engine.block_manager.num_free_host_blocks == engine.kv.num_host_blocks
        del engine
