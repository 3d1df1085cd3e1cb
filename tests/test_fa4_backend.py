"""The FA4-prefill backend's dispatch and arguments, on the CPU (issue 23.7; the kernels themselves: tests/gpu).

``flash_attn.cute`` is a fake that checks FA4 4.0.0b36's documented contract (``_flash_attn_fwd``'s asserts:
int32 contiguous lengths and page table, k/v ``[num_pages, page_size, Hkv, D]``, one fp16/bf16 dtype) and
computes what FA4 computes from those arguments -- bottom-right causal over ``seqused_k`` keys through the page
table, ``seqused_q`` rows per sequence from ``cu_seqlens_q``, the window ``(left, 0)`` -- leaving every row it is
not asked for NaN. The Triton kernel modules are fakes too (torch reference, calls recorded; the pytest process
never imports the real ones, tests/interpreter.py), so each test checks which phase went where and that the
combined output is the reference's.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from rollout.config import EngineConfig
from rollout.layers import backends
from rollout.layers.attention import reference_attention, write_kv
from rollout.layers.attention_metadata import AttentionMetadata, DecodeRows
from rollout.layers.backends import AttentionSpec, resolve_attention
from rollout.layers.kv_quant import fp8_block_bytes
from tests.tiny_models import make_metadata

HQ, HKV, D, PAGE, NB = 6, 2, 16, 16, 48
SCALE = D**-0.5
CUDA = torch.device("cuda")


def _meta_for(query_start_loc, seq_lens, block_tables) -> AttentionMetadata:
    n = int(query_start_loc[-1])
    qlens = torch.diff(query_start_loc).tolist()
    return AttentionMetadata(
        positions=torch.zeros(n, dtype=torch.int64), slot_mapping=torch.full((n,), -1, dtype=torch.int64),
        query_start_loc=query_start_loc, seq_lens=seq_lens, block_tables=block_tables,
        max_query_len=max(qlens), max_seq_len=int(seq_lens.max()), decode_only=all(x == 1 for x in qlens))


def fake_fa4_varlen(calls: list):
    def flash_attn_varlen_func(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                               max_seqlen_k=None, min_seqlen_k=None, seqused_q=None, seqused_k=None,
                               gather_kv_indices=None, page_table=None, softmax_scale=None, causal=False,
                               window_size=(None, None), **rest):
        calls.append(("fa4", dict(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                  max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, seqused_q=seqused_q,
                                  seqused_k=seqused_k, page_table=page_table, softmax_scale=softmax_scale,
                                  causal=causal, window_size=window_size, rest=rest)))
        # _flash_attn_fwd's contract
        assert qv is None and cu_seqlens_k is None and page_table is not None
        assert page_table.dtype == torch.int32 and page_table.stride(-1) == 1
        b = cu_seqlens_q.shape[0] - 1
        assert page_table.shape[0] == b
        num_pages, page_size = v.shape[:2]
        assert k.shape == (num_pages, page_size, v.shape[2], q.shape[2]) and v.shape == k.shape
        assert q.dtype == k.dtype == v.dtype and q.dtype in (torch.float16, torch.bfloat16)
        for t in (cu_seqlens_q, seqused_q, seqused_k):
            assert t is None or (t.dtype == torch.int32 and t.stride(0) == 1)
        assert seqused_k is not None and seqused_k.shape == (b,)
        assert seqused_q is None or seqused_q.shape == (b,)
        assert q.shape[1] % v.shape[2] == 0
        # what the kernel computes (causal: right = 0; the mask is bottom-right aligned)
        left, right = window_size
        if causal:
            right = 0
        out = torch.full_like(q, float("nan"))
        rep = q.shape[1] // v.shape[2]
        for i in range(b):
            start = int(cu_seqlens_q[i])
            lq = int(seqused_q[i]) if seqused_q is not None else int(cu_seqlens_q[i + 1]) - start
            lk = int(seqused_k[i])
            if lq == 0:
                continue
            pages = page_table[i, : -(-lk // page_size)].long()
            ki, vi = (x[pages].flatten(0, 1)[:lk].float().repeat_interleave(rep, 1).transpose(0, 1) for x in (k, v))
            qi = q[start : start + lq].float().transpose(0, 1)
            row = torch.arange(lq)[:, None] + lk - lq
            col = torch.arange(lk)[None, :]
            mask = torch.ones(lq, lk, dtype=torch.bool)
            if right is not None:
                mask &= col <= row + right
            if left is not None:
                mask &= col >= row - left
            o = torch.nn.functional.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=softmax_scale)
            out[start : start + lq] = o.transpose(0, 1).to(q.dtype)
        return out, None

    return flash_attn_varlen_func


@pytest.fixture
def calls(monkeypatch) -> list:
    """Fake ``flash_attn.cute`` and Triton kernel modules; the list of (phase, details) they were called with."""
    calls: list = []
    fa = types.ModuleType("flash_attn")
    fa.__path__ = []
    cute = types.ModuleType("flash_attn.cute")
    cute.flash_attn_varlen_func = fake_fa4_varlen(calls)
    kv_write = types.ModuleType("rollout.kernels.kv_write")
    kv_write.write_kv_triton = lambda cache, k, v, slots, scales=None: write_kv(cache, k, v, slots, scales)

    decode = types.ModuleType("rollout.kernels.paged_decode")

    def paged_decode_attention(q, kv_cache, block_tables, seq_lens, scale, sliding_window=None, num_splits=None,
                               kv_scales=None, plans=None, even_lengths=False):
        calls.append(("decode", q.shape[0]))
        qsl = torch.arange(q.shape[0] + 1, dtype=torch.int32)
        return reference_attention(q, kv_cache, _meta_for(qsl, seq_lens, block_tables), scale, sliding_window,
                                   kv_scales)

    decode.paged_decode_attention = paged_decode_attention
    prefill = types.ModuleType("rollout.kernels.paged_prefill")

    def paged_prefill_attention(q, kv_cache, query_start_loc, seq_lens, block_tables, scale, max_query_len,
                                sliding_window=None, kv_scales=None, skip_single=False):
        calls.append(("triton_prefill", skip_single))
        out = reference_attention(q, kv_cache, _meta_for(query_start_loc, seq_lens, block_tables), scale,
                                  sliding_window, kv_scales)
        if skip_single:
            for i, n in enumerate(torch.diff(query_start_loc).tolist()):
                if n == 1:
                    out[int(query_start_loc[i])] = float("nan")
        return out

    prefill.paged_prefill_attention = paged_prefill_attention
    for name, mod in {"flash_attn": fa, "flash_attn.cute": cute, "rollout.kernels.kv_write": kv_write,
                      "rollout.kernels.paged_decode": decode, "rollout.kernels.paged_prefill": prefill}.items():
        monkeypatch.setitem(sys.modules, name, mod)
    return calls


def _backend():
    return AttentionSpec("fa4", PAGE, "auto").build()


# (cached context, new tokens): a fresh prompt, decodes, a chunk after a cached prefix, a 1-token prompt tail
SPECS = [(0, 37), (20, 1), (100, 19), (5, 1), (64, 1), (3, 2)]


def _step(specs, dtype=torch.bfloat16, decode_rows=True, fp8=False, seed=0):
    """(q, k, v, cache, meta): new tokens' K/V not yet in the cache, the cached prefixes already there."""
    gen = torch.Generator().manual_seed(seed)
    meta = make_metadata(specs, block_size=PAGE, num_blocks=NB)
    t = int(meta.query_start_loc[-1])
    q, k, v = (torch.randn(t, h, D, generator=gen).to(dtype) for h in (HQ, HKV, HKV))
    if fp8:
        cache = torch.zeros(2, NB, fp8_block_bytes(PAGE, HKV, D), dtype=torch.uint8)
    else:
        cache = torch.randn(2, NB, PAGE, HKV, D, generator=gen).to(dtype)
    if decode_rows:
        seqs = [i for i, (_, n) in enumerate(specs) if n == 1]
        idx = torch.tensor(seqs)
        meta.decode_rows = DecodeRows(meta.query_start_loc[idx].long(), meta.block_tables[idx], meta.seq_lens[idx])
    return q, k, v, cache, meta


def _reference(q, k, v, cache, meta, window=None):
    ref_cache = cache.clone()
    from rollout.layers.attention import TorchAttentionBackend

    return TorchAttentionBackend().forward(q, k, v, ref_cache, meta, SCALE, window)


def _close(out, ref):
    assert torch.isfinite(out.float()).all(), "a row no kernel wrote"
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


def test_mixed_step_prefill_rows_to_fa4_decode_rows_to_triton(calls):
    q, k, v, cache, meta = _step(SPECS)
    ref = _reference(q, k, v, cache, meta)
    out = _backend().forward(q, k, v, cache, meta, SCALE)
    _close(out, ref)
    assert [c[0] for c in calls] == ["fa4", "decode"]  # no Triton prefill; decode kernel once for the rows
    assert calls[1][1] == 3
    a = calls[0][1]
    assert a["q"] is q
    assert a["k"].shape == (NB, PAGE, HKV, D) and a["k"].data_ptr() == cache[0].data_ptr()
    assert a["v"].data_ptr() == cache[1].data_ptr()
    assert a["cu_seqlens_q"] is meta.query_start_loc and a["seqused_k"] is meta.seq_lens
    assert a["page_table"] is meta.block_tables
    assert a["seqused_q"].tolist() == [37, 0, 19, 0, 0, 2]  # one-token sequences zeroed: the decode kernel's
    assert a["seqused_q"].dtype == torch.int32
    assert (a["max_seqlen_q"], a["max_seqlen_k"]) == (37, 119)
    assert a["causal"] is True and a["softmax_scale"] == SCALE and a["window_size"] == (None, None)
    assert a["cu_seqlens_k"] is None and a["rest"] == {}


def test_few_decodes_fa4_takes_the_batch_whole(calls):
    """No ``decode_rows`` (fewer than MIN_MIXED_DECODE_ROWS one-token sequences): FA4 computes every row."""
    q, k, v, cache, meta = _step(SPECS, decode_rows=False)
    ref = _reference(q, k, v, cache, meta)
    out = _backend().forward(q, k, v, cache, meta, SCALE)
    _close(out, ref)
    assert [c[0] for c in calls] == ["fa4"]
    assert calls[0][1]["seqused_q"] is None


def test_decode_only_steps_never_reach_fa4(calls):
    q, k, v, cache, meta = _step([(10, 1), (40, 1), (77, 1)], decode_rows=False)
    ref = _reference(q, k, v, cache, meta)
    out = _backend().forward(q, k, v, cache, meta, SCALE)
    _close(out, ref)
    assert [c[0] for c in calls] == ["decode"]


def test_sliding_window_is_left_w_minus_one(calls):
    q, k, v, cache, meta = _step(SPECS)
    ref = _reference(q, k, v, cache, meta, window=24)
    out = _backend().forward(q, k, v, cache, meta, SCALE, sliding_window=24)
    _close(out, ref)
    assert calls[0][1]["window_size"] == (23, 0)


def test_seqused_q_built_once_per_step(calls):
    """Every layer of a step reuses one ``seqused_q``; the next step (new ``decode_rows``) builds its own."""
    backend = _backend()
    q, k, v, cache, meta = _step(SPECS)
    for _ in range(2):  # two layers, same metadata
        backend.forward(q, k, v, cache.clone(), meta, SCALE)
    fa4 = [c[1]["seqused_q"] for c in calls if c[0] == "fa4"]
    assert fa4[0] is fa4[1]
    q, k, v, cache, meta2 = _step(SPECS, seed=1)
    backend.forward(q, k, v, cache, meta2, SCALE)
    assert [c[1]["seqused_q"] for c in calls if c[0] == "fa4"][-1] is not fa4[0]


@pytest.mark.parametrize("case", ["float32", "fp8"])
def test_caches_fa4_cannot_read_take_the_triton_prefill(calls, case):
    """float32 (a float32 model under kv "auto") and fp8 (per-token scales): Triton prefill, same result."""
    dtype = torch.float32 if case == "float32" else torch.bfloat16
    q, k, v, cache, meta = _step(SPECS, dtype=dtype, fp8=case == "fp8")
    ref = _reference(q, k, v, cache, meta)
    out = _backend().forward(q, k, v, cache, meta, SCALE)
    _close(out, ref)
    assert [c[0] for c in calls] == ["triton_prefill", "decode"] and calls[0][1] is True


def test_backend_identity(calls):
    from rollout.layers.fa4_backend import FA4PrefillBackend
    from rollout.layers.triton_backend import TritonAttentionBackend

    b = _backend()
    assert isinstance(b, FA4PrefillBackend) and isinstance(b, TritonAttentionBackend)
    assert b.name == "fa4" and b.uses_decode_rows and b.block_size == PAGE


def test_missing_package_error_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)  # import fails
    from rollout.layers.fa4_backend import load_fa4_varlen

    with pytest.raises(ImportError, match="flash-attn-4"):
        load_fa4_varlen()


def test_auto_picks_fa4_only_when_installed_page_128_and_not_fp8(monkeypatch):
    monkeypatch.setattr(backends, "fa4_available", lambda: True)
    monkeypatch.setattr(backends, "flash_attn_available", lambda: False)
    assert resolve_attention("auto", CUDA, 128) == AttentionSpec("fa4", 128, "auto")
    assert resolve_attention("auto", CUDA, 128, "bfloat16").backend == "fa4"
    assert resolve_attention("auto", CUDA, 16).backend == "triton"  # FA4's TMA page is 128
    assert resolve_attention("auto", CUDA, 256).backend == "triton"
    assert resolve_attention("auto", CUDA, 128, "fp8").backend == "triton"
    assert resolve_attention("auto", CUDA, 128, "float32").backend == "triton"
    assert resolve_attention("auto", torch.device("cpu"), 128).backend == "torch"
    assert resolve_attention("fa4", CUDA, 16) == AttentionSpec("fa4", 16, "auto")  # explicit: any page
    with pytest.raises(ValueError, match="fp8.*'fa4'"):
        resolve_attention("fa4", CUDA, 128, "fp8")
    with pytest.raises(ValueError, match="CUDA"):
        resolve_attention("fa4", torch.device("cpu"), 128)
    monkeypatch.setattr(backends, "flash_attn_available", lambda: True)
    assert resolve_attention("auto", CUDA, 256).backend == "flash_attn"  # unchanged


def test_explicit_fa4_without_the_package(monkeypatch):
    monkeypatch.setattr(backends, "fa4_available", lambda: False)
    assert resolve_attention("auto", CUDA, 128).backend in ("triton", "flash_attn")
    with pytest.raises(ValueError, match="flash-attn-4"):
        resolve_attention("fa4", CUDA, 128)


def test_config_accepts_fa4_refuses_it_with_fp8():
    assert EngineConfig(attention_backend="fa4", block_size=128).attention_backend == "fa4"
    with pytest.raises(ValueError, match="'fa4'"):
        EngineConfig(attention_backend="fa4", kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="'fa4'"):
        EngineConfig(attention_backend="fa5")


def test_fa4_alone_is_not_flash_attn_2(tmp_path, monkeypatch):
    """flash-attn-4 installs ``flash_attn/cute`` under a namespace ``flash_attn`` (no ``__init__.py``): that is
    FA4, and not flash-attn 2, whose backend would fail to import ``flash_attn.flash_attn_varlen_func``."""
    monkeypatch.delitem(sys.modules, "flash_attn", raising=False)
    (tmp_path / "flash_attn" / "cute").mkdir(parents=True)
    (tmp_path / "flash_attn" / "cute" / "interface.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert backends.fa4_available() and not backends.flash_attn_available()
    (tmp_path / "flash_attn" / "__init__.py").write_text("")  # flash-attn 2 beside it
    import importlib

    importlib.invalidate_caches()
    assert backends.fa4_available() and backends.flash_attn_available()
