"""bench/w2_lengths.py: the FIFO schedule of a sampled-length workload, and which decode path its steps take."""

from tests.script_helpers import load_bench


def load():
    return load_bench("w2_lengths")


def test_schedule_admits_fifo_and_counts_contexts() -> None:
    m = load()
    steps = m.schedule([2, 1, 3], prompt_len=10, max_num_seqs=2)
    # step 0: seqs 0, 1 at context 11; seq 1 ends; step 1: seq 0 (12) and seq 2 admitted (11); ...
    assert steps == [[11, 11], [12, 11], [12], [13]]
    s = m.summarize(steps, bucket=2)
    assert s["steps"] == 4 and s["even_steps"] == 4 and s["mean_batch"] == 1.5
    assert set(s["floor_share_by_batch"]) == {0, 2}
    long_tail = m.summarize([[600, 100, 100, 100]])  # the longest is 2.2 x the mean: the balanced split
    assert long_tail["even_steps"] == 0 and long_tail["even_floor_share"] == 0.0


def test_w2_mem_steps_are_all_even() -> None:
    """W2's shape (512-token prompts, lengths from 256 / 3,072): every step's contexts are even, so the decode runs
    on the fixed split; a kernel change for W2 must serve that path."""
    rec = load().main(["--workload", "W2-mem"])
    assert rec["steps"] == 6078 and rec["even_floor_share"] == 1.0 and rec["mean_batch"] > 150
