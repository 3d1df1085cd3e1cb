"""AsyncEngine (the thread that steps an Engine for the server and the pool replica), driven directly on the
CPU: outputs equal ``Engine.generate``'s whoever submits them, aborts free the engine, calls land between
steps, a failed step fails only its own requests, and closing never hangs."""

import threading
import time
from concurrent.futures import CancelledError, wait

import pytest

from rollout import SamplingParams
from rollout.engine.async_engine import AsyncEngine
from tests.engine_helpers import make_engine, random_prompts
from tests.test_engine_faults import FailingRunner, _assert_same, _params
from tests.tiny_models import make_tiny_hf_model

TIMEOUT_S = 60


@pytest.fixture(scope="module")
def hf():
    return make_tiny_hf_model("llama")


@pytest.fixture
def started():
    """Builds AsyncEngines and closes every one at the end of the test, whatever it did."""
    loops = []

    def start(engine, **options):
        loops.append(AsyncEngine(engine, **options).start())
        return loops[-1]

    yield start
    for loop in loops:
        loop.close()


def _long(max_tokens: int = 200) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def _running(loop: AsyncEngine) -> int:
    """Sequences the engine holds, read at a step boundary."""
    stats = loop.call(loop.engine.get_stats).result(TIMEOUT_S)
    return stats.num_running_seqs + stats.num_waiting_seqs


def _started(loop: AsyncEngine, prompt: list[int], params: SamplingParams):
    """Submit a request and return its future once its first tokens landed."""
    first = threading.Event()
    fut = loop.submit(prompt, params, on_partial=lambda out: first.set())
    assert first.wait(TIMEOUT_S), "the request never produced a token"
    return fut


@pytest.mark.parametrize("async_mode", [False, True])
def test_submits_from_several_threads_equal_generate(hf, started, async_mode):
    loop = started(make_engine(hf, block_size=4, async_mode=async_mode, max_num_seqs=4))
    groups = [random_prompts(3, hf.config.vocab_size, seed=40 + i) for i in range(4)]
    got, errors = [None] * len(groups), []

    def caller(i):
        try:
            futs = [loop.submit(p, sp) for p, sp in zip(groups[i], _params())]
            got[i] = [f.result(TIMEOUT_S) for f in futs]
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=caller, args=(i,), daemon=True) for i in range(len(groups))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S)
    assert not errors, errors
    fresh = make_engine(hf, block_size=4)
    for g, prompts in zip(got, groups):
        _assert_same(g, fresh.generate(prompts, _params()))
    assert loop.num_pending() == 0 and _running(loop) == 0


def test_streamed_partials_grow_to_the_final_output(hf, started):
    loop = started(make_engine(hf, block_size=4))
    prompt = random_prompts(1, hf.config.vocab_size, seed=41)[0]
    parts = []
    final = loop.submit(prompt, SamplingParams(n=2, temperature=1.0, max_tokens=12, ignore_eos=True, seed=5),
                        on_partial=parts.append).result(TIMEOUT_S)
    assert parts and all(not p.finished for p in parts)
    sizes = [sum(len(c.token_ids) for c in p.outputs) for p in parts]
    assert all(sizes) and sum(sizes) < 24  # only steps that landed tokens, never the final one
    for c, f in zip(parts[0].outputs, final.outputs):  # each part is a delta: the tokens of one step, no text
        got = [c.index for p in parts for c in p.outputs if c.index == f.index]
        ids = [t for p in parts for c in p.outputs if c.index == f.index for t in c.token_ids]
        lps = [x for p in parts for c in p.outputs if c.index == f.index for x in c.logprobs]
        assert got and f.token_ids[: len(ids)] == ids and f.logprobs[: len(lps)] == lps
    assert all(c.text is None for p in parts for c in p.outputs)


def test_abort_and_cancel_free_the_engine_and_it_serves_on(hf, started):
    loop = started(make_engine(hf, block_size=4))
    prompts = random_prompts(3, hf.config.vocab_size, seed=42)
    fut = _started(loop, prompts[0], _long())
    rid = next(r for r, w in loop._waiters.items() if w.future is fut)
    loop.abort(rid)
    assert fut.cancelled()
    with pytest.raises(CancelledError):
        fut.result(TIMEOUT_S)
    assert _running(loop) == 0
    fut = _started(loop, prompts[1], _long())
    assert fut.cancel()  # cancelling the future aborts the request too
    assert _running(loop) == 0 and loop.num_pending() == 0
    loop.abort("never-submitted")  # ignored
    out = loop.submit(prompts[2], _params()[2]).result(TIMEOUT_S)
    _assert_same([out], make_engine(hf, block_size=4).generate([prompts[2]], _params()[2]))


def test_refused_requests_fail_their_future_only(hf, started):
    loop = started(make_engine(hf, block_size=4))  # no tokenizer: stop strings are refused by add_request
    bad = loop.submit([1, 2, 3], SamplingParams(stop=["x"], max_tokens=3))
    mine = loop.submit([1, 2, 3], _long(), request_id="mine")
    with pytest.raises(ValueError, match="'mine' is already in use"):
        loop.submit([4, 5], request_id="mine")
    with pytest.raises(ValueError, match="stop strings"):
        bad.result(TIMEOUT_S)
    assert loop.submit([4, 5], _long(3)).result(TIMEOUT_S).outputs[0].finish_reason == "length"
    assert mine.result(TIMEOUT_S).outputs[0].finish_reason == "length"


def test_calls_run_in_the_loop_thread_between_steps(hf, started):
    eng = make_engine(hf, block_size=4)
    inner, in_step, steps = eng.step, threading.Event(), []

    def step():
        in_step.set()
        try:
            time.sleep(0.002)  # widen the window a call would have to land inside a step
            return inner()
        finally:
            in_step.clear()
            steps.append(1)

    eng.step = step
    loop = started(eng)
    fut = _started(loop, [1, 2, 3], _long(100))
    seen = []

    def probe():
        seen.append((in_step.is_set(), threading.current_thread() is loop._thread, len(steps)))
        return eng.get_stats().num_running_seqs

    assert [loop.call(probe).result(TIMEOUT_S) for _ in range(5)] == [1] * 5  # mid-request: it runs still
    assert all(not inside and mine for inside, mine, _ in seen), seen
    assert [n for *_, n in seen] == sorted(n for *_, n in seen)
    with pytest.raises(ZeroDivisionError):  # a call's error goes to its caller; the loop serves on
        loop.call(lambda: 1 / 0).result(TIMEOUT_S)
    loop.call(lambda: loop.set_paused(True)).result(TIMEOUT_S)
    paused_at = len(steps)
    time.sleep(0.1)
    assert len(steps) == paused_at and loop.paused and not fut.done()
    assert loop.call(loop.abort_all).result(TIMEOUT_S) == 1  # paused, aborted: the client hears "abort" now
    assert fut.result(TIMEOUT_S).outputs[0].finish_reason == "abort"
    loop.call(lambda: loop.set_paused(False)).result(TIMEOUT_S)
    assert loop.submit([4, 5, 6], _long(4)).result(TIMEOUT_S).outputs[0].finish_reason == "length"


@pytest.mark.parametrize("async_mode", [False, True])
@pytest.mark.parametrize("exc", [RuntimeError("CUDA error: injected"), KeyboardInterrupt()])
def test_a_failed_step_fails_only_its_requests_and_the_loop_serves_on(hf, started, async_mode, exc):
    """One sequence at a time: the first request runs when step 3 fails, the second waits; only the first fails."""
    eng = make_engine(hf, block_size=4, async_mode=async_mode, max_num_seqs=1)
    eng.runner = FailingRunner(eng.runner, fail_at=3, where="execute", exc=exc)
    loop = started(eng)
    prompts = random_prompts(3, hf.config.vocab_size, seed=43)
    params = [_long(10), _params()[0], _params()[2]]
    first, second = loop.submit(prompts[0], params[0]), loop.submit(prompts[1], params[1])
    with pytest.raises(RuntimeError, match="injected" if isinstance(exc, RuntimeError) else "KeyboardInterrupt"):
        first.result(TIMEOUT_S)
    third = loop.submit(prompts[2], params[2])
    fresh = make_engine(hf, block_size=4, max_num_seqs=1)
    _assert_same([second.result(TIMEOUT_S), third.result(TIMEOUT_S)], fresh.generate(prompts[1:], params[1:]))
    assert eng.get_stats().num_failed_steps == 1 and len(eng.failed_request_ids) == 1  # the first only
    assert _running(loop) == 0 and eng.block_manager.num_free_blocks == eng.num_blocks


def test_close_with_pending_requests_does_not_hang(hf):
    eng = make_engine(hf, block_size=4, max_num_seqs=2)
    loop = AsyncEngine(eng).start()
    futs = [loop.submit(p, _long()) for p in random_prompts(4, hf.config.vocab_size, seed=44)]
    t0 = time.monotonic()
    loop.close()
    assert time.monotonic() - t0 < 10 and not loop._thread.is_alive()
    done, _ = wait(futs, timeout=TIMEOUT_S)
    assert len(done) == len(futs)
    for f in futs:
        with pytest.raises(RuntimeError, match="shut down"):
            f.result()
    assert not eng.has_unfinished_requests()  # aborted: the engine is consistent for whoever uses it next
    with pytest.raises(RuntimeError, match="shut down"):
        loop.submit([1, 2, 3])
    with pytest.raises(RuntimeError, match="shut down"):
        loop.call(eng.get_stats).result(TIMEOUT_S)
    never = AsyncEngine(eng)  # closed without being started: its pending requests fail too
    fut = never.submit([1, 2, 3], _long(3))
    never.close()
    with pytest.raises(RuntimeError, match="shut down"):
        fut.result(TIMEOUT_S)


def test_a_slow_stream_listener_never_slows_the_steps(hf, started):
    """Before: every step called each stream's listener in the stepping thread (256 streams on the H200: 5.1x
    the step time). Now the listeners run in the stream thread and a flush waits while the last one is being
    delivered: a listener taking 50 ms a call leaves the steps at their own pace, and the deltas still add up."""
    loop = started(make_engine(hf, block_size=4))
    prompt = random_prompts(1, hf.config.vocab_size, seed=43)[0]
    parts, threads = [], set()

    def slow(out):
        threads.add(threading.current_thread().name)
        parts.append(out)
        time.sleep(0.05)

    loop.submit(prompt, _long(8)).result(TIMEOUT_S)  # warm
    t0 = time.perf_counter()
    final = loop.submit(prompt, _long(60), on_partial=slow).result(TIMEOUT_S)
    wall = time.perf_counter() - t0
    assert wall < 60 * 0.05 / 2, f"{wall:.2f} s: the steps waited for the listener"
    assert threading.current_thread().name not in threads and loop._thread.name not in threads
    ids = [t for p in parts for c in p.outputs for t in c.token_ids]
    assert 0 < len(parts) < 30 and final.outputs[0].token_ids[: len(ids)] == ids


def test_stream_interval_batches_deltas(hf, started):
    """``stream_interval_s`` apart at least: a 0.3 s interval gives a handful of deltas for 60 steps, not 60."""
    loop = started(make_engine(hf, block_size=4), stream_interval_s=0.3)
    prompt = random_prompts(1, hf.config.vocab_size, seed=44)[0]
    parts, stamps = [], []

    def listen(out):
        parts.append(out)
        stamps.append(time.monotonic())

    engine, step = loop.engine, loop.engine.step
    loop.engine.step = lambda: (time.sleep(0.01), step())[1]  # 60 steps take >= 0.6 s
    try:
        final = loop.submit(prompt, _long(60), on_partial=listen).result(TIMEOUT_S)
    finally:
        engine.step = step
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    assert 1 <= len(parts) <= 4 and all(g >= 0.25 for g in gaps), gaps
    ids = [t for p in parts for c in p.outputs for t in c.token_ids]
    assert final.outputs[0].token_ids[: len(ids)] == ids and len(ids) < 60


def test_stream_interval_is_checked():
    with pytest.raises(ValueError, match="stream_interval_s"):
        AsyncEngine(object(), stream_interval_s=-1)


def test_a_streams_first_tokens_are_not_held_for_the_interval(hf, started):
    """The interval batches later deltas only: a stream submitted just after a batch went out still gets its
    first tokens the step they land (time to first token), not ``stream_interval_s`` later."""
    loop = started(make_engine(hf, block_size=4), stream_interval_s=2.0)
    prompts = random_prompts(2, hf.config.vocab_size, seed=45)
    _started(loop, prompts[0], _long())  # its first batch went out: the next is due in 2 s
    first = threading.Event()
    t0 = time.monotonic()
    loop.submit(prompts[1], _long(), on_partial=lambda out: first.set())
    assert first.wait(1.5), "the first tokens waited for the interval"
    assert time.monotonic() - t0 < 1.5


def test_stream_batch_listeners_run_after_each_batch(hf, started):
    """``on_stream_batch`` runs in the stream thread after each batch's ``on_partial`` calls: the server's
    poster holds a batch's events and wakes its event loop there, once, so every delta is followed by one."""
    loop = started(make_engine(hf, block_size=4, max_num_seqs=4))
    seen: list[str] = []
    loop.on_stream_batch(lambda: seen.append("batch"))
    futs = [loop.submit(p, _long(20), on_partial=lambda out: seen.append("partial"))
            for p in random_prompts(3, hf.config.vocab_size, seed=7)]
    for fut in futs:
        fut.result(TIMEOUT_S)
    loop.close()
    assert seen.count("partial") >= 3 and seen[-1] == "batch"
