"""Faults an adversarial user finds (issue 8): a step that raises, sleeping engines, values that overflow
the engine's dtype, several threads at once, and bad values refused up front. After each, the engine
must be consistent: the next call generates exactly what a fresh engine would."""

import threading

import pytest
import torch

from rollout import Engine, SamplingParams
from tests.engine_helpers import assert_matches_hf, make_engine, random_prompts
from tests.tiny_models import make_tiny_hf_model

TIMEOUT_S = 60


@pytest.fixture(scope="module")
def hf():
    return make_tiny_hf_model("llama")


def _params():
    return [SamplingParams(temperature=0.8, max_tokens=10, ignore_eos=True, seed=3),
            SamplingParams(n=2, temperature=1.0, max_tokens=12, ignore_eos=True, seed=5),
            SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)]


def _results(outs):
    return [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in outs]


def _assert_same(got, want):
    assert _results(got) == _results(want)
    for g, w in zip(got, want):
        for a, b in zip(g.outputs, w.outputs):
            assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4)


class FailingRunner:
    """A runner double: runs the real step (so KV is written), then raises at the chosen call, either
    from ``execute`` (the step's samples are lost) or from ``result`` (its collection fails)."""

    def __init__(self, inner, fail_at: int, where: str, exc: BaseException) -> None:
        self.inner, self.fail_at, self.where, self.exc = inner, fail_at, where, exc
        self.calls = 0

    def execute(self, plan):
        self.calls += 1
        pending = self.inner.execute(plan)
        if self.calls == self.fail_at:
            if self.where == "execute":
                raise self.exc
            return _FailingPending(pending, self.exc)
        return pending

    def __getattr__(self, name):
        return getattr(self.inner, name)


class _FailingPending:
    def __init__(self, pending, exc):
        self.plan, self._exc = pending.plan, exc

    def result(self):
        raise self._exc


@pytest.mark.parametrize("async_mode", [False, True])
@pytest.mark.parametrize("where, exc", [("execute", RuntimeError("CUDA error: injected")),
                                        ("result", KeyboardInterrupt()),
                                        ("execute", torch.OutOfMemoryError("injected OOM"))])
def test_a_failed_step_is_rolled_back_and_online_requests_finish_exactly(hf, async_mode, where, exc):
    prompts = random_prompts(3, hf.config.vocab_size, seed=11)
    want = make_engine(hf, block_size=4, async_mode=async_mode).generate(prompts, _params())
    eng = make_engine(hf, block_size=4, async_mode=async_mode)
    eng.runner = FailingRunner(eng.runner, fail_at=6, where=where, exc=exc)
    rids = [eng.add_request(p, sp) for p, sp in zip(prompts, _params())]
    done = {}
    with pytest.raises(type(exc)):
        for _ in range(100):
            done.update((o.request_id, o) for o in eng.step())
    assert eng.get_stats().num_failed_steps == 1
    for _ in range(200):  # bounded: the engine must make progress after the fault
        done.update((o.request_id, o) for o in eng.step())
        if not eng.has_unfinished_requests():
            break
    _assert_same([done[r] for r in rids], want)
    assert eng.block_manager.num_free_blocks == eng.num_blocks
    for p, o, sp in zip(prompts, (done[r] for r in rids), _params()):
        for c in o.outputs:
            assert_matches_hf(hf, p, c, temperature=sp.temperature)


@pytest.mark.parametrize("async_mode", [False, True])
def test_after_a_failed_generate_the_next_equals_a_fresh_engine(hf, async_mode):
    prompts = random_prompts(4, hf.config.vocab_size, seed=12)
    params = _params() + [_params()[0]]
    eng = make_engine(hf, block_size=4, async_mode=async_mode)
    inner = eng.runner
    eng.runner = FailingRunner(inner, fail_at=4, where="execute", exc=KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        eng.generate(prompts, params)
    assert not eng.has_unfinished_requests()  # the failed call's requests were aborted
    eng.runner = inner
    _assert_same(eng.generate(prompts, params), make_engine(hf, block_size=4).generate(prompts, params))


def test_generate_while_asleep_says_so_and_the_engine_recovers(hf):
    eng = make_engine(hf, block_size=8)
    prompts = random_prompts(2, hf.config.vocab_size, seed=13)
    want = eng.generate(prompts, _params()[:2])
    eng.sleep()
    with pytest.raises(RuntimeError, match="asleep"):
        eng.generate(prompts, _params()[:2])
    assert not eng.has_unfinished_requests()
    eng.wake_up()
    _assert_same(eng.generate(prompts, _params()[:2]), want)
    assert eng.sleep() > 0  # and it can sleep again
    eng.wake_up()


@pytest.mark.parametrize("engine_dtype, sent_dtype, value", [("float16", torch.float32, 1e6),
                                                             ("float32", torch.float64, 1e300)])
def test_values_that_overflow_the_engine_dtype_are_refused(hf, engine_dtype, sent_dtype, value):
    eng = Engine.from_pretrained(hf, dtype=engine_dtype, device="cpu", max_model_len=64)
    prompts = random_prompts(2, hf.config.vocab_size, seed=14)
    before = eng.generate(prompts, _params()[2])
    bad = {n: p.detach().to(sent_dtype) for n, p in hf.named_parameters()}
    name = next(iter(bad))
    bad[name] = torch.full_like(bad[name], value)
    with pytest.raises(ValueError, match=name):
        eng.update_weights(bad)
    assert eng.policy_version == 0
    after = eng.generate(prompts, _params()[2])
    assert _results(after) == _results(before)
    assert all(torch.isfinite(torch.tensor(c.logprobs)).all() for o in after for c in o.outputs)


def _run_threads(targets):
    threads = [threading.Thread(target=t, daemon=True) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S)
    assert not any(t.is_alive() for t in threads), "a caller hung"


@pytest.mark.parametrize("async_mode", [False, True])
def test_concurrent_generate_calls_each_get_their_own_outputs(hf, async_mode):
    eng = make_engine(hf, block_size=4, async_mode=async_mode, max_num_seqs=4)
    groups = [random_prompts(3, hf.config.vocab_size, seed=20 + i) for i in range(4)]
    want = [make_engine(hf, block_size=4).generate(g, _params()) for g in groups]
    got, errors = [None] * len(groups), []

    def caller(i):
        def run():
            try:
                got[i] = eng.generate(groups[i], _params())
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)
        return run

    _run_threads([caller(i) for i in range(len(groups))])
    assert not errors, errors
    for g, w in zip(got, want):
        _assert_same(g, w)


@pytest.mark.parametrize("async_mode", [False, True])
def test_generate_beside_a_thread_calling_step(hf, async_mode):
    eng = make_engine(hf, block_size=4, async_mode=async_mode)
    mine = random_prompts(3, hf.config.vocab_size, seed=30)
    online = random_prompts(3, hf.config.vocab_size, seed=31)
    rids = [eng.add_request(p, sp) for p, sp in zip(online, _params())]
    stepped, got, stop = {}, [], threading.Event()

    def stepper():
        while not stop.is_set() and len(stepped) < len(rids):
            stepped.update((o.request_id, o) for o in eng.step())

    def generator():
        got.append(eng.generate(mine, _params()))
        stop.set() if len(stepped) == len(rids) else None

    _run_threads([stepper, generator])
    fresh = make_engine(hf, block_size=4)
    _assert_same(got[0], fresh.generate(mine, _params()))
    assert sorted(stepped) == sorted(rids)  # the stepper got every online output, and only those
    _assert_same([stepped[r] for r in rids], fresh.generate(online, _params()))


def test_bad_values_are_refused_up_front(hf):
    eng = make_engine(hf, block_size=8)  # built from a PreTrainedModel: no tokenizer
    with pytest.raises(ValueError, match="stop strings"):
        eng.generate([[1, 2, 3]], SamplingParams(stop=["\n"]))
    with pytest.raises(ValueError, match="stop strings"):
        eng.add_request([1, 2, 3], SamplingParams(stop="x"))
    for name in ("temperature", "top_p", "min_p"):
        with pytest.raises(ValueError, match=name):
            SamplingParams(**{name: float("inf")})
    with pytest.raises(ValueError, match="cpu_kv_cache_gib"):
        make_engine(hf, cpu_kv_cache_gib=float("inf"))
    with pytest.raises(ValueError, match="needs a CUDA device"):
        make_engine(hf, attention_backend="triton")
    for name in ("async_mode", "cuda_graphs", "enable_prefix_caching"):
        with pytest.raises(TypeError, match=name):
            make_engine(hf, **{name: "maybe"})
    with pytest.raises(TypeError, match="request_id"):
        eng.add_request([1, 2], SamplingParams(), request_id=7)
    assert not eng.has_unfinished_requests()
    assert eng.generate([[1, 2, 3]], _params()[2])[0].outputs[0].finish_reason == "length"


def test_a_failed_construction_frees_its_weights_while_the_exception_lives(hf):
    """A construction that fails after the weights are loaded (here a max_model_len above the model's limit; on
    a GPU a ``KVCacheTooLarge``) must not keep its copy of the weights alive through the exception's traceback:
    a retry inside the ``except`` block (with the ``num_blocks`` the error names) would otherwise not fit."""
    limit = hf.config.max_position_embeddings
    try:
        Engine.from_pretrained(hf, dtype="float32", device="cpu", max_model_len=limit + 1)
    except ValueError as err:
        assert "max_model_len" in str(err)
        held = []
        tb = err.__traceback__
        while tb is not None:  # every model the traceback's frames still reach
            held += [v for v in tb.tb_frame.f_locals.values() if isinstance(v, torch.nn.Module)]
            tb = tb.tb_next
        ours = [m for m in held if m is not hf]
        assert ours, "the traceback no longer reaches the engine's model: this test lost its subject"
        for m in ours:
            live = [n for n, t in m.state_dict().items() if t.device.type != "meta"]
            assert not live, f"a failed construction still holds {len(live)} weight tensors, e.g. {live[:3]}"
        # the source model is the caller's: untouched
        assert all(p.device.type == "cpu" for p in hf.parameters())
        engine = Engine.from_pretrained(hf, dtype="float32", device="cpu", max_model_len=limit)
        assert engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2, ignore_eos=True))[0].outputs
    else:
        pytest.fail("max_model_len above the model's limit was accepted")
