"""The even-split A/B's bench side (CPU): kernels_bench's even lengths and --compare-even variants, and
bench/even_rule.py's summary."""

from __future__ import annotations

import argparse
import json

from tests.script_helpers import load_bench


def test_even_lens_are_even_and_hold_the_longest():
    kb = load_bench("kernels_bench")
    lens = kb.even_lens(256, 8192, seed=3)
    assert len(lens) == 256 and lens[0] == 8192 and min(lens) >= 8192 // 3
    assert max(lens) <= 2 * sum(lens) / len(lens), "the engine calls a step even when longest <= 2 x mean"


def test_compare_even_variants(monkeypatch):
    import rollout.kernels.paged_decode as pd

    kb = load_bench("kernels_bench", "bench_kernels_even")
    monkeypatch.setattr(pd, "num_sms", lambda device: 132)  # the H200's
    args = argparse.Namespace(compare_even=True, compare_legacy=False, sweep_splits=False, swap_ab=False,
                              sweep_fp8=False, sweep_decode=False)
    fp8 = {v["variant"]: v for v in kb.decode_variants(args, 256, 2, 128, "fp8")}
    bf16 = {v["variant"]: v for v in kb.decode_variants(args, 256, 2, 128, "bf16")}
    assert fp8["even"]["even_lengths"] and "num_splits" not in fp8["even"]  # the engine's own choice
    assert fp8["even_ps4"]["num_splits"] == 1 and "even_ps4" not in bf16
    at128 = {v["variant"]: v for v in kb.decode_variants(args, 128, 2, 128, "fp8")}
    assert fp8["even_one_wave"]["num_splits"] == 1 and at128["even_one_wave"]["num_splits"] == 3
    # the balanced partition cut for 2 / 4 / 8 waves of the cache's resident programs (fp8: 6 per SM)
    assert [fp8[f"planned_w{w}"]["split_target"] for w in (2, 4, 8)] == [w * 6 * 132 // 2 for w in (2, 4, 8)]
    assert [bf16[f"planned_w{w}"]["split_target"] for w in (2, 4, 8)] == [w * 4 * 132 // 2 for w in (2, 4, 8)]
    fixed = [v["num_splits"] for v in kb.decode_variants(args, 256, 2, 128, "bf16") if v["variant"] == "fixed"]
    assert fixed == [1, 2, 3, 4, 6, 8, 12, 16]


def test_even_rule_summary(tmp_path, capsys):
    er = load_bench("even_rule")
    recs = [dict(bench="decode", kv="fp8", B=256, ctx=8192, variant="fixed", num_splits=s, ms=ms)
            for s, ms in ((1, 0.30), (2, 0.31), (3, 0.24))]
    recs += [dict(bench="decode", kv="fp8", B=256, ctx=8192, variant="even", even_lengths=True, ms=0.30),
             dict(bench="decode", kv="fp8", B=256, ctx=8192, variant="even_one_wave", num_splits=3, ms=0.24)]
    path = tmp_path / "k.jsonl"
    path.write_text("not json\n" + "\n".join(json.dumps(r) for r in recs) + "\n")
    er.main([str(path)])
    (row,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert row["best_splits"] == 3 and row["vs_best"]["even"] == 1.25 and row["vs_best"]["even_one_wave(3)"] == 1.0


def test_compare_stream_variants(monkeypatch):
    """--compare-stream: the engine's even rule, the stream split at 1 / 2 / 4 waves, and one wave sized by other
    residencies (the module constant set for that variant only)."""
    import rollout.kernels.paged_decode as pd

    kb = load_bench("kernels_bench", "bench_kernels_stream")
    monkeypatch.setattr(pd, "num_sms", lambda device: 132)
    args = argparse.Namespace(compare_stream=True, compare_even=False, compare_legacy=False, sweep_splits=False,
                              swap_ab=False, sweep_fp8=False, sweep_decode=False)
    fp8 = {v["variant"]: v for v in kb.decode_variants(args, 256, 2, 128, "fp8")}
    bf16 = {v["variant"]: v for v in kb.decode_variants(args, 256, 2, 128, "bf16")}
    assert fp8["even"]["even_lengths"] and [fp8[f"stream_w{w}"]["stream_waves"] for w in (1, 2, 4)] == [1, 2, 4]
    assert bf16["stream_w1_ps5"]["knobs"] == {"STREAM_PROGRAMS_PER_SM": 5} and "stream_w1_ps3" in bf16
    assert bf16["stream_r96_ps5"]["knobs"] == {"STREAM_MAXNREG": 96, "STREAM_PROGRAMS_PER_SM": 5}
    assert not any(name.startswith("stream_r") for name in fp8)  # fp8's kernel has its registers (168)
    assert bf16["stream_c32w4_ps5"]["config"] == (32, 4, 2, None) and "stream_c64w8_ps2" in bf16
    assert fp8["stream_c32r168_ps6"]["config"] == (32, 2, 3, 168) and "stream_c64r200_ps5" in fp8
    assert fp8["stream_s8"]["knobs"] == {"STREAM_SEGS": 8} and "stream_s6" in fp8
    assert bf16["stream_s8_r96_ps5"]["knobs"] == {"STREAM_SEGS": 8, "STREAM_PROGRAMS_PER_SM": 5, "STREAM_MAXNREG": 96}
    assert fp8["stream_w1_ps7"]["knobs"] == {"FP8_PROGRAMS_PER_SM": 7} and "stream_w1_ps6" not in fp8
    assert "uniform" not in bf16  # long-tail and even lengths: no uniform rule to time
    args.lengths = "uniform"  # W1's shape (w1_stream): the rule its steps take, one wave's equal chunks
    uniform = {v["variant"]: v for v in kb.decode_variants(args, 32, 8, 128, "bf16")}
    assert uniform["uniform"]["even_lengths"] == 2 and uniform["uniform"]["plan"]


def test_stream_balance_padding_unbalances_small_segs():
    """bench/stream_balance.py: on W2's 16K long tail (bf16's 264 programs a kv head) SEGS 4's padding leaves one
    program a third more than the mean, SEGS 8 within 2%; the loop (0) pads nothing."""
    sb = load_bench("stream_balance")
    name, lens, hkv, per_sm = next(p for p in sb.profiles() if p[0] == "W2 long tail 256 x 16K bf16")
    programs = per_sm * 132 // hkv
    loop, four, eight = (sb.balance(lens, programs, s) for s in (0, 4, 8))
    assert loop["vmin"] == 0 and loop["run_space"] == loop["live_tiles"]
    assert four["max_over_mean"] > 1.3 and eight["max_over_mean"] < 1.02, (four, eight)
