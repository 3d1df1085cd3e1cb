"""Triton paged-attention kernels against the torch reference, on the CPU through Triton's interpreter.

Triton decides compile-vs-interpret when a kernel is *defined*, so every kernel check runs in one child
process started with TRITON_INTERPRET=1 (this file run as a script). The pytest process never imports
the kernels, so test order and other modules cannot flip the mode. Each pytest case asserts on the
child's verdict for one named check.

Scenarios use a shuffled block pool (non-contiguous block tables), NaN in every cache slot no
sequence owns (a kernel that reads past a mask poisons its output), seq lens off page boundaries.
bf16 attention is checked only in tests/gpu: Triton 3.9's interpreter runs tl.dot on bf16's raw
uint16 bits (and truncates fp32 -> bf16 casts), so fp32 and fp16 cover the kernels' logic here.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from rollout.layers.attention import TorchAttentionBackend, reference_attention, write_kv
from rollout.layers.attention_metadata import AttentionMetadata
from tests.interpreter import child_main, child_verdicts

SCALE = 0.3


@contextlib.contextmanager
def counted_launches(module, name: str):
    """Replace ``module.<name>`` (a Triton kernel) by a wrapper that records each launch's grid; yields the list."""
    launches, kernel = [], getattr(module, name)

    class Counted:
        def __getitem__(self, grid):
            launches.append(grid)
            return kernel[grid]

    setattr(module, name, Counted())
    try:
        yield launches
    finally:
        setattr(module, name, kernel)


def scenario(q_lens, seq_lens, hq, hkv, d, page, dtype=torch.float32, seed=0):
    """(q, kv_cache, meta) with the new tokens' K/V already in the cache."""
    gen = torch.Generator().manual_seed(seed)
    nblk = [-(-s // page) for s in seq_lens]
    num_blocks = sum(nblk) + 3
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(seq_lens), max(nblk, default=0) + 2, dtype=torch.int32)
    cache = torch.full((2, num_blocks, page, hkv, d), float("nan"), dtype=dtype)
    slots = []
    for i, (ql, sl) in enumerate(zip(q_lens, seq_lens)):
        blocks = [pool.pop() for _ in range(nblk[i])]
        tables[i, : nblk[i]] = torch.tensor(blocks, dtype=torch.int32)
        for p in range(sl):
            blk, off = blocks[p // page], p % page
            cache[:, blk, off] = torch.randn(2, hkv, d, generator=gen).to(dtype)
        slots += [blocks[p // page] * page + p % page for p in range(sl - ql, sl)]
    qsl = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    meta = AttentionMetadata(
        positions=torch.cat([torch.arange(sl - ql, sl) for ql, sl in zip(q_lens, seq_lens)]),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=qsl,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        decode_only=all(ql == 1 for ql in q_lens),
    )
    q = torch.randn(sum(q_lens), hq, d, generator=gen).to(dtype)
    return q, cache, meta


def assert_close(out, ref, tol):
    assert not out.isnan().any(), "NaN in kernel output"
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= tol, f"max abs error {err:.3g} > {tol}"


def check_decode(hq, hkv, d, page, seq_lens, window=None, splits=None, dtype=torch.float32, tol=1e-4,
                 q_dtype=None, **balance):
    """``balance``: split_target / min_chunk for the balanced partition (small values force many chunks)."""
    from rollout.kernels.paged_decode import paged_decode_attention

    q, cache, meta = scenario([1] * len(seq_lens), seq_lens, hq, hkv, d, page, dtype)
    if q_dtype is not None:
        q = q.to(q_dtype)
    ref = reference_attention(q, cache, meta, SCALE, window)
    out = paged_decode_attention(
        q, cache, meta.block_tables, meta.seq_lens, SCALE, window, num_splits=splits, **balance
    )
    assert_close(out, ref, tol)


def long_tail(n, max_len, seed):
    """RL-like lengths: log-uniform in [1, max_len], the longest always present."""
    gen = torch.Generator().manual_seed(seed)
    lens = torch.exp(torch.rand(n, generator=gen) * torch.log(torch.tensor(float(max_len)))).long().tolist()
    lens[n // 2] = max_len
    return lens


def check_decode_many_seqs_small_scan():
    """More sequences than one step of the in-kernel prefix sum (SCAN shrunk to 8)."""
    import rollout.kernels.paged_decode as pd

    old, pd.SCAN = pd.SCAN, 8
    try:
        check_decode(2, 1, 16, 8, long_tail(19, 300, 3), split_target=40, min_chunk=1)
    finally:
        pd.SCAN = old


def check_prefill(q_lens, seq_lens, hq, hkv, d, page, window=None, bm=16, bn=16, tol=1e-4):
    from rollout.kernels.paged_prefill import paged_prefill_attention

    q, cache, meta = scenario(q_lens, seq_lens, hq, hkv, d, page)
    ref = reference_attention(q, cache, meta, SCALE, window)
    out = paged_prefill_attention(
        q, cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, SCALE, meta.max_query_len,
        sliding_window=window, block_m=bm, block_n=bn,
    )  # fmt: skip
    assert_close(out, ref, tol)


def check_decode_empty_and_strided():
    """seq_len 0 (graph padding) gives zeros; q sliced from a fused qkv buffer; out written in place."""
    from rollout.kernels.paged_decode import paged_decode_attention

    q0, cache, meta = scenario([1, 1, 1], [12, 1, 40], 4, 2, 16, 8)
    meta.seq_lens[0] = 0
    qkv = torch.randn(3, 8, 16)
    qkv[:, :4] = q0
    out = torch.full((3, 2, 4, 16), 7.0)[:, 1]
    for splits, target in ((1, None), (4, None), (None, 3), (None, None)):
        res = paged_decode_attention(
            qkv[:, :4], cache, meta.block_tables, meta.seq_lens, SCALE, None, out, splits,
            split_target=target, min_chunk=1,
        )
        assert res.data_ptr() == out.data_ptr()
        assert torch.equal(out[0], torch.zeros(4, 16)), "empty sequence must give zeros"
        ref = reference_attention(q0[1:], cache, _sub(meta, 1), SCALE)
        assert_close(out[1:], ref, 1e-4)


def _sub(meta, start):
    return AttentionMetadata(
        meta.positions[start:], meta.slot_mapping[start:], meta.query_start_loc[start:] - start,
        meta.seq_lens[start:], meta.block_tables[start:], 1, meta.max_seq_len, True,
    )  # fmt: skip


def check_prefill_matches_decode():
    from rollout.kernels.paged_decode import paged_decode_attention
    from rollout.kernels.paged_prefill import paged_prefill_attention

    q, cache, meta = scenario([1] * 4, [3, 16, 17, 50], 4, 2, 32, 16)
    dec = paged_decode_attention(q, cache, meta.block_tables, meta.seq_lens, SCALE, num_splits=2)
    pre = paged_prefill_attention(q, cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, SCALE, 1)
    assert_close(dec, pre, 1e-5)


def check_kv_write():
    from rollout.kernels.kv_write import write_kv_triton

    gen = torch.Generator().manual_seed(1)
    cache = torch.randn(2, 6, 8, 3, 16, generator=gen)
    k, v = torch.randn(5, 3, 16, generator=gen), torch.randn(5, 3, 16, generator=gen)
    slots = torch.tensor([9, -1, 0, 47, 20])
    ref = cache.clone()
    write_kv(ref, k, v, slots)
    write_kv_triton(cache, k, v, slots)
    assert torch.equal(cache, ref)
    half = torch.zeros(2, 6, 8, 3, 16, dtype=torch.float16)
    write_kv_triton(half, k, v, slots)  # casts to the cache dtype
    assert torch.equal(half.view(2, -1, 3, 16)[1, 47], v[3].half())


def check_rope_kv_write():
    """Rotary fused with the K/V store: q rotated in place and the cache's bytes equal to ``rotary_qk_`` then
    ``write_kv_triton``, bit for bit, for 16-bit, float32 and fp8 caches (scales included), GQA, q and k as
    strided slices of one qkv tensor, a padding slot; k is left unrotated."""
    from rollout.kernels.fused_rotary import rotary_qk_
    from rollout.kernels.kv_write import write_kv_triton
    from rollout.kernels.rope_kv_write import rope_write_kv
    from rollout.layers.kv_quant import fp8_block_bytes, fp8_views
    from rollout.layers.rotary import RotaryEmbedding

    gen = torch.Generator().manual_seed(4)
    t, hq, hkv, d, page = 5, 4, 2, 32, 8
    table = RotaryEmbedding(d, 64, 1.0 / 10000.0 ** (torch.arange(0, d, 2).float() / d)).cos_sin_cache
    pos = torch.tensor([3, 0, 17, 63, 9])
    slots = torch.tensor([9, -1, 0, 47, 20])
    for dtype, cache_kind in ((torch.bfloat16, "same"), (torch.float16, "same"), (torch.float32, "same"),
                              (torch.bfloat16, "fp8"), (torch.float32, "fp8")):  # fmt: skip
        qkv = (torch.randn(t, (hq + 2 * hkv) * d, generator=gen) * 3).to(dtype)
        q, k, v = (x.view(t, -1, d) for x in qkv.split([hq * d, hkv * d, hkv * d], dim=-1))
        k0 = k.clone()
        if cache_kind == "fp8":
            raws = [torch.zeros(2, 7, fp8_block_bytes(page, hkv, d), dtype=torch.uint8) for _ in range(2)]
            views = [fp8_views(r, hkv, d) for r in raws]
        else:
            raws = [torch.zeros(2, 7, page, hkv, d, dtype=dtype) for _ in range(2)]
            views = [(r, None) for r in raws]
        q_ref, k_ref = q.clone(), k.clone()
        rotary_qk_(q_ref, k_ref, pos, table)
        write_kv_triton(views[0][0], k_ref, v, slots, views[0][1])
        rope_write_kv(q, k, v, pos, table, views[1][0], slots, views[1][1])
        assert torch.equal(q, q_ref), f"{dtype} {cache_kind}: q differs from rotary_qk_'s"
        assert torch.equal(raws[0], raws[1]), f"{dtype} {cache_kind}: cache bytes differ from rotary + store"
        assert torch.equal(k, k0), "k must be left as the projection wrote it"
    with pytest.raises(ValueError, match="head_dim"):
        rope_write_kv(q[..., :24], k[..., :24], v[..., :24], pos, table[:, :24], torch.zeros(2, 4, 8, 2, 24), slots)


def check_model_fused_rope():
    """Whole tiny models (llama; qwen3 with its q/k norms, which hand the kernel non-slice q and k) through the
    Triton backend, whose layers fuse rotary with the K/V store: a prefill then a decode step give the torch
    reference backend's logits (which rotates with torch ops, then stores)."""
    from rollout.layers.triton_backend import TritonAttentionBackend
    from rollout.models import get_model_class
    from rollout.models.loader import load_named_tensors
    from tests.tiny_models import make_kv_caches, make_metadata, make_tiny_hf_model

    assert not TorchAttentionBackend.fuses_rope
    assert TritonAttentionBackend.fuses_rope  # on by default: the Triton layers take the fused path
    for family in ("llama", "qwen3"):
        hf = make_tiny_hf_model(family)
        model = get_model_class(hf.config)(hf.config)
        load_named_tensors(model, hf.named_parameters())
        model.eval()
        gen = torch.Generator().manual_seed(5)
        seqs = [torch.randint(0, hf.config.vocab_size, (n,), generator=gen).tolist() for n in (11, 6)]
        outs = []
        # One split per sequence: the decode kernel's partitions have their own checks (backend_decode and the
        # decode_* ones); with the balanced default, idle programs took most of this check's interpreter time.
        for backend in (TritonAttentionBackend(decode_num_splits=1), TorchAttentionBackend()):
            kv = make_kv_caches(model, 8, 8)
            logits = []
            for specs, take in (([(0, 11), (0, 6)], [seqs[0], seqs[1]]), ([(11, 1), (6, 1)], [[7], [9]])):
                meta = make_metadata(specs, 8, 8)
                ids = torch.tensor([t for chunk in take for t in chunk])
                with torch.no_grad():
                    logits.append(model.compute_logits(model(ids, meta.positions, kv, meta, backend)))
            outs.append(torch.cat(logits))
        assert_close(outs[0], outs[1], 1e-4)


def check_backend(q_lens, seq_lens, window=None):
    """Whole forward (K/V store + attention) equals the torch backend's, cache included."""
    from rollout.layers.triton_backend import TritonAttentionBackend

    q, cache, meta = scenario(q_lens, seq_lens, 4, 2, 16, 8)
    gen = torch.Generator().manual_seed(2)
    k, v = torch.randn(q.shape[0], 2, 16, generator=gen), torch.randn(q.shape[0], 2, 16, generator=gen)
    flat = cache.view(2, -1, 2, 16)
    flat[:, meta.slot_mapping] = float("nan")  # the backend must fill these itself
    ref_cache = cache.clone()
    ref = TorchAttentionBackend().forward(q, k, v, ref_cache, meta, SCALE, window)
    backend = TritonAttentionBackend()
    assert backend.name == "triton"
    out = backend.forward(q, k, v, cache, meta, SCALE, window)
    assert torch.equal(cache.isnan(), ref_cache.isnan())
    assert torch.equal(cache.nan_to_num(), ref_cache.nan_to_num())
    assert_close(out, ref, 1e-4)


def check_prefill_skip_single():
    """skip_single leaves one-token sequences' rows untouched; every other row still equals the reference."""
    from rollout.kernels.paged_prefill import paged_prefill_attention

    q_lens, seq_lens = [1, 17, 1, 5], [9, 17, 40, 70]
    q, cache, meta = scenario(q_lens, seq_lens, 4, 2, 32, 16)
    ref = reference_attention(q, cache, meta, SCALE)
    out = torch.full_like(q, 7.0)
    paged_prefill_attention(q, cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, SCALE,
                            meta.max_query_len, out=out, block_m=16, block_n=16, skip_single=True)
    single = torch.tensor([0, 18])  # token rows of the two one-token sequences
    assert bool((out[single] == 7.0).all()), "skip_single wrote a one-token sequence's row"
    rest = torch.ones(q.shape[0], dtype=torch.bool)
    rest[single] = False
    assert_close(out[rest], ref[rest], 1e-4)


def check_backend_mixed_decode_rows(window=None):
    """A mixed step whose one-token sequences go to the decode kernel (meta.decode_rows) equals the torch
    backend's whole forward."""
    from rollout.layers.attention_metadata import DecodeRows
    from rollout.layers.triton_backend import TritonAttentionBackend

    q_lens, seq_lens = [1, 20, 1, 1, 3, 1], [10, 20, 33, 90, 50, 1]
    q, cache, meta = scenario(q_lens, seq_lens, 4, 2, 16, 8)
    gen = torch.Generator().manual_seed(2)
    k, v = torch.randn(q.shape[0], 2, 16, generator=gen), torch.randn(q.shape[0], 2, 16, generator=gen)
    ref_cache = cache.clone()
    ref = TorchAttentionBackend().forward(q, k, v, ref_cache, meta, SCALE, window)
    seqs = [i for i, n in enumerate(q_lens) if n == 1]
    idx = torch.tensor(seqs)
    meta.decode_rows = DecodeRows(meta.query_start_loc[idx].long(), meta.block_tables[idx], meta.seq_lens[idx])
    backend = TritonAttentionBackend()
    assert backend.uses_decode_rows
    calls, decode = [], backend._decode
    backend._decode = lambda *a, **kw: (calls.append(a[0].shape[0]), decode(*a, **kw))[1]
    out = backend.forward(q, k, v, cache, meta, SCALE, window)
    assert calls == [len(seqs)], calls  # the one-token sequences went through the decode kernel, once
    assert torch.equal(cache.nan_to_num(), ref_cache.nan_to_num())
    assert_close(out, ref, 1e-4)


def plan_entries(plans: dict) -> dict:
    """A plans dict's plans, without the fused merge's counters (``("counters", batch, kv heads)``) kept beside them."""
    return {k: v for k, v in plans.items() if k[0] != "counters"}


def check_decode_planned():
    """A step's plan (``plans``): made by the first call, reused by a second with the same tile and window (the
    plan kernel runs once), a new one for another window or another lengths tensor; every output is exact."""
    import rollout.kernels.paged_decode as pd

    lens = long_tail(12, 1000, 1)
    q, cache, meta = scenario([1] * len(lens), lens, 4, 2, 16, 16)
    with counted_launches(pd, "_decode_plan_kernel") as launches:
        plans: dict = {}
        kw = dict(split_target=12, min_chunk=1, plans=plans)
        for window in (None, None, 150):
            out = pd.paged_decode_attention(q, cache, meta.block_tables, meta.seq_lens, SCALE, window, **kw)
            assert_close(out, reference_attention(q, cache, meta, SCALE, window), 1e-4)
        assert len(launches) == 2 and len(plan_entries(plans)) == 2, (launches, list(plans))  # one per window
        other = meta.seq_lens.flip(0).contiguous()  # same dict, other lengths: planned anew, not stale
        meta.seq_lens, meta.block_tables = other, meta.block_tables.flip(0).contiguous()
        out = pd.paged_decode_attention(q, cache, meta.block_tables, meta.seq_lens, SCALE, **kw)
        assert_close(out, reference_attention(q, cache, meta, SCALE), 1e-4)
        assert len(launches) == 3


def check_decode_waves_uniform_lengths():
    """With several waves in the target, even lengths are cut for one wave (fewer, longer chunks: here none
    split) and uneven ones for all the waves; the outputs equal the reference either way."""
    import rollout.kernels.paged_decode as pd

    for lens, split in (([300] * 6 + [280, 310], False), (long_tail(8, 1000, 5), True)):
        q, cache, meta = scenario([1] * len(lens), lens, 4, 2, 16, 16)
        plans: dict = {}
        out = pd.paged_decode_attention(q, cache, meta.block_tables, meta.seq_lens, SCALE, split_target=16,
                                        min_chunk=1, waves=4, plans=plans)  # fmt: skip
        assert_close(out, reference_attention(q, cache, meta, SCALE), 1e-4)
        (_, seq_info), = plan_entries(plans).values()
        assert bool((seq_info[:, 1] > 1).any()) == split, (lens, seq_info[:, 1].tolist())
        one_wave = pd.paged_decode_attention(q, cache, meta.block_tables, meta.seq_lens, SCALE, split_target=16,
                                             min_chunk=1, waves=1, plans={})  # fmt: skip
        assert_close(one_wave, out, 1e-5)
    with pytest.raises(ValueError, match="waves"):
        pd.paged_decode_attention(q, cache, meta.block_tables, meta.seq_lens, SCALE, waves=0)


def check_decode_default_fused_merge():
    """By default a split decode merges in its last chunk (FUSED_MERGE, on since W1 ran 0.906 of the floor with it
    against 0.899 without on the H100): planned or fixed, no reduce kernel is launched, and the output is exact."""
    import rollout.kernels.paged_decode as pd

    lens = long_tail(10, 800, 9)
    q, cache, meta = scenario([1] * len(lens), lens, 4, 2, 16, 16)
    with counted_launches(pd, "_decode_reduce_kernel") as launches:
        for kw in (dict(split_target=12, min_chunk=1, plans={}), dict(num_splits=4)):
            out = pd.paged_decode_attention(q, cache, meta.block_tables, meta.seq_lens, SCALE, **kw)
            assert_close(out, reference_attention(q, cache, meta, SCALE), 1e-4)
    assert launches == [], launches


def check_decode_planned_fused_merge():
    """Planned and fused: the merge counters are zeroed once per plans dict and left at zero by every call, so
    three layers in a row (one with a window) all merge right."""
    import rollout.kernels.paged_decode as pd

    lens = long_tail(10, 800, 9)
    q, cache, meta = scenario([1] * len(lens), lens, 4, 2, 16, 16)
    plans: dict = {}
    for window in (None, 200, None):
        out = pd.paged_decode_attention(q, cache, meta.block_tables, meta.seq_lens, SCALE, window, split_target=12,
                                        min_chunk=1, fused_merge=True, plans=plans)  # fmt: skip
        assert_close(out, reference_attention(q, cache, meta, SCALE, window), 1e-4)
        counters = [v for k, v in plans.items() if k[0] == "counters"]
        assert len(counters) == 1 and not counters[0].any(), counters


def check_backend_decode_plans():
    """The backend plans a decode step once: two layers' forwards on one step's metadata share one plan."""
    from rollout.layers.triton_backend import TritonAttentionBackend

    q, cache, meta = scenario([1, 1, 1, 1], [4, 170, 33, 900], 4, 2, 16, 8)
    gen = torch.Generator().manual_seed(2)
    k, v = torch.randn(q.shape[0], 2, 16, generator=gen), torch.randn(q.shape[0], 2, 16, generator=gen)
    ref_cache = cache.clone()
    ref = TorchAttentionBackend().forward(q, k, v, ref_cache, meta, SCALE)
    backend = TritonAttentionBackend()
    meta.decode_plans = {}  # as the runners' fresh per-forward metadata
    for _ in range(2):
        out = backend.forward(q, k, v, cache, meta, SCALE)
        assert_close(out, ref, 1e-4)
    assert len(plan_entries(meta.decode_plans)) == 1, list(meta.decode_plans)


def check_backend_reused_metadata_replans():
    """Metadata reused across steps with its lengths updated in place (as a CUDA-graph caller does between
    warm-up, capture and replays) gets no stale partition: by default nothing is kept between calls."""
    from rollout.layers.triton_backend import TritonAttentionBackend

    q, cache, meta = scenario([1, 1, 1, 1], [4, 170, 33, 900], 4, 2, 16, 8)
    backend = TritonAttentionBackend()
    assert meta.decode_plans is None
    for lens in ([4, 170, 33, 900], [900, 4, 170, 33]):  # same blocks in all, other order: other partition
        meta.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        q2, cache2, meta2 = scenario([1, 1, 1, 1], lens, 4, 2, 16, 8)
        cache.copy_(cache2)
        meta.block_tables.copy_(meta2.block_tables)
        meta.slot_mapping.copy_(meta2.slot_mapping)
        k, v = cache2[0].view(-1, 2, 16)[meta2.slot_mapping], cache2[1].view(-1, 2, 16)[meta2.slot_mapping]
        out = backend.forward(q2, k, v, cache, meta, SCALE)
        assert_close(out, reference_attention(q2, cache2, meta2, SCALE), 1e-4)


def check_runner_metadata_plans():
    """The runners' metadata (make_metadata, mixed_decode_rows) opts in with a fresh dict per forward."""
    from rollout.engine.runners.base import make_metadata

    q, cache, meta = scenario([1, 1], [4, 9], 4, 2, 16, 8)
    fields = {"positions": meta.positions, "slot_mapping": meta.slot_mapping,
              "query_start_loc": meta.query_start_loc, "seq_lens": meta.seq_lens}
    made = [make_metadata(lambda name, dt: fields[name], meta.block_tables, 1, 9, True) for _ in range(2)]
    assert made[0].decode_plans == {} and made[0].decode_plans is not made[1].decode_plans


def check_decode_even_lengths_fixed_split():
    """``even_lengths`` takes ``choose_num_splits``'s fixed count for the batch (bit for bit the fixed-split call,
    no plan made); off by EVEN_FIXED_SPLIT, the balanced partition; the backend passes the metadata's flag."""
    import rollout.kernels.paged_decode as pd
    from rollout.layers.triton_backend import TritonAttentionBackend

    lens = [600, 560, 620, 590]  # ~10 tiles of 64: two chunks of EVEN_MIN_CHUNK_TILES
    q, cache, meta = scenario([1] * len(lens), lens, 4, 2, 16, 16)
    block_n = pd.decode_config(16, 16, cache.dtype)[0]
    fixed, floor = pd.even_num_splits(4, 2, -(-meta.block_tables.shape[1] * 16 // block_n), pd.num_sms(q.device),
                                      pd.PROGRAMS_PER_SM)
    assert fixed > 1  # the check below must tell a split run from an unsplit one
    want = pd.paged_decode_attention(q, cache, meta.block_tables, meta.seq_lens, SCALE, num_splits=fixed,
                                     fixed_min_chunk=pd.EVEN_MIN_CHUNK_TILES, fixed_min_splits=floor)
    plans: dict = {}
    out = pd.paged_decode_attention(q, cache, meta.block_tables, meta.seq_lens, SCALE, plans=plans, even_lengths=True)
    assert torch.equal(out, want) and not plan_entries(plans), "even lengths must take the fixed split, unplanned"
    assert_close(out, reference_attention(q, cache, meta, SCALE), 1e-4)
    old, pd.EVEN_FIXED_SPLIT = pd.EVEN_FIXED_SPLIT, False
    try:
        pd.paged_decode_attention(q, cache, meta.block_tables, meta.seq_lens, SCALE, plans=plans, even_lengths=True)
        assert len(plan_entries(plans)) == 1, "with the switch off the balanced partition plans"
    finally:
        pd.EVEN_FIXED_SPLIT = old
    old, pd.EVEN_MIN_ROWS = pd.EVEN_MIN_ROWS, 4 * 2 + 1  # one row more than this step's (sequence, kv head) rows
    try:
        small: dict = {}
        pd.paged_decode_attention(q, cache, meta.block_tables, meta.seq_lens, SCALE, plans=small, even_lengths=True)
        assert len(plan_entries(small)) == 1, "under EVEN_MIN_ROWS even lengths take the balanced partition"
    finally:
        pd.EVEN_MIN_ROWS = old
    seen = []
    backend = TritonAttentionBackend()
    backend._decode = lambda *a, **kw: seen.append(kw["even_lengths"]) or torch.zeros_like(a[0])
    gen = torch.Generator().manual_seed(3)
    k, v = torch.randn(4, 2, 16, generator=gen), torch.randn(4, 2, 16, generator=gen)
    for flag in (False, True):
        meta.decode_even_lengths = flag
        backend.forward(q, k, v, cache.clone(), meta, SCALE)
    assert seen == [False, True], seen


def check_decode_uniform_one_wave():
    """Uniform lengths (``even_lengths=2``) with UNIFORM_ONE_WAVE take one wave's count and no minimum chunk (bit
    for bit that fixed-split call); with it off, the even rule; the backend reports the knob as ``uniform_split``."""
    import rollout.kernels.paged_decode as pd
    from rollout.engine.runners.graphs import UNIFORM, split_kind
    from rollout.layers.triton_backend import TritonAttentionBackend

    lens = [600, 560, 620, 590]
    assert split_kind(lens, uniform=True) == UNIFORM
    q, cache, meta = scenario([1] * len(lens), lens, 4, 2, 16, 16)
    block_n = pd.decode_config(16, 16, cache.dtype)[0]
    tiles, sms = -(-meta.block_tables.shape[1] * 16 // block_n), pd.num_sms(q.device)
    one_wave = pd.choose_num_splits(4, 2, tiles, sms, pd.PROGRAMS_PER_SM)
    args = (q, cache, meta.block_tables, meta.seq_lens, SCALE)
    old = pd.UNIFORM_ONE_WAVE, pd.EVEN_MIN_CHUNK_TILES
    pd.EVEN_MIN_CHUNK_TILES = 1  # the even rule then cuts more chunks than one wave: the check tells them apart
    try:
        even_n, floor = pd.even_num_splits(4, 2, tiles, sms, pd.PROGRAMS_PER_SM)
        assert even_n > one_wave, (even_n, one_wave)
        even = pd.paged_decode_attention(*args, num_splits=even_n, fixed_min_chunk=1, fixed_min_splits=floor)
        wave = pd.paged_decode_attention(*args, num_splits=one_wave, fixed_min_chunk=0)
        assert not torch.equal(even, wave)
        pd.UNIFORM_ONE_WAVE = False
        assert not TritonAttentionBackend().uniform_split
        off = pd.paged_decode_attention(*args, plans={}, even_lengths=UNIFORM)
        pd.UNIFORM_ONE_WAVE = True
        assert TritonAttentionBackend().uniform_split
        on = pd.paged_decode_attention(*args, plans={}, even_lengths=UNIFORM)
        evens = pd.paged_decode_attention(*args, plans={}, even_lengths=True)
    finally:
        pd.UNIFORM_ONE_WAVE, pd.EVEN_MIN_CHUNK_TILES = old
    assert torch.equal(off, even), "with UNIFORM_ONE_WAVE off a uniform step takes the even rule"
    assert torch.equal(on, wave), "a uniform step takes one wave's count with no minimum chunk"
    assert torch.equal(evens, even), "even (not uniform) steps keep the even rule"
    assert_close(on, reference_attention(q, cache, meta, SCALE), 1e-4)


def check_num_splits():
    from rollout.kernels.paged_decode import choose_num_splits

    # one wave (the legacy split)
    assert choose_num_splits(256, 8, 256, 132) == 1  # batch alone fills the GPU
    assert choose_num_splits(64, 8, 256, 132) == 1  # 512 programs: one wave of 4 per SM already
    assert choose_num_splits(32, 8, 256, 132) == 2  # 512 programs, not 768 (a wave and a half)
    assert choose_num_splits(8, 8, 256, 132) == 8
    assert choose_num_splits(1, 8, 256, 132) == 66
    assert choose_num_splits(1, 8, 3, 132) == 3  # never more splits than tiles
    assert choose_num_splits(1, 1, 10_000, 132) == 128  # capped
    # fp8's kernel holds 6 programs per SM: W2's shapes (qwen2.5-1.5b, 2 kv heads, H200's 132 SMs)
    assert [choose_num_splits(b, 2, 256, 132, per_sm=6) for b in (32, 128, 256)] == [12, 3, 1]
    assert [choose_num_splits(b, 2, 256, 132, waves=6) for b in (128, 200, 256)] == [12, 7, 6]  # 6 waves
    assert choose_num_splits(256, 2, 5, 132, waves=6) == 5  # the tiles still cap it


def check_even_num_splits():
    """The even path: EVEN_WAVES (6) waves' count capped at EVEN_MAX_SPLITS (8) and at the longest context's
    EVEN_MIN_CHUNK_TILES-tile chunks, never under one wave's, which is also the floor of a short sequence's chunks."""
    import rollout.kernels.paged_decode as pd

    assert (pd.EVEN_WAVES, pd.EVEN_MAX_SPLITS) == (6, 8)
    bf16 = [pd.even_num_splits(b, 2, 256, 132, 4) for b in (32, 128, 200, 256)]  # W2's shapes
    assert bf16 == [(8, 8), (8, 2), (7, 1), (6, 1)], bf16
    fp8 = [pd.even_num_splits(b, 2, 256, 132, 6) for b in (16, 32, 128, 256)]
    assert fp8 == [(24, 24), (12, 12), (8, 3), (8, 1)], fp8
    assert pd.even_num_splits(256, 8, 256, 132, 4) == (1, 1)  # W3 (qwen3-0.6b, 8 kv heads): one wave already
    assert pd.even_num_splits(32, 8, 256, 132, 4) == (8, 2)  # llama3-8b at 16K: never under one wave's 2
    # W1-short's max_model_len of 1,168 (18 tiles of 64) holds 2 chunks of 8 tiles: one wave's count, as legacy
    assert pd.even_num_splits(32, 8, 18, 132, 4) == (2, 2)
    assert pd.even_num_splits(128, 2, 40, 132, 6) == (5, 3)  # 40 tiles: at most 5 chunks of 8


def check_decode_fixed_min_chunk():
    """A fixed split with ``fixed_min_chunk``: a short sequence takes fewer chunks (one: written directly), a
    long one all of them; the fused merge counts a sequence's own chunks."""
    lens = [2, 1, 40, 100, 300, 700, 65]
    check_decode(4, 2, 16, 16, lens, splits=8, fixed_min_chunk=2, fused_merge=True)
    check_decode(4, 2, 16, 8, lens, splits=5, fixed_min_chunk=3, fixed_min_splits=2, window=150)


def check_split_target():
    from rollout.kernels.paged_decode import choose_split_target

    assert choose_split_target(2, 132) == 4 * 4 * 132 // 2  # qwen2.5-1.5b on the H200: 1056 chunks per kv head
    assert choose_split_target(8, 132) == 264
    assert choose_split_target(64, 1) == 1


def check_errors():
    from rollout.kernels.paged_decode import paged_decode_attention

    q, cache, meta = scenario([1, 1], [5, 9], 4, 2, 16, 8)
    args = (meta.block_tables, meta.seq_lens, SCALE)
    bad = [
        (TypeError, lambda: paged_decode_attention(q.to(torch.int32), cache, *args)),
        (ValueError, lambda: paged_decode_attention(q[:, :3], cache, *args)),  # 3 heads vs 2 kv heads
        (ValueError, lambda: paged_decode_attention(q, cache, *args, sliding_window=0)),
        (ValueError, lambda: paged_decode_attention(q[:1], cache, *args)),
        (TypeError, lambda: paged_decode_attention(q, cache, meta.block_tables.long(), *args[1:])),
    ]
    for exc, call in bad:
        with pytest.raises(exc):
            call()


CHECKS = {
    "decode_g2_heuristic_splits": lambda: check_decode(4, 2, 32, 16, [1, 7, 16, 33, 100]),
    "decode_g2_3_splits": lambda: check_decode(4, 2, 32, 16, [1, 7, 16, 33, 100], splits=3),
    "decode_g1_page8_1_split": lambda: check_decode(2, 2, 16, 8, [5, 8, 9, 64, 77], splits=1),
    "decode_g1_page8_5_splits": lambda: check_decode(2, 2, 16, 8, [5, 8, 9, 64, 77], splits=5),
    "decode_g6": lambda: check_decode(6, 1, 16, 8, [3, 70], splits=2),
    "decode_window": lambda: check_decode(4, 2, 16, 8, [1, 19, 20, 21, 90], window=20, splits=2),
    "decode_window_1_split": lambda: check_decode(4, 2, 16, 16, [1, 19, 20, 21, 90], window=20, splits=1),
    "decode_fp16": lambda: check_decode(4, 2, 32, 16, [7, 60], dtype=torch.float16, splits=2, tol=1e-2),
    "decode_fp32_q_fp16_cache": lambda: check_decode(4, 2, 32, 16, [7, 300], dtype=torch.float16,
                                                     q_dtype=torch.float32, split_target=4, min_chunk=1),
    "decode_balanced_long_tail": lambda: check_decode(4, 2, 16, 16, long_tail(12, 1000, 1), split_target=12,
                                                      min_chunk=1),
    "decode_balanced_default_long_context": lambda: check_decode(4, 2, 16, 16, [5000, 3, 700]),
    "decode_balanced_window": lambda: check_decode(4, 2, 16, 8, [1, 19, 20, 21, 900], window=150,
                                                   split_target=16, min_chunk=1),
    "decode_balanced_gqa6": lambda: check_decode(12, 2, 16, 16, long_tail(9, 1500, 2), split_target=12),
    "decode_balanced_gqa8_one_kv_head": lambda: check_decode(8, 1, 16, 8, long_tail(7, 1200, 4),
                                                             split_target=10, min_chunk=1),
    "decode_swap_ab_long_tail": lambda: check_decode(4, 2, 16, 16, long_tail(12, 1000, 1), split_target=12,
                                                     min_chunk=1, swap_ab=True),
    "decode_swap_ab_gqa6_window": lambda: check_decode(12, 2, 16, 8, [1, 19, 20, 21, 300], window=50, splits=2,
                                                       swap_ab=True),
    "decode_swap_ab_gqa16_fp16": lambda: check_decode(16, 1, 32, 16, [7, 60], dtype=torch.float16, splits=1,
                                                      tol=1e-2, swap_ab=True),
    "decode_one_head": lambda: check_decode(1, 1, 16, 8, [1, 300, 64], split_target=5, min_chunk=1),
    "decode_fused_merge_long_tail": lambda: check_decode(4, 2, 16, 16, long_tail(12, 1000, 1), split_target=12,
                                                         min_chunk=1, fused_merge=True),
    "decode_fused_merge_fixed_splits_gqa6": lambda: check_decode(12, 2, 16, 8, [1, 40, 300], splits=5,
                                                                 fused_merge=True),
    "decode_fused_merge_window": lambda: check_decode(4, 2, 16, 8, [1, 19, 20, 21, 900], window=150,
                                                      split_target=6, min_chunk=1, fused_merge=True),
    "decode_many_seqs_small_scan": check_decode_many_seqs_small_scan,
    "decode_planned": check_decode_planned,
    "decode_waves_uniform_lengths": check_decode_waves_uniform_lengths,
    "decode_planned_fused_merge": check_decode_planned_fused_merge,
    "decode_default_fused_merge": check_decode_default_fused_merge,
    "backend_decode_plans": check_backend_decode_plans,
    "backend_reused_metadata_replans": check_backend_reused_metadata_replans,
    "runner_metadata_plans": check_runner_metadata_plans,
    "decode_empty_seq_strided_q_out": check_decode_empty_and_strided,
    "prefill_mixed_cached_prefix": lambda: check_prefill(
        [1, 17, 5, 40, 3], [9, 17, 70, 100, 3], 4, 2, 32, 16
    ),
    "prefill_mixed_64_tiles": lambda: check_prefill([1, 17, 40], [9, 17, 100], 4, 2, 32, 16, bm=64, bn=64),
    "prefill_g1_page8": lambda: check_prefill([8, 9, 1], [8, 30, 77], 2, 2, 16, 8, bn=32),
    "prefill_window": lambda: check_prefill([1, 30, 45], [40, 30, 90], 4, 2, 16, 8, window=7),
    "prefill_window_wide": lambda: check_prefill([20, 45], [20, 90], 4, 2, 16, 8, window=33, bm=32),
    "prefill_equals_decode": check_prefill_matches_decode,
    "kv_write": check_kv_write,
    "backend_decode": lambda: check_backend([1, 1, 1], [4, 17, 33]),
    "backend_prefill_window": lambda: check_backend([3, 1, 20], [10, 17, 20], window=9),
    "prefill_skip_single": check_prefill_skip_single,
    "backend_mixed_decode_rows": check_backend_mixed_decode_rows,
    "backend_mixed_decode_rows_window": lambda: check_backend_mixed_decode_rows(window=9),
    "num_splits_heuristic": check_num_splits,
    "decode_even_lengths_fixed_split": check_decode_even_lengths_fixed_split,
    "decode_uniform_one_wave": check_decode_uniform_one_wave,
    "decode_fixed_min_chunk": check_decode_fixed_min_chunk,
    "even_num_splits": check_even_num_splits,
    "rope_kv_write": check_rope_kv_write,
    "model_fused_rope": check_model_fused_rope,
    "split_target": check_split_target,
    "argument_errors": check_errors,
}


@pytest.fixture(scope="module")
def verdicts() -> dict[str, str]:
    return child_verdicts(__file__)


@pytest.mark.parametrize("name", list(CHECKS))
def test_kernel(verdicts: dict[str, str], name: str) -> None:
    assert verdicts[name] == "ok", verdicts[name]


if __name__ == "__main__":
    child_main(CHECKS)
