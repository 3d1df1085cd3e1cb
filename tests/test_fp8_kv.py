"""FP8 KV cache (kv_cache_dtype="fp8"): the format, the torch reference path end to end on the CPU, and
the Triton kernels (K/V store, decode, prefill) against the torch reference in the interpreter.

The interpreter checks run in a child process (tests/interpreter.py explains why); everything else
runs in the pytest process, which never imports the kernels.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rollout import SamplingParams
from rollout.config import EngineConfig
from rollout.engine.runners.kv_cache import KVCache
from rollout.layers.attention import TorchAttentionBackend, reference_attention, write_kv
from rollout.layers.backends import AttentionSpec, resolve_attention
from rollout.layers.kv_quant import (
    FP8_MAX,
    dequantize_fp8,
    fp8_block_bytes,
    fp8_views,
    quantize_fp8,
)
from tests.engine_helpers import hf_logprobs, make_engine, random_prompts
from tests.interpreter import child_main, child_verdicts
from tests.test_kernels import SCALE, assert_close, long_tail, scenario
from tests.tiny_models import make_tiny_hf_model


def rows_with_extremes(n: int, d: int, seed: int = 0) -> torch.Tensor:
    """[n, 2, d] K or V rows: random, plus an all-zero row, a tiny row, a huge row, an outlier channel."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 2, d, generator=gen)
    x[0, 0] = 0.0
    x[1, 1] *= 1e-6
    x[2, 0] *= 3e3
    x[3, :, 5] = 200.0
    return x


# ---- the format (pytest process) ------------------------------------------------------------------
def test_quantize_never_saturates_and_error_is_bounded():
    x = rows_with_extremes(64, 128)
    values, scales = quantize_fp8(x)
    v = values.float()
    assert torch.isfinite(v).all() and v.abs().max() <= FP8_MAX
    normal = x.abs().amax(-1) >= FP8_MAX * 2**-14  # float16 scale not subnormal: the row's max maps to 448
    assert normal.sum() == normal.numel() - 2
    assert torch.equal(v.abs().amax(-1)[normal], torch.full_like(v.abs().amax(-1)[normal], FP8_MAX))
    assert (scales > 0).all()
    err = (dequantize_fp8(values, scales) - x).abs()
    bound = x.abs() * 2**-4 + scales.float()[..., None] * 2**-10  # half an e4m3 ulp, or a subnormal step
    assert (err <= bound).all(), (err - bound).max()


def test_fp8_views_share_memory_and_block_copies_move_scales():
    raw = torch.zeros(2, 5, fp8_block_bytes(8, 2, 16), dtype=torch.uint8)
    values, scales = fp8_views(raw, 2, 16)
    assert values.k.shape == values.v.shape == (5, 8, 2, 16) and scales.shape == (2, 5, 8, 2)
    k = torch.randn(3, 2, 16)
    write_kv(values, k, -k, torch.tensor([4 * 8 + 1, -1, 9]), scales)
    raw[:, torch.tensor([2])] = raw[:, torch.tensor([4])]  # the runners' copy-on-write
    for i, half in enumerate(values):
        got = dequantize_fp8(half[2, 1], scales[i, 2, 1])
        assert torch.allclose(got, k[0] * (1 - 2 * i), rtol=2**-4, atol=1e-6)
    with pytest.raises(ValueError, match="fp8 kv_cache"):
        fp8_views(raw, 3, 16)


def test_fp8_layout_k_token_major_v_and_scales_token_contiguous():
    """K is [page, Hkv, D] per block; V is [Hkv, D, page] (tokens contiguous: the 8-bit tensor-core
    operand of PV must be contiguous along tokens); each half's scales are [Hkv, page] after its values."""
    page, hkv, d = 8, 2, 16
    raw = torch.zeros(2, 3, fp8_block_bytes(page, hkv, d), dtype=torch.uint8)
    values, scales = fp8_views(raw, hkv, d)
    split = page * hkv * d
    assert values.k.stride() == (raw.shape[2], hkv * d, d, 1)
    assert values.v.stride() == (raw.shape[2], 1, d * page, page)
    assert scales.stride()[2:] == (1, page)
    rows = torch.arange(hkv * d, dtype=torch.float32).view(1, hkv, d) + 1.0
    write_kv(values, rows, rows, torch.tensor([1 * page + 3]), scales)  # block 1, slot 3
    qv, sc = quantize_fp8(rows[0])
    kb, vb = raw[0, 1, :split], raw[1, 1, :split]
    assert torch.equal(kb.view(page, hkv, d)[3], qv.view(torch.uint8))
    assert torch.equal(vb.view(hkv, d, page)[:, :, 3], qv.view(torch.uint8))
    for i in (0, 1):
        assert torch.equal(raw[i, 1, split:].view(torch.float16).view(hkv, page)[:, 3], sc)


def test_kv_cache_dtype_config():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="flash_attn"):
        EngineConfig(kv_cache_dtype="fp8", attention_backend="flash_attn")
    assert resolve_attention("auto", torch.device("cpu"), 16, "fp8").backend == "torch"


def test_capacity_at_real_head_dim_is_at_least_1_9x_bf16():
    model = SimpleNamespace(num_layers=28, num_kv_heads=2, head_dim=128)
    caps = {}
    for kv in ("bfloat16", "fp8"):
        config = EngineConfig(kv_cache_dtype=kv, cpu_kv_cache_gib=0.02, max_num_seqs=64)
        caps[kv] = KVCache(model, config, torch.device("cpu"), torch.float32, 32768, AttentionSpec("torch", 16, kv))
    assert caps["fp8"].token_bytes == 28 * 2 * 2 * 130
    assert caps["fp8"].num_tokens >= 1.9 * caps["bfloat16"].num_tokens
    assert caps["fp8"].storage.dtype == torch.uint8


# ---- the engine on the CPU (torch reference backend) ----------------------------------------------
def test_engine_fp8_close_to_hf_and_exact_kv_stays_exact():
    hf = make_tiny_hf_model("qwen3", head_dim=32)
    prompts = random_prompts(4, hf.config.vocab_size, lo=20, hi=60, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    deltas = {}
    for kv in ("auto", "fp8"):
        engine = make_engine(hf, block_size=8, kv_cache_dtype=kv)
        d = []
        for prompt, out in zip(prompts, engine.generate(prompts, params)):
            toks = out.outputs[0].token_ids
            want = hf_logprobs(hf, prompt, toks)[torch.arange(len(toks)), torch.tensor(toks)]
            d.append((torch.tensor(out.outputs[0].logprobs) - want).abs())
        deltas[kv] = torch.cat(d)
    print(f"mean |dlogprob| vs HF: fp32 KV {deltas['auto'].mean():.2e}, fp8 KV {deltas['fp8'].mean():.2e}")
    assert deltas["auto"].max() <= 1e-4
    assert 0 < deltas["fp8"].mean() <= 0.05


def test_engine_fp8_batch_invariant_with_shared_prompt_blocks():
    """Quantization is per row, so a request's fp8 KV (and output) does not depend on its batch, and n
    samples forked off one prompt (copy-on-write of the shared partial block) agree with a solo run."""
    hf = make_tiny_hf_model("llama")
    prompts = random_prompts(3, hf.config.vocab_size, lo=9, hi=30, seed=6)
    params = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, n=3, seed=11)
    crowd = make_engine(hf, block_size=8, kv_cache_dtype="fp8", max_num_seqs=16).generate(prompts, params)
    for prompt, out in zip(prompts, crowd):
        solo = make_engine(hf, block_size=8, kv_cache_dtype="fp8").generate([prompt], params)[0]
        assert [c.token_ids for c in out.outputs] == [c.token_ids for c in solo.outputs]
        for c, ref in zip(out.outputs, solo.outputs):  # fp32 GEMMs of other batch sizes round differently
            assert torch.allclose(torch.tensor(c.logprobs), torch.tensor(ref.logprobs), atol=1e-4)


# ---- the kernels in the Triton interpreter (child process) -----------------------------------------
def fp8_scenario(q_lens, seq_lens, hq, hkv, d, page, seed=0, v_scale=1.0):
    """(q, raw cache, values views, scales view, meta): the fp32 scenario (V times ``v_scale``)
    quantized; unowned slots NaN."""
    q, cache32, meta = scenario(q_lens, seq_lens, hq, hkv, d, page, seed=seed)
    cache32[1] *= v_scale
    raw = torch.full((2, cache32.shape[1], fp8_block_bytes(page, hkv, d)), 0x7F, dtype=torch.uint8)  # NaN
    values, scales = fp8_views(raw, hkv, d)
    owned = ~cache32.isnan().any(-1)
    qv, sc = quantize_fp8(cache32.nan_to_num())
    for i, half in enumerate(values):
        half.view(torch.uint8)[owned[i]] = qv[i].view(torch.uint8)[owned[i]]
    scales[owned] = sc[owned]
    return q, raw, values, scales, meta


def check_kv_write_bitwise():
    from rollout.kernels.kv_write import write_kv_triton

    raws = [torch.full((2, 6, fp8_block_bytes(8, 2, 128)), 0x7F, dtype=torch.uint8) for _ in range(2)]
    k, v = rows_with_extremes(7, 128, 1), rows_with_extremes(7, 128, 2)
    slots = torch.tensor([9, -1, 0, 47, 20, 33, 5])
    (values, scales), (values_t, scales_t) = (fp8_views(r, 2, 128) for r in raws)
    write_kv(values, k, v, slots, scales)
    write_kv_triton(values_t, k, v, slots, scales_t)
    assert torch.equal(raws[0], raws[1]), "the kernel's fp8 bytes or scales differ from quantize_fp8's"


def check_decode_fp8(hq, hkv, d, page, seq_lens, window=None, q_dtype=torch.float32, tol=1e-4, v_scale=1.0,
                     **kw):  # fmt: skip
    """16-bit queries take the fp16 product path; ``v_scale`` makes V tiny (its scales near fp16's
    subnormals: the kernel must scale P's columns relative to the tile, not absolutely). ``tol`` is
    relative to ``v_scale``. The chunked splits (fp8's default decode, the stream split, has its checks in
    test_decode_stream.py)."""
    from rollout.kernels.paged_decode import paged_decode_attention

    kw.setdefault("stream", False)

    q, _, values, scales, meta = fp8_scenario([1] * len(seq_lens), seq_lens, hq, hkv, d, page, v_scale=v_scale)
    q = q.to(q_dtype)
    ref = reference_attention(q.float(), values, meta, SCALE, window, scales)
    out = paged_decode_attention(q, values, meta.block_tables, meta.seq_lens, SCALE, window, kv_scales=scales, **kw)
    assert_close(out / v_scale, ref / v_scale, tol)


def check_prefill_fp8(q_lens, seq_lens, hq, hkv, d, page, window=None, q_dtype=torch.float32, tol=1e-4,
                      v_scale=1.0):  # fmt: skip
    from rollout.kernels.paged_prefill import paged_prefill_attention

    q, _, values, scales, meta = fp8_scenario(q_lens, seq_lens, hq, hkv, d, page, v_scale=v_scale)
    q = q.to(q_dtype)
    ref = reference_attention(q.float(), values, meta, SCALE, window, scales)
    out = paged_prefill_attention(
        q, values, meta.query_start_loc, meta.seq_lens, meta.block_tables, SCALE, meta.max_query_len,
        sliding_window=window, block_m=16, block_n=16, kv_scales=scales,
    )  # fmt: skip
    assert_close(out / v_scale, ref / v_scale, tol)


def check_backend_fp8(q_lens, seq_lens):
    """Triton backend on a raw fp8 cache == torch backend: same bytes written, same attention."""
    from rollout.layers.triton_backend import TritonAttentionBackend

    q, raw, _, _, meta = fp8_scenario(q_lens, seq_lens, 4, 2, 16, 8)
    gen = torch.Generator().manual_seed(2)
    k, v = torch.randn(2, q.shape[0], 2, 16, generator=gen).unbind(0)
    ref_raw = raw.clone()
    ref = TorchAttentionBackend().forward(q, k, v, ref_raw, meta, SCALE)
    out = TritonAttentionBackend().forward(q, k, v, raw, meta, SCALE)
    assert torch.equal(raw, ref_raw)
    assert_close(out, ref, 1e-4)


def check_decode_fp8_even_split():
    """Even lengths on an fp8 cache take the fixed split sized for fp8's resident programs (FP8_PROGRAMS_PER_SM),
    not bf16's: bit for bit the fixed-split call with that count, which differs from bf16's here."""
    import rollout.kernels.paged_decode as pd

    lens = [300, 280, 310, 295]
    q, _, values, scales, meta = fp8_scenario([1] * len(lens), lens, 4, 2, 16, 16)
    block_n = pd.decode_config(16, 16, values[0].dtype)[0]
    tiles, sms = -(-meta.block_tables.shape[1] * 16 // block_n), pd.num_sms(q.device)
    # one wave and no minimum chunk: the count alone, which the resident programs decide
    # the even rule, not the stream split fp8 takes by default
    old = pd.EVEN_WAVES, pd.EVEN_MIN_CHUNK_TILES, pd.FP8_EVEN_MIN_CHUNK_TILES, pd.STREAM_K_FP8
    pd.EVEN_WAVES, pd.EVEN_MIN_CHUNK_TILES, pd.FP8_EVEN_MIN_CHUNK_TILES, pd.STREAM_K_FP8 = 1, 0, 0, False
    try:
        fp8 = pd.choose_num_splits(4, 2, tiles, sms, pd.resident_programs(values[0].dtype))
        bf16 = pd.choose_num_splits(4, 2, tiles, sms, pd.resident_programs(torch.bfloat16))
        assert fp8 != bf16, "the check must tell them apart"
        want = pd.paged_decode_attention(q, values, meta.block_tables, meta.seq_lens, SCALE, kv_scales=scales,
                                         num_splits=fp8)
        plans: dict = {}
        out = pd.paged_decode_attention(q, values, meta.block_tables, meta.seq_lens, SCALE, kv_scales=scales,
                                        plans=plans, even_lengths=True)
    finally:
        pd.EVEN_WAVES, pd.EVEN_MIN_CHUNK_TILES, pd.FP8_EVEN_MIN_CHUNK_TILES, pd.STREAM_K_FP8 = old
    assert torch.equal(out, want), "fp8's even split must be sized for its own resident programs"
    # the fused merge on the even path keeps its zeroed counters in the step's dict (one set for every layer)
    old, pd.FUSED_MERGE = pd.FUSED_MERGE, True
    try:
        again = pd.paged_decode_attention(q, values, meta.block_tables, meta.seq_lens, SCALE, kv_scales=scales,
                                          plans=plans, even_lengths=True, stream=False)
        assert_close(again, want, 1e-5)
    finally:
        pd.FUSED_MERGE = old
    assert len(plans) == 1 and not next(iter(plans.values())).any(), "counters kept, and back at zero"


def check_decode_fp8_even_min_chunk():
    """An fp8 cache's even split cuts chunks of FP8_EVEN_MIN_CHUNK_TILES, not bf16's EVEN_MIN_CHUNK_TILES: bit for
    bit the fixed-split call with fp8's minimum (4 chunks of 2 tiles here; bf16's 5 would leave one)."""
    import rollout.kernels.paged_decode as pd

    lens = [500, 520, 480, 510, 490, 505, 515, 495]  # ~8 key tiles of 64 each
    q, _, values, scales, meta = fp8_scenario([1] * len(lens), lens, 4, 2, 16, 16)
    block_n = pd.decode_config(16, 16, values[0].dtype)[0]
    tiles, sms = -(-meta.block_tables.shape[1] * 16 // block_n), pd.num_sms(q.device)
    old = pd.EVEN_MIN_CHUNK_TILES, pd.FP8_EVEN_MIN_CHUNK_TILES
    pd.EVEN_MIN_CHUNK_TILES, pd.FP8_EVEN_MIN_CHUNK_TILES = 5, 2
    try:
        assert pd.even_min_chunk_tiles(values[0].dtype) == 2 and pd.even_min_chunk_tiles(torch.bfloat16) == 5
        n, floor = pd.even_num_splits(len(lens), 2, tiles, sms, pd.resident_programs(values[0].dtype), 2)
        assert (n, floor) == (4, 1), (n, floor)
        assert pd.even_num_splits(len(lens), 2, tiles, sms, pd.resident_programs(values[0].dtype), 5)[0] == 1
        want = pd.paged_decode_attention(q, values, meta.block_tables, meta.seq_lens, SCALE, kv_scales=scales,
                                         num_splits=n, fixed_min_chunk=2, fixed_min_splits=floor)
        out = pd.paged_decode_attention(q, values, meta.block_tables, meta.seq_lens, SCALE, kv_scales=scales,
                                        plans={}, even_lengths=True, stream=False)
    finally:
        pd.EVEN_MIN_CHUNK_TILES, pd.FP8_EVEN_MIN_CHUNK_TILES = old
    assert torch.equal(out, want), "fp8's even split must take FP8_EVEN_MIN_CHUNK_TILES"


def check_fp8_errors():
    from rollout.kernels.paged_decode import paged_decode_attention

    q, _, values, scales, meta = fp8_scenario([1, 1], [5, 9], 4, 2, 16, 8)
    with pytest.raises(ValueError, match="kv_scales"):
        paged_decode_attention(q, values, meta.block_tables, meta.seq_lens, SCALE)
    with pytest.raises(ValueError, match="kv_scales"):
        paged_decode_attention(q, values, meta.block_tables, meta.seq_lens, SCALE, kv_scales=scales.float())


CHECKS = {
    "kv_write_fp8_bitwise": check_kv_write_bitwise,
    "decode_fp8_balanced_long_tail": lambda: check_decode_fp8(4, 2, 16, 16, long_tail(12, 800, 7), split_target=12,
                                                              min_chunk=1),
    "decode_fp8_gqa6_fixed_splits": lambda: check_decode_fp8(12, 2, 16, 8, [1, 40, 300], num_splits=3),
    "decode_fp8_unswapped_long_tail": lambda: check_decode_fp8(12, 2, 16, 16, long_tail(12, 800, 7), split_target=12,
                                                               min_chunk=1, swap_ab=False),
    "decode_fp8_unswapped_bf16_queries_tiny_v": lambda: check_decode_fp8(6, 2, 32, 16, [7, 260, 45],
                                                                         q_dtype=torch.bfloat16, tol=2e-2,
                                                                         v_scale=1e-5, split_target=4, swap_ab=False),
    "decode_fp8_gqa8_one_kv_head_window": lambda: check_decode_fp8(8, 1, 16, 8, [3, 200, 77], window=50,
                                                                   split_target=6, min_chunk=1),
    "decode_fp8_fp16_queries": lambda: check_decode_fp8(4, 2, 32, 16, [7, 260], q_dtype=torch.float16, tol=1e-2),
    "decode_fp8_bf16_queries_tiny_v": lambda: check_decode_fp8(6, 2, 32, 16, [7, 260, 45], q_dtype=torch.bfloat16,
                                                               tol=2e-2, v_scale=1e-5, split_target=4),
    "decode_fp8_swap_ab_long_tail": lambda: check_decode_fp8(12, 2, 16, 16, long_tail(12, 800, 7), split_target=12,
                                                             min_chunk=1, swap_ab=True),
    "decode_fp8_swap_ab_bf16_queries_tiny_v": lambda: check_decode_fp8(6, 2, 32, 16, [7, 260, 45], window=100,
                                                                       q_dtype=torch.bfloat16, tol=2e-2, v_scale=1e-5,
                                                                       split_target=4, swap_ab=True),
    "decode_fp8_v_pages_long_tail": lambda: check_decode_fp8(12, 2, 16, 16, long_tail(12, 800, 7), split_target=12,
                                                             min_chunk=1, swap_ab=True, v_pages=True),
    "decode_fp8_v_pages_page8_bf16_queries_window": lambda: check_decode_fp8(
        6, 2, 32, 8, [7, 260, 45, 1000], q_dtype=torch.bfloat16, tol=1e-2, window=300, split_target=5, swap_ab=True,
        v_pages=True),
    "decode_fp8_v_pages_page32_d64": lambda: check_decode_fp8(8, 2, 64, 32, [5, 100, 700], split_target=6, min_chunk=1,
                                                              swap_ab=True, v_pages=True),
    "decode_fp8_v_pages_page64_one_page_tiles": lambda: check_decode_fp8(4, 1, 32, 64, [64, 65, 400], split_target=3,
                                                                         min_chunk=1, swap_ab=True, v_pages=True),
    "prefill_fp8_bf16_queries_tiny_v": lambda: check_prefill_fp8([1, 20, 33], [9, 20, 70], 4, 2, 32, 16,
                                                                  q_dtype=torch.bfloat16, tol=2e-2, v_scale=1e-5),
    "prefill_fp8_cached_prefix": lambda: check_prefill_fp8([1, 17, 5, 40], [9, 17, 70, 100], 4, 2, 32, 16),
    "prefill_fp8_window": lambda: check_prefill_fp8([1, 30, 45], [40, 30, 90], 4, 1, 16, 8, window=7),
    "backend_fp8_decode": lambda: check_backend_fp8([1, 1, 1], [4, 17, 33]),
    "backend_fp8_prefill": lambda: check_backend_fp8([3, 1, 20], [10, 17, 20]),
    "decode_fp8_even_split": check_decode_fp8_even_split,
    "decode_fp8_even_min_chunk": check_decode_fp8_even_min_chunk,
    "fp8_argument_errors": check_fp8_errors,
}


@pytest.fixture(scope="module")
def verdicts() -> dict[str, str]:
    return child_verdicts(__file__)


@pytest.mark.parametrize("name", list(CHECKS))
def test_kernel_fp8(verdicts: dict[str, str], name: str) -> None:
    assert verdicts[name] == "ok", verdicts[name]


if __name__ == "__main__":
    child_main(CHECKS)
