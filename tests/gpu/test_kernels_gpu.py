"""Triton paged-attention kernels on the GPU at real model shapes, bf16, against the fp32 reference.

Shapes follow the bench presets (llama3-8b 32/8/128, qwen3-0.6b 16/8/128, qwen2.5-1.5b 12/2/128),
block_size 16, batches 1..512, contexts up to 32K (W2's long-tailed lengths included), scattered
block tables, bf16 and fp8 caches. Also checks that a decode step (K/V store + attention) captures
into a CUDA graph and replays correctly with new lengths.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton")

from rollout.kernels.kv_write import write_kv_triton  # noqa: E402
from rollout.kernels.paged_decode import paged_decode_attention  # noqa: E402
from rollout.kernels.paged_prefill import paged_prefill_attention  # noqa: E402
from rollout.layers.attention import reference_attention, write_kv  # noqa: E402
from rollout.layers.attention_metadata import AttentionMetadata  # noqa: E402
from rollout.layers.kv_quant import fp8_block_bytes, fp8_views, quantize_fp8  # noqa: E402
from rollout.layers.triton_backend import TritonAttentionBackend  # noqa: E402

PRESETS = {"llama3-8b": (32, 8, 128), "qwen3-0.6b": (16, 8, 128), "qwen2.5-1.5b": (12, 2, 128)}
PAGE = 16
DEV = torch.device("cuda")


def build(q_lens, seq_lens, hq, hkv, d, dtype=torch.bfloat16, seed=0, extra_blocks=4):
    """(q, kv_cache, meta) on the GPU; blocks drawn from a shuffled pool, K/V random everywhere."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    nblk = [-(-s // PAGE) for s in seq_lens]
    num_blocks = sum(nblk) + 8
    pool = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).to(DEV, torch.int32)
    tables = torch.zeros(len(seq_lens), max(nblk) + extra_blocks, dtype=torch.int32, device=DEV)
    slots, at = [], 0
    for i, (ql, sl) in enumerate(zip(q_lens, seq_lens)):
        tables[i, : nblk[i]] = pool[at : at + nblk[i]]
        at += nblk[i]
        pos = torch.arange(sl - ql, sl, device=DEV)
        slots.append(tables[i, pos // PAGE].long() * PAGE + pos % PAGE)
    cache = torch.randn(2, num_blocks, PAGE, hkv, d, device=DEV, generator=gen).to(dtype)
    qsl = torch.tensor([0] + list(q_lens), device=DEV).cumsum(0).to(torch.int32)
    meta = AttentionMetadata(
        positions=torch.cat([torch.arange(s - q, s, device=DEV) for q, s in zip(q_lens, seq_lens)]),
        slot_mapping=torch.cat(slots),
        query_start_loc=qsl,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEV),
        block_tables=tables,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        decode_only=all(q == 1 for q in q_lens),
        query_lens_host=list(q_lens),
        seq_lens_host=list(seq_lens),
    )
    q = (2.0 * torch.randn(sum(q_lens), hq, d, device=DEV, generator=gen)).to(dtype)
    return q, cache, meta


def reference(q, cache, meta, window=None):
    """fp32 reference from the same (rounded) inputs."""
    return reference_attention(q.float(), cache, meta, q.shape[-1] ** -0.5, window)


def rel_err(out, ref):
    assert torch.isfinite(out).all(), "non-finite kernel output"
    return ((out.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()


def to_fp8(cache):
    """A bf16 cache's values in the fp8 layout: (raw bytes, values view, scales view)."""
    _, nb, page, hkv, d = cache.shape
    raw = torch.empty(2, nb, fp8_block_bytes(page, hkv, d), dtype=torch.uint8, device=DEV)
    values, scales = fp8_views(raw, hkv, d)
    qv, sc = quantize_fp8(cache)
    for i, half in enumerate(values):  # K token-major, V token-contiguous (rollout.layers.kv_quant)
        half.view(torch.uint8).copy_(qv[i].view(torch.uint8))
    scales.copy_(sc)
    return raw, values, scales


def poison_tails(values, meta):
    """NaN bytes (0x7F) in every slot past a sequence's end in its last block: stale slots a kernel
    loads must never reach the output (P is 0 there, but 0 * NaN is NaN)."""
    for i, sl in enumerate(meta.seq_lens.tolist()):
        if sl % PAGE:
            blk = int(meta.block_tables[i, (sl - 1) // PAGE])
            for half in values:
                half.view(torch.uint8)[blk, sl % PAGE :] = 0x7F


def long_tail_lens(batch, max_ctx, seed, lo=300):
    """W2-like: log-uniform in [lo, max_ctx] (prompt + a long-tailed generation so far), longest present."""
    gen = torch.Generator().manual_seed(seed)
    u = torch.rand(batch, generator=gen)
    lens = torch.exp(torch.log(torch.tensor(float(lo))) * (1 - u) + torch.log(torch.tensor(float(max_ctx))) * u)
    lens = lens.long().tolist()
    lens[batch // 3] = max_ctx
    return lens


def random_lens(batch, max_ctx, seed):
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(max(1, max_ctx // 2), max_ctx + 1, (batch,), generator=gen).tolist()
    lens[0] = max_ctx  # the longest one always present
    return lens


@pytest.mark.parametrize("preset", list(PRESETS))
@pytest.mark.parametrize("batch,max_ctx", [(1, 16384), (7, 3000), (64, 1024), (256, 512), (256, 16384)])
def test_decode_real_shapes(preset, batch, max_ctx):
    hq, hkv, d = PRESETS[preset]
    lens = random_lens(batch, max_ctx, seed=batch)
    q, cache, meta = build([1] * batch, lens, hq, hkv, d)
    out = paged_decode_attention(q, cache, meta.block_tables, meta.seq_lens, d**-0.5)
    assert rel_err(out, reference(q, cache, meta)) < 1e-2


@pytest.mark.parametrize("kv", ["bf16", "fp8"])
@pytest.mark.parametrize("batch,max_ctx", [(256, 16384), (512, 16384), (64, 32768), (2, 32768)])
def test_decode_w2_long_tail_and_32k(kv, batch, max_ctx):
    """qwen2.5-1.5b's 12/2 heads (GQA 6) over W2's long-tailed contexts and up to 32K, balanced chunks (not the
    stream split fp8 takes by default: test_decode_stream_split)."""
    hq, hkv, d = PRESETS["qwen2.5-1.5b"]
    q, cache, meta = build([1] * batch, long_tail_lens(batch, max_ctx, seed=batch), hq, hkv, d)
    scales = None
    if kv == "fp8":
        _, cache, scales = to_fp8(cache)
        poison_tails(cache, meta)
    out = paged_decode_attention(q, cache, meta.block_tables, meta.seq_lens, d**-0.5, kv_scales=scales, stream=False)
    ref = reference_attention(q.float(), cache, meta, d**-0.5, kv_scales=scales)
    assert rel_err(out, ref) < 1e-2


@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_decode_fused_merge_equals_two_kernels(kv):
    """The opt-in merge inside the split kernel (last chunk to finish merges, atomic counter per
    sequence and kv head): equal to the two-kernel path, replay after replay (the counters re-zero)."""
    hq, hkv, d = PRESETS["qwen2.5-1.5b"]
    q, cache, meta = build([1] * 256, long_tail_lens(256, 16384, seed=3), hq, hkv, d)
    scales = None
    if kv == "fp8":
        _, cache, scales = to_fp8(cache)
    args = (q, cache, meta.block_tables, meta.seq_lens, d**-0.5)
    want = paged_decode_attention(*args, kv_scales=scales, stream=False)
    for _ in range(5):
        got = paged_decode_attention(*args, kv_scales=scales, fused_merge=True, stream=False)
        assert (got.float() - want.float()).abs().max().item() <= 1e-2 * want.float().abs().max().item()


@pytest.mark.parametrize("segs", [0, 4, 8])
@pytest.mark.parametrize("kv", ["bf16", "fp8"])
@pytest.mark.parametrize("batch,max_ctx,waves", [(256, 16384, 1), (256, 3072, 2), (7, 32768, 1)])
def test_decode_stream_split(kv, batch, max_ctx, waves, segs, monkeypatch):
    """The stream split (runs of key tiles across sequences, paged_decode_stream.py) at W2's shapes: equal to the
    reference, graph padding (seq_len 0) zeroed, and one plan shared by a step's layers replayed in a CUDA graph;
    with the loop over a run's sequences and with 4 or 8 of them unrolled (STREAM_SEGS)."""
    import rollout.kernels.paged_decode_stream as ps

    monkeypatch.setattr(ps, "STREAM_SEGS", segs)
    hq, hkv, d = PRESETS["qwen2.5-1.5b"]
    lens = long_tail_lens(batch, max_ctx, seed=batch)
    if batch > 2:
        lens[-1] = lens[1] = 0
    q, cache, meta = build([1] * batch, [max(1, n) for n in lens], hq, hkv, d)
    meta.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
    scales = None
    if kv == "fp8":
        _, cache, scales = to_fp8(cache)
        poison_tails(cache, meta)
    args = (q, cache, meta.block_tables, meta.seq_lens, d**-0.5)
    ref = reference_attention(q.float(), cache, meta, d**-0.5, kv_scales=scales)
    live = meta.seq_lens > 0
    out = paged_decode_attention(*args, kv_scales=scales, stream=True, stream_waves=waves, plans={})
    assert rel_err(out[live], ref[live]) < 1e-2 and not out[~live].any()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plans = {}
        first = paged_decode_attention(*args, kv_scales=scales, stream=True, stream_waves=waves, plans=plans)
        second = paged_decode_attention(*args, kv_scales=scales, stream=True, stream_waves=waves, plans=plans)
    first.fill_(7.0)
    graph.replay()
    assert torch.equal(first, second) and rel_err(first[live], ref[live]) < 1e-2 and not first[~live].any()


@pytest.mark.parametrize("hq,hkv", [(8, 1), (16, 2), (32, 8)])  # GQA 8 with one kv head, 8, 4
def test_decode_gqa_groups_32k(hq, hkv):
    q, cache, meta = build([1] * 3, [32768, 17, 20000], hq, hkv, 128)
    for window in (None, 4096):
        out = paged_decode_attention(q, cache, meta.block_tables, meta.seq_lens, 128**-0.5, window)
        assert rel_err(out, reference(q, cache, meta, window)) < 1e-2


def test_prefill_fp8_and_kv_write_fp8():
    hq, hkv, d = PRESETS["qwen2.5-1.5b"]
    q, cache, meta = build([1, 512, 2000, 37], [4001, 512, 32000, 16003], hq, hkv, d)
    raw, values, scales = to_fp8(cache)
    poison_tails(values, meta)
    out = paged_prefill_attention(
        q, values, meta.query_start_loc, meta.seq_lens, meta.block_tables, d**-0.5, meta.max_query_len,
        kv_scales=scales,
    )
    assert rel_err(out, reference_attention(q.float(), values, meta, d**-0.5, kv_scales=scales)) < 1e-2
    k, v = (3 * torch.randn(2, meta.slot_mapping.shape[0], hkv, d, device=DEV)).to(torch.bfloat16).unbind(0)
    ref_raw = raw.clone()
    ref_values, ref_scales = fp8_views(ref_raw, hkv, d)
    write_kv(ref_values, k, v, meta.slot_mapping, ref_scales)
    write_kv_triton(values, k, v, meta.slot_mapping, scales)
    assert (raw != ref_raw).float().mean().item() < 1e-4, "fp8 store differs from quantize_fp8 beyond rounding"
    for i in (0, 1):
        got = values[i].float() * scales[i].float()[..., None]
        want = ref_values[i].float() * ref_scales[i].float()[..., None]
        assert torch.allclose(got, want, rtol=2**-3, atol=1e-6, equal_nan=True)  # poisoned tails: NaN in both


@pytest.mark.parametrize("splits", [1, 2, 3, 16, 64])
def test_decode_forced_splits_and_short_contexts(splits):
    hq, hkv, d = PRESETS["llama3-8b"]
    lens = [1, 2, 15, 16, 17, 100, 1000, 4097]
    q, cache, meta = build([1] * len(lens), lens, hq, hkv, d, extra_blocks=300)
    out = paged_decode_attention(q, cache, meta.block_tables, meta.seq_lens, d**-0.5, num_splits=splits)
    assert rel_err(out, reference(q, cache, meta)) < 1e-2


@pytest.mark.parametrize("dtype,tol", [(torch.float16, 1e-2), (torch.float32, 1e-4)])
def test_decode_other_dtypes_and_window(dtype, tol):
    hq, hkv, d = PRESETS["qwen2.5-1.5b"]
    lens = [5, 300, 4096, 9000]
    q, cache, meta = build([1] * 4, lens, hq, hkv, d, dtype=dtype)
    for window in (None, 1000):
        out = paged_decode_attention(q, cache, meta.block_tables, meta.seq_lens, d**-0.5, window)
        assert rel_err(out, reference(q, cache, meta, window)) < tol


@pytest.mark.parametrize("preset", list(PRESETS))
@pytest.mark.parametrize("window", [None, 1024])
def test_prefill_mixed_batch(preset, window):
    hq, hkv, d = PRESETS[preset]
    q_lens = [1, 512, 2000, 37, 1, 129]
    seq_lens = [4000, 512, 6000, 16000, 1, 129]
    q, cache, meta = build(q_lens, seq_lens, hq, hkv, d)
    out = paged_prefill_attention(
        q, cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, d**-0.5, meta.max_query_len, window
    )
    assert rel_err(out, reference(q, cache, meta, window)) < 1e-2


@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_backend_mixed_step_decode_rows(kv):
    """A mixed step with many one-token sequences, as the CUDA runner hands it (``mixed_decode_rows``): the
    decodes go to the split-KV kernel, the chunks to the prefill kernel; the result equals the same backend
    without ``decode_rows`` (every row by the prefill kernel) and, in bf16, the fp32 reference."""
    from types import SimpleNamespace

    from rollout.engine.runners.base import mixed_decode_rows

    hq, hkv, d = PRESETS["qwen3-0.6b"]
    q_lens = [1] * 40 + [300] + [1] * 30 + [45]
    seq_lens = random_lens(40, 3000, 5) + [900] + random_lens(30, 8000, 6) + [45]
    q, cache, meta = build(q_lens, seq_lens, hq, hkv, d)
    ref = reference(q, cache, meta)
    flat = cache.view(2, -1, hkv, d)  # the new tokens' K/V as build() put them: storing them changes nothing
    k, v = flat[0, meta.slot_mapping].clone(), flat[1, meta.slot_mapping].clone()
    layer = cache if kv == "bf16" else to_fp8(cache)[0]
    whole = TritonAttentionBackend().forward(q, k, v, layer.clone(), meta, d**-0.5)
    starts = meta.query_start_loc.tolist()
    meta.decode_rows = mixed_decode_rows(SimpleNamespace(decode_only=False, query_lens=q_lens, query_start_loc=starts),
                                         meta)
    assert meta.decode_rows is not None and meta.decode_rows.token_idx.numel() == 70
    out = TritonAttentionBackend().forward(q, k, v, layer, meta, d**-0.5)
    assert rel_err(out, whole.float()) < 2e-2
    if kv == "bf16":
        assert rel_err(out, ref) < 1e-2


def test_prefill_fp32_tight():
    hq, hkv, d = PRESETS["qwen3-0.6b"]
    q, cache, meta = build([300, 1, 64], [1000, 70, 64], hq, hkv, d, dtype=torch.float32)
    out = paged_prefill_attention(
        q, cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, d**-0.5, meta.max_query_len
    )
    assert rel_err(out, reference(q, cache, meta)) < 1e-4


def test_kv_write_matches_torch():
    hkv, d = 8, 128
    cache = torch.randn(2, 64, PAGE, hkv, d, device=DEV).to(torch.bfloat16)
    slots = torch.randperm(64 * PAGE, device=DEV)[:300]
    slots[::7] = -1
    k, v = torch.randn(2, 300, hkv, d, device=DEV).to(torch.bfloat16).unbind(0)
    ref = cache.clone()
    write_kv(ref, k, v, slots)
    write_kv_triton(cache, k, v, slots)
    assert torch.equal(cache, ref)
    kf = torch.randn(300, hkv, d, device=DEV)  # fp32 into a bf16 cache: rounded like torch's .to()
    write_kv(ref, kf, kf, slots)
    write_kv_triton(cache, kf, kf, slots)
    assert (cache.float() - ref.float()).abs().max().item() <= 1e-2


def test_decode_step_cuda_graph_replay():
    """Capture store + decode once; replay with longer contexts and new block tables, no recapture."""
    hq, hkv, d = PRESETS["llama3-8b"]
    backend = TritonAttentionBackend()
    batch, width, capacity = 8, 512, 4096  # static shapes; the split workspace depends on the batch only
    q, cache0, meta = build([1] * batch, random_lens(batch, 3000, 1), hq, hkv, d)
    cache = torch.zeros(2, capacity, PAGE, hkv, d, device=DEV, dtype=torch.bfloat16)
    cache[:, : cache0.shape[1]].copy_(cache0)
    tables = torch.zeros(batch, width, dtype=torch.int32, device=DEV)
    tables[:, : meta.block_tables.shape[1]].copy_(meta.block_tables)
    meta.block_tables = tables
    k = torch.randn(batch, hkv, d, device=DEV).to(torch.bfloat16)
    v = torch.randn_like(k)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # compile + warm up outside capture
            backend.forward(q, k, v, cache, meta, d**-0.5)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(q, k, v, cache, meta, d**-0.5)

    for step, max_ctx in enumerate([200, 5000, 7000]):
        q2, cache2, meta2 = build(
            [1] * batch, random_lens(batch, max_ctx, step + 5), hq, hkv, d, seed=step + 1
        )
        assert cache2.shape[1] <= capacity and meta2.block_tables.shape[1] <= width
        cache[:, : cache2.shape[1]].copy_(cache2)
        meta.block_tables.zero_()
        meta.block_tables[:, : meta2.block_tables.shape[1]].copy_(meta2.block_tables)
        meta.seq_lens.copy_(meta2.seq_lens)
        meta.slot_mapping.copy_(meta2.slot_mapping)
        q.copy_(q2)
        k.normal_()
        v.normal_()
        graph.replay()
        write_kv(cache2, k, v, meta2.slot_mapping)
        assert rel_err(out, reference(q2, cache2, meta2)) < 1e-2


@pytest.mark.parametrize("kv", ["bf16", "fp8"])
@pytest.mark.parametrize("preset", ["llama3-8b", "qwen2.5-1.5b"])
def test_rope_kv_write_equals_rotary_then_store(preset, kv):
    """The fused rotary + K/V store (off by default until this passes): q and the cache's bytes bit for bit what
    ``rotary_qk_`` then ``write_kv_triton`` give, at real head shapes, q and k slices of one qkv tensor."""
    from rollout.kernels.fused_rotary import rotary_qk_
    from rollout.kernels.rope_kv_write import rope_write_kv
    from rollout.layers.rotary import RotaryEmbedding

    hq, hkv, d = PRESETS[preset]
    t, nb = 300, 64
    gen = torch.Generator(device=DEV).manual_seed(0)
    table = RotaryEmbedding(d, 8192, 1.0 / 500000.0 ** (torch.arange(0, d, 2, device=DEV).float() / d)).to(DEV)
    pos = torch.randint(0, 8192, (t,), device=DEV, generator=gen)
    slots = torch.randperm(nb * PAGE, device=DEV, generator=gen)[:t]
    slots[::7] = -1  # padding tokens
    qkv = torch.randn(t, (hq + 2 * hkv) * d, device=DEV, generator=gen).to(torch.bfloat16) * 4
    q, k, v = (x.view(t, -1, d) for x in qkv.split([hq * d, hkv * d, hkv * d], dim=-1))
    if kv == "fp8":
        raws = [torch.zeros(2, nb, fp8_block_bytes(PAGE, hkv, d), dtype=torch.uint8, device=DEV) for _ in range(2)]
        views = [fp8_views(r, hkv, d) for r in raws]
    else:
        raws = [torch.zeros(2, nb, PAGE, hkv, d, dtype=torch.bfloat16, device=DEV) for _ in range(2)]
        views = [(r, None) for r in raws]
    q_ref, k_ref = q.clone(), k.clone()
    rotary_qk_(q_ref, k_ref, pos, table.cos_sin_cache)
    write_kv_triton(views[0][0], k_ref, v, slots, views[0][1])
    rope_write_kv(q, k, v, pos, table.cos_sin_cache, views[1][0], slots, views[1][1])
    assert torch.equal(q, q_ref)
    assert torch.equal(raws[0], raws[1])
