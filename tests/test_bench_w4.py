"""W4 (bench/multiturn.py) in its tiny CPU form: both modes run, count the same model tokens, and only the
engine's environment loop keeps prefill at prompt + environment tokens."""

from tests.script_helpers import load_bench, load_script


def test_w4_tiny_runs_both_modes(tmp_path) -> None:
    module = load_bench("multiturn", "bench_multiturn")
    out = tmp_path / "w4.jsonl"
    recs = module.run(True, ["env_loop", "env_loop_hold4", "turn_sync", "turn_sync_nocache"], str(out))
    loop, held, sync, nocache = recs
    assert loop["mode"] == "env_loop" and held["mode"] == "env_loop_hold4" and sync["mode"] == "turn_sync"
    assert held["model_tokens"] == loop["model_tokens"] and held["prefill_over_given"] == 1.0
    assert loop["model_tokens"] == sync["model_tokens"] == 8 * 3 * 12
    assert loop["prefill_over_given"] == 1.0 and loop["preemptions"] == 0
    assert sync["prefill_tokens"] > sync["given_tokens"]  # the turn-synchronous loop re-prefills partial blocks
    assert nocache["prefix_cached_tokens"] == 0 and nocache["prefill_tokens"] > sync["prefill_tokens"]
    assert "vs_turn_sync" in loop and "vs_turn_sync_nocache" in loop and len(out.read_text().splitlines()) == 4
    assert "W4" in load_script("bench").MULTITURN


def test_w4_geometric_turns_end_at_stop_ids() -> None:
    """W4-geo: turns end at stop ids (lengths vary, capped), both modes still count every model token."""
    module = load_bench("multiturn", "bench_multiturn_geo")
    loop, sync = module.run(True, ["env_loop", "turn_sync"], None, turn_lengths="geometric")
    assert loop["workload"] == sync["workload"] == "W4-geo-tiny" and loop["turn_tokens"] == 24
    assert loop["model_tokens"] < 8 * 3 * 24 and sync["model_tokens"] < 8 * 3 * 24  # stops hit before the cap
    assert loop["prefill_over_given"] == 1.0


def test_w4_agentic_tool_latency() -> None:
    """W4-tools: environment calls log-normal (median 0.5 s, capped at 8 s), seeded; both modes still run."""
    import random
    import statistics

    module = load_bench("multiturn", "bench_multiturn_tools")
    w = dict(module.W4, tool_latency="agentic", agentic_ms=dict(module.AGENTIC_MS))
    draws = [module.sleep_ms(random.Random(i), w) for i in range(4000)]
    assert 400 < statistics.median(draws) < 600 and max(draws) <= 8000 and sum(d > 2000 for d in draws) > 200
    assert module.sleep_ms(random.Random(7), w) == module.sleep_ms(random.Random(7), w)
    assert all(0 <= module.sleep_ms(random.Random(i), dict(module.W4)) <= 200 for i in range(50))
    loop, sync = module.run(True, ["env_loop", "turn_sync"], None, tool_latency="agentic")
    assert loop["workload"] == sync["workload"] == "W4-tools-tiny" and loop["tool_latency"] == "agentic"
    assert loop["model_tokens"] == sync["model_tokens"] == 8 * 3 * 12 and "vs_turn_sync" in loop


def test_w4_trl_loop_calls_environments_one_after_another(monkeypatch) -> None:
    """turn_sync_trl: TRL 1.16's ``_tool_call_loop`` calls each conversation's tools in turn on its own thread, so
    a round waits for the sum of the calls; turn_sync (the issue's kinder model) calls them concurrently. The
    sleeps of turn_sync_trl all run on the calling thread, one at a time, and its wall covers their sum."""
    import threading
    import time

    import pytest

    module = load_bench("multiturn", "bench_multiturn_trl")
    slept: dict[str, list[tuple[int, float]]] = {}
    real_sleep, mode = time.sleep, ["?"]

    def recording_sleep(s: float) -> None:
        slept.setdefault(mode[0], []).append((threading.get_ident(), s))
        real_sleep(s)

    monkeypatch.setattr(module.time, "sleep", recording_sleep)
    recs = []
    for m in ("turn_sync", "turn_sync_trl", "env_loop"):
        mode[0] = m
        recs += module.run(True, [m], None)
    me = threading.get_ident()
    assert {t for t, _ in slept["turn_sync_trl"]} == {me} and len(slept["turn_sync_trl"]) == 8 * 2
    assert me not in {t for t, _ in slept["turn_sync"]}  # the concurrent model: pool threads
    assert recs[1]["wall_s"] >= sum(s for _, s in slept["turn_sync_trl"])
    assert recs[1]["model_tokens"] == recs[0]["model_tokens"] == 8 * 3 * 12
    with pytest.raises(ValueError, match="turn_sync_trll"):
        module.run(True, ["turn_sync_trll"], None)
