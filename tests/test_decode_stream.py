"""The stream split of paged decode attention (rollout/kernels/paged_decode_stream.py) against the torch reference,
in the Triton interpreter: runs of key tiles that cross sequences, partial rows p + b, empty sequences zeroed by the
reduce, windows, fp8 caches, the plan shared by a step's layers, the module switch.

The checks run in a child process under TRITON_INTERPRET=1 (tests/interpreter.py explains why).
"""

from __future__ import annotations

import pytest
import torch

from rollout.layers.attention import reference_attention
from tests.interpreter import child_main, child_verdicts
from tests.test_fp8_kv import fp8_scenario
from tests.test_kernels import SCALE, assert_close, counted_launches, long_tail, scenario


def stream_decode(q, cache, meta, window=None, **kw):
    from rollout.kernels.paged_decode import paged_decode_attention

    return paged_decode_attention(q, cache, meta.block_tables, meta.seq_lens, SCALE, window, stream=True, **kw)


def check_stream(hq, hkv, d, page, seq_lens, window=None, tol=1e-4, dtype=torch.float32, **kw):
    q, cache, meta = scenario([1] * len(seq_lens), seq_lens, hq, hkv, d, page, dtype)
    assert_close(stream_decode(q, cache, meta, window, **kw), reference_attention(q, cache, meta, SCALE, window), tol)


def runs_crossing(plan: torch.Tensor, seq_lens: list[int], block_n: int) -> int:
    """How many programs' runs hold tiles of more than one sequence."""
    tiles = [-(-s // block_n) for s in seq_lens]
    crossing = 0
    for b0, before, g0, g1, _ in plan.tolist():
        if g1 > g0 and g1 > before + tiles[b0]:
            crossing += 1
    return crossing


def check_stream_plan_crosses_sequences():
    """The plan cuts the live tiles into equal runs laid over the sequences end to end: some runs cross a
    sequence's end, each sequence's partial rows are consecutive and distinct from every other's."""
    import rollout.kernels.paged_decode_stream as ps
    from rollout.kernels.paged_decode import decode_config

    lens = long_tail(24, 2000, 1)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    block_n = decode_config(16, 16, torch.float32)[0]
    plan, seq_info = ps.stream_plan(None, seq_lens, block_n, 0, programs=7, min_chunk=1)
    tiles = [-(-s // block_n) for s in lens]
    chunk = -(-sum(tiles) // 7)
    assert [row[2] for row in plan.tolist()] == [min(p * chunk, sum(tiles)) for p in range(7)]
    assert not plan[:, 4].any(), "no segment bound: no padding (vmin 0)"
    assert plan[-1, 3].item() == sum(tiles), "the runs cover every live tile"
    assert runs_crossing(plan, lens, block_n) >= 3
    rows = set()
    for b, (first, n) in enumerate(seq_info.tolist()):
        assert n >= 1
        mine = set(range(first, first + n)) if n > 1 else set()
        assert not rows & mine, f"sequence {b}'s partial rows {mine} overlap another's"
        rows |= mine
    assert max(rows) < 7 + len(lens)


def tile_ranges(seq_lens: list[int], block_n: int, window: int = 0) -> list[tuple[int, int]]:
    """paged_decode._tile_range per sequence: its live key tiles [lo, hi)."""
    return [((max(s - window, 0) // block_n) if window else 0, -(-s // block_n)) for s in seq_lens]


def walk_runs(plan: torch.Tensor, ranges: list[tuple[int, int]]) -> tuple[list[int], dict]:
    """The kernel's walk of every run (_stream_segment, in Python): sequences each run touches, and which
    programs hold each (sequence, tile)."""
    touched, owner = [], {}
    for pid, (b, base, g, g1, vmin) in enumerate(plan.tolist()):
        n = 0
        while g < g1 and b < len(ranges):
            lo, hi = ranges[b]
            share_end = base + max(hi - lo, vmin)
            for t in range(lo + g - base, lo + min(g1, base + hi - lo) - base):
                owner.setdefault((b, t), []).append(pid)
            g, base, b, n = min(g1, share_end), share_end, b + 1, n + 1
        touched.append(n)
    return touched, owner


def check_stream_segs_plan_bounds_runs():
    """STREAM_SEGS's plan: shares of at least vmin keep every run within SEGS sequences (empty sequences, windows,
    sequences shorter than a run, min_chunk included), every live tile in exactly one run, each sequence's
    partial rows the programs that hold its tiles."""
    import rollout.kernels.paged_decode_stream as ps

    block_n = 16
    cases = [  # (lengths, window, programs, min_chunk)
        (long_tail(24, 2000, 1), 0, 12, 1),
        ([1, 0, 3, 700, 0, 0, 17, 2, 900, 5, 0], 0, 9, 1),  # empties and sequences shorter than a run
        ([40] * 30 + [3000], 0, 11, 1),  # more sequences than programs x (SEGS - 2) / 2
        ([1, 19, 20, 21, 900, 3, 260], 70, 5, 1),  # windows
        (long_tail(9, 1500, 2), 0, 8, 6),  # min_chunk above the equal share
        ([1, 0, 700, 3, 2, 900], 0, 12, 1),  # SEGS 3 (programs > batch)
    ]
    for segs in (3, 4, 6):
        for lens, window, programs, min_chunk in cases:
            if ps.stream_segs(segs, programs, len(lens)) != segs:
                continue
            seq_lens = torch.tensor(lens, dtype=torch.int32)
            plan, seq_info = ps.stream_plan(None, seq_lens, block_n, window, programs, min_chunk, segs)
            ranges = tile_ranges(lens, block_n, window)
            touched, owner = walk_runs(plan, ranges)
            assert max(touched) <= segs, (segs, lens, touched)
            live = {(b, t) for b, (lo, hi) in enumerate(ranges) for t in range(lo, hi)}
            assert set(owner) == live and all(len(p) == 1 for p in owner.values()), (segs, lens)
            vmin = plan[0, 4].item()
            assert vmin >= 1 and (plan[:, 4] == vmin).all()
            for b, (first, n) in enumerate(seq_info.tolist()):
                pids = sorted({owner[(b, t)][0] for t in range(*ranges[b])})
                assert n == len(pids) and pids == list(range(pids[0], pids[0] + n)) if pids else n == 0, (b, pids, n)
                if pids:
                    assert first == pids[0] + b
    assert ps.stream_segs(4, 10, 19) == 4 and ps.stream_segs(4, 10, 20) == 0  # programs x (SEGS - 2) > batch
    for bad in (1, 2, -1):
        with pytest.raises(ValueError, match="STREAM_SEGS"):
            ps.stream_segs(bad, 10, 2)


def check_stream_balance_mirrors_the_plan():
    """bench/stream_balance.py's vmin and run space are the plan kernel's (its last run ends at the run space)."""
    import rollout.kernels.paged_decode_stream as ps
    from tests.script_helpers import load_bench

    sb = load_bench("stream_balance")
    for lens, programs, segs, min_chunk in (([1, 0, 700, 3, 2, 900, 40], 12, 4, 1), (long_tail(24, 2000, 1), 12, 6, 2),
                                            ([40] * 30 + [3000], 11, 8, 2), ([300] * 9, 8, 4, 6), ([5, 9], 3, 4, 1)):
        plan, _ = ps.stream_plan(None, torch.tensor(lens, dtype=torch.int32), 16, 0, programs, min_chunk,
                                 ps.stream_segs(segs, programs, len(lens)))  # fmt: skip
        got = sb.balance(lens, programs, segs, block_n=16, min_chunk=min_chunk)
        assert plan[0, 4].item() == got["vmin"], (lens, plan[0, 4].item(), got)
        assert plan[-1, 3].item() == got["run_space"], (lens, plan[-1].tolist(), got)


def check_stream_segs_outputs():
    """The unrolled kernel (STREAM_SEGS 3 and 4) equals the reference: long tails, empty sequences, windows,
    sequences shorter than a run, fp8 with V page by page; a batch too large for the bound takes the loop."""
    import rollout.kernels.paged_decode_stream as ps

    old = ps.STREAM_SEGS
    try:
        for segs in (3, 4):
            ps.STREAM_SEGS = segs
            check_stream(4, 2, 16, 16, long_tail(8, 600, 1), min_chunk=1)
            check_stream(12, 2, 16, 8, [1, 19, 20, 21, 500, 3], window=150, min_chunk=1)
            check_stream(4, 2, 16, 8, [40] * 14 + [700], min_chunk=1, stream_waves=2)
            check_stream_fp8(12, 2, 16, 16, long_tail(6, 500, 7), min_chunk=1, swap_ab=True, v_pages=True)
            q, cache, meta = scenario([1] * 6, [12, 1, 40, 33, 9, 300], 4, 2, 16, 8)
            meta.seq_lens[1] = meta.seq_lens[4] = 0
            out = stream_decode(q, cache, meta, min_chunk=1)
            assert not out[1].any() and not out[4].any()
            assert_close(out[[0, 2, 3, 5]], reference_attention(q, cache, meta, SCALE)[[0, 2, 3, 5]], 1e-4)
            old_scan, ps.SCAN = ps.SCAN, 8  # the plan's three passes over more sequences than one scan step
            try:
                check_stream(2, 1, 16, 8, long_tail(19, 300, 3), min_chunk=1, stream_waves=3)
            finally:
                ps.SCAN = old_scan
        launches, kernel = [], ps._decode_stream_kernel

        class Seen:
            def __getitem__(self, grid):
                def launch(*args, **kw):
                    launches.append((grid[0], kw["SEGS"]))
                    return kernel[grid](*args, **kw)

                return launch

        ps._decode_stream_kernel, ps.STREAM_SEGS = Seen(), 4
        # 12 programs a kv head (6 an SM, 4 SMs in the interpreter, 2 kv heads): 12 x (4 - 2) > 5, not > 24
        check_stream(4, 2, 16, 8, [30] * 5, min_chunk=1)
        check_stream(4, 2, 16, 8, [30] * 24, min_chunk=1)  # 24 sequences: the loop
        assert launches == [(12, 4), (12, 0)], launches
    finally:
        ps.STREAM_SEGS = old
        ps._decode_stream_kernel = kernel


def check_stream_empty_sequences_zeroed():
    """seq_len 0 (graph padding) in the middle and at the end: zeros, though no run touches it; out in place."""
    q, cache, meta = scenario([1] * 5, [12, 1, 40, 33, 9], 4, 2, 16, 8)
    meta.seq_lens[1] = 0
    meta.seq_lens[4] = 0
    out = torch.full_like(q, 7.0)
    for waves in (1, 3):
        res = stream_decode(q, cache, meta, out=out, min_chunk=1, stream_waves=waves)
        assert res.data_ptr() == out.data_ptr()
        assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.equal(out[4], torch.zeros_like(out[4]))
        live = [0, 2, 3]
        ref = reference_attention(q, cache, meta, SCALE)
        assert_close(out[live], ref[live], 1e-4)


def check_stream_planned_once_per_step():
    """A step's layers share one plan (one plan launch for two calls on the same seq_lens); new lengths re-plan."""
    import rollout.kernels.paged_decode_stream as ps

    q, cache, meta = scenario([1] * 9, long_tail(9, 700, 5), 8, 2, 16, 16)
    with counted_launches(ps, "_stream_plan_kernel") as launches:
        plans = {}
        ref = reference_attention(q, cache, meta, SCALE)
        for _ in range(2):
            assert_close(stream_decode(q, cache, meta, plans=plans, min_chunk=1), ref, 1e-4)
        assert len(launches) == 1, launches
        stream_decode(q, cache, meta, plans={}, min_chunk=1)
        assert len(launches) == 2


def check_stream_switch():
    """STREAM_K routes calls without num_splits to the stream split; an explicit num_splits keeps the fixed one."""
    import rollout.kernels.paged_decode as pd
    import rollout.kernels.paged_decode_stream as ps

    q, cache, meta = scenario([1] * 4, [5, 300, 64, 90], 4, 2, 16, 8)
    ref = reference_attention(q, cache, meta, SCALE)
    calls, stream = [], ps.decode_stream
    ps.decode_stream = lambda *a, **kw: calls.append(1) or stream(*a, **kw)
    old = pd.STREAM_K
    try:
        pd.STREAM_K = True
        assert_close(pd.paged_decode_attention(q, cache, meta.block_tables, meta.seq_lens, SCALE), ref, 1e-4)
        assert calls == [1]
        assert_close(pd.paged_decode_attention(q, cache, meta.block_tables, meta.seq_lens, SCALE, num_splits=2),
                     ref, 1e-4)  # fmt: skip
        assert calls == [1]
        pd.STREAM_K = False
        pd.paged_decode_attention(q, cache, meta.block_tables, meta.seq_lens, SCALE)
        assert calls == [1]
    finally:
        pd.STREAM_K = old
        ps.decode_stream = stream


def check_stream_switch_per_cache_kind():
    """STREAM_K_FP8 routes fp8 caches only, STREAM_K 16-bit ones only; each kind's wave is its own programs per SM
    (FP8_PROGRAMS_PER_SM, STREAM_PROGRAMS_PER_SM) times the SMs (4 in the interpreter) over the kv heads, and
    STREAM_MAXNREG / STREAM_BLOCK_N / STREAM_WARPS set the 16-bit kernel's tile (fp8's keeps decode_config's)."""
    import rollout.kernels.paged_decode as pd
    import rollout.kernels.paged_decode_stream as ps

    q, _, values, scales, meta = fp8_scenario([1] * 3, [7, 260, 45], 4, 2, 16, 16)
    q16, cache, meta16 = scenario([1] * 3, [7, 260, 45], 4, 2, 16, 16)
    calls, stream = [], ps.decode_stream
    programs, configs = [], []  # decode_stream's programs per kv head and its tile, call by call
    ps.decode_stream = lambda *a, **kw: (calls.append(a[1][0].dtype) or programs.append(a[9])
                                         or configs.append(a[12]) or stream(*a, **kw))  # fmt: skip
    knobs = ("STREAM_K", "STREAM_K_FP8", "STREAM_PROGRAMS_PER_SM", "STREAM_MAXNREG", "STREAM_BLOCK_N", "STREAM_WARPS")
    old = {name: getattr(pd, name) for name in knobs}
    try:
        pd.STREAM_PROGRAMS_PER_SM, pd.STREAM_MAXNREG, pd.STREAM_BLOCK_N, pd.STREAM_WARPS = 5, 96, 32, 2
        pd.STREAM_K, pd.STREAM_K_FP8 = False, True
        ref = reference_attention(q, values, meta, SCALE, None, scales)
        assert_close(pd.paged_decode_attention(q, values, meta.block_tables, meta.seq_lens, SCALE, kv_scales=scales),
                     ref, 1e-4)  # fmt: skip
        pd.paged_decode_attention(q16, cache, meta16.block_tables, meta16.seq_lens, SCALE)
        assert calls == [torch.float8_e4m3fn], calls
        pd.STREAM_K, pd.STREAM_K_FP8 = True, False
        pd.paged_decode_attention(q, values, meta.block_tables, meta.seq_lens, SCALE, kv_scales=scales)
        assert_close(pd.paged_decode_attention(q16, cache, meta16.block_tables, meta16.seq_lens, SCALE),
                     reference_attention(q16, cache, meta16, SCALE), 1e-4)  # on the knobs' tile
        assert calls == [torch.float8_e4m3fn, torch.float32], calls
        assert programs == [pd.FP8_PROGRAMS_PER_SM * 4 // 2, 5 * 4 // 2], programs
        # the STREAM_ tile knobs move the 16-bit kernel only
        assert configs == [pd.decode_config(16, 16, torch.float8_e4m3fn), (32, 2, 2, 96)], configs
    finally:
        for name, value in old.items():
            setattr(pd, name, value)
        ps.decode_stream = stream


def check_stream_errors():
    q, cache, meta = scenario([1, 1], [5, 30], 4, 2, 16, 8)
    for kw, words in ((dict(stream_waves=0), "stream waves must be >= 1"), (dict(min_chunk=0), "min_chunk")):
        try:
            stream_decode(q, cache, meta, **kw)
        except ValueError as e:
            assert words in str(e), e
        else:
            raise AssertionError(f"{kw} was accepted")


def check_stream_many_seqs_small_scan():
    """More sequences than one step of the plan's prefix sums (SCAN shrunk to 8), more programs than sequences."""
    import rollout.kernels.paged_decode_stream as ps

    old, ps.SCAN = ps.SCAN, 8
    try:
        check_stream(2, 1, 16, 8, long_tail(19, 300, 3), min_chunk=1, stream_waves=3)
    finally:
        ps.SCAN = old


def check_stream_fp8(hq, hkv, d, page, seq_lens, window=None, q_dtype=torch.float32, tol=1e-4, **kw):
    q, _, values, scales, meta = fp8_scenario([1] * len(seq_lens), seq_lens, hq, hkv, d, page)
    q = q.to(q_dtype)
    ref = reference_attention(q.float(), values, meta, SCALE, window, scales)
    assert_close(stream_decode(q, values, meta, window, kv_scales=scales, **kw), ref, tol)


def check_stream_backend_step():
    """The Triton backend with STREAM_K_FP8 / STREAM_K on: a decode step's layers (their fresh per-forward
    ``decode_plans``, even lengths flagged) equal the torch backend; one stream plan kept for the step."""
    import rollout.kernels.paged_decode as pd
    from rollout.layers.attention import TorchAttentionBackend
    from rollout.layers.triton_backend import TritonAttentionBackend

    old = pd.STREAM_K, pd.STREAM_K_FP8
    try:
        pd.STREAM_K = pd.STREAM_K_FP8 = True
        for fp8 in (True, False):
            if fp8:
                q, cache, _, _, meta = fp8_scenario([1] * 4, [40, 33, 61, 47], 4, 2, 16, 8)
            else:
                q, cache, meta = scenario([1] * 4, [40, 33, 61, 47], 4, 2, 16, 8)
            gen = torch.Generator().manual_seed(2)
            k, v = torch.randn(2, q.shape[0], 2, 16, generator=gen).unbind(0)
            ref_cache = cache.clone()
            ref = TorchAttentionBackend().forward(q, k, v, ref_cache, meta, SCALE)
            meta.decode_plans, meta.decode_even_lengths = {}, True
            backend = TritonAttentionBackend()
            for _ in range(2):  # two layers of one step
                out = backend.forward(q, k, v, cache, meta, SCALE)
                assert_close(out, ref, 1e-4)
            assert [key[0] for key in meta.decode_plans] == ["stream"], list(meta.decode_plans)
    finally:
        pd.STREAM_K, pd.STREAM_K_FP8 = old


CHECKS = {
    "stream_plan_crosses_sequences": check_stream_plan_crosses_sequences,
    "stream_long_tail": lambda: check_stream(4, 2, 16, 16, long_tail(24, 2000, 1), min_chunk=1),
    "stream_long_tail_waves3_swap_ab": lambda: check_stream(4, 2, 16, 16, long_tail(24, 2000, 1), min_chunk=1,
                                                            stream_waves=3, swap_ab=True),
    "stream_gqa6_window": lambda: check_stream(12, 2, 16, 8, [1, 19, 20, 21, 900, 3], window=150, min_chunk=1),
    "stream_gqa8_one_kv_head": lambda: check_stream(8, 1, 16, 8, long_tail(7, 1200, 4)),
    "stream_more_programs_than_tiles": lambda: check_stream(4, 2, 16, 8, [1, 3, 2], min_chunk=1, stream_waves=4),
    "stream_fp16_cache": lambda: check_stream(4, 2, 32, 16, [7, 300, 45], tol=1e-2, dtype=torch.float16,
                                                    min_chunk=1),
    "stream_empty_sequences_zeroed": check_stream_empty_sequences_zeroed,
    "stream_planned_once_per_step": check_stream_planned_once_per_step,
    "stream_switch": check_stream_switch,
    "stream_switch_per_cache_kind": check_stream_switch_per_cache_kind,
    "stream_errors": check_stream_errors,
    "stream_backend_step": check_stream_backend_step,
    "stream_many_seqs_small_scan": check_stream_many_seqs_small_scan,
    "stream_segs_plan_bounds_runs": check_stream_segs_plan_bounds_runs,
    "stream_segs_outputs": check_stream_segs_outputs,
    "stream_balance_mirrors_the_plan": check_stream_balance_mirrors_the_plan,
    "stream_fp8_long_tail": lambda: check_stream_fp8(12, 2, 16, 16, long_tail(12, 1500, 7), min_chunk=1),
    "stream_fp8_v_pages_bf16_queries_window": lambda: check_stream_fp8(
        6, 2, 32, 16, [7, 260, 45, 600], window=100, q_dtype=torch.bfloat16, tol=2e-2, min_chunk=1, v_pages=True),
}


@pytest.fixture(scope="module")
def verdicts() -> dict[str, str]:
    return child_verdicts(__file__)


@pytest.mark.parametrize("name", list(CHECKS))
def test_stream_decode(verdicts: dict[str, str], name: str) -> None:
    assert verdicts[name] == "ok", verdicts[name]


if __name__ == "__main__":
    child_main(CHECKS)
