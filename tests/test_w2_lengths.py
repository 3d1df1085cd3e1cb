"""bench/w2_lengths.py: a sampled-length workload through the engine's scheduler, and which decode path its steps
take."""

from tests.script_helpers import load_bench


def load():
    return load_bench("w2_lengths")


def test_summary_counts_even_steps_and_floor_by_batch() -> None:
    m = load()
    steps = [[11, 11], [12, 11], [12], [13]]
    s = m.summarize(steps, bucket=2)
    assert s["steps"] == 4 and s["even_steps"] == 4 and s["mean_batch"] == 1.5
    assert set(s["floor_share_by_batch"]) == {0, 2}
    long_tail = m.summarize([[600, 100, 100, 100]])  # the longest is 2.2 x the mean: the balanced split
    assert long_tail["even_steps"] == 0 and long_tail["even_floor_share"] == 0.0


def test_w2_mem_steps_are_all_even() -> None:
    """W2's shape (512-token prompts, lengths from 256 / 3,072): every step's contexts are even, so the decode runs
    on the fixed split; a kernel change for W2 must serve that path."""
    rec = load().main(["--workload", "W2-mem"])
    assert rec["steps"] == 6077 and rec["even_floor_share"] == 1.0 and rec["mean_batch"] > 150
