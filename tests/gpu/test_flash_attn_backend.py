"""flash-attn backend vs the torch reference (runs only where CUDA and the flash-attn package exist)."""

import pytest
import torch

from rollout.layers.attention import TorchAttentionBackend
from rollout.layers.backends import flash_attn_available
from tests.tiny_models import make_metadata

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    # flash-attn 2 itself: flash-attn-4 alone installs a namespace ``flash_attn`` that importorskip would accept
    pytest.mark.skipif(not flash_attn_available(), reason="needs the flash-attn (2) package"),
]


@pytest.mark.parametrize("specs", [[(0, 37), (0, 300), (5, 1)], [(100, 1), (600, 1), (1, 1)]])
def test_matches_reference(specs):
    from rollout.layers.flash_attn_backend import FlashAttnBackend

    torch.manual_seed(0)
    bs, hq, hkv, d = 256, 8, 2, 128
    meta = make_metadata(specs, block_size=bs, num_blocks=16, device="cuda")
    t = int(meta.query_start_loc[-1])
    q = torch.randn(t, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(t, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(t, hkv, d, device="cuda", dtype=torch.bfloat16)
    cache = torch.randn(2, 16, bs, hkv, d, device="cuda", dtype=torch.bfloat16)
    ref_cache = cache.clone()
    out = FlashAttnBackend(bs).forward(q, k, v, cache, meta, d**-0.5)
    ref = TorchAttentionBackend().forward(q, k, v, ref_cache, meta, d**-0.5)
    assert (out.float() - ref.float()).norm() / ref.float().norm() < 1e-2


def test_block_size_must_suit_flash_attn():
    from rollout.layers.flash_attn_backend import FlashAttnBackend

    with pytest.raises(ValueError, match="multiple of 256"):
        FlashAttnBackend(16)
