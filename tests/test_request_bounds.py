"""Every value is bounded where it enters: SamplingParams' own ranges, then the model's (vocabulary, length)."""

import pytest

from rollout import SamplingParams
from rollout.engine.async_engine import AsyncEngine
from rollout.sampling_params import MAX_N, MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS
from tests.engine_helpers import greedy, make_engine, random_prompts
from tests.tiny_models import make_tiny_hf_model


@pytest.fixture(scope="module")
def hf():
    return make_tiny_hf_model("llama")


@pytest.fixture(scope="module")
def engine(hf):
    return make_engine(hf, block_size=8)


@pytest.mark.parametrize("kwargs, named", [
    (dict(top_k=2**63), "top_k"), (dict(top_k=-2), "top_k"), (dict(seed=-1), "seed"), (dict(seed=2**64), "seed"),
    (dict(n=MAX_N + 1), "n"), (dict(max_tokens=2**31), "max_tokens"), (dict(min_tokens=2**63), "min_tokens"),
    (dict(stop_token_ids=[2**63]), "stop_token_ids"), (dict(stop_token_ids=[1] * (MAX_STOP_TOKEN_IDS + 1)),
                                                        "stop_token_ids"),
    (dict(stop=["x"] * (MAX_STOP_STRINGS + 1)), "stop"), (dict(stop="x" * (MAX_STOP_CHARS + 1)), "stop"),
])
def test_out_of_range_values_are_refused_naming_field_and_range(kwargs, named):
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    message = str(info.value)
    assert named in message and ("allowed" in message or "must be" in message), message


def test_edges_of_each_range_are_accepted():
    SamplingParams(seed=0)
    SamplingParams(seed=2**64 - 1)
    SamplingParams(top_k=-1, n=MAX_N, stop=["x" * MAX_STOP_CHARS] * MAX_STOP_STRINGS)


@pytest.mark.parametrize("make", [
    lambda v: greedy(top_k=2**31 - 1), lambda v: greedy(top_k=v + 1), lambda v: greedy(stop_token_ids=[v]),
])
def test_engine_refuses_beyond_its_vocabulary_and_keeps_serving(engine, hf, make):
    vocab = hf.config.vocab_size
    good = random_prompts(2, vocab, seed=1)
    with pytest.raises(ValueError, match=str(vocab)):
        engine.generate(good, make(vocab))
    assert not engine.has_unfinished_requests()
    out = engine.generate(good, greedy(top_k=vocab))  # the whole vocabulary is still a valid top_k
    assert all(len(o.outputs[0].token_ids) == 8 for o in out)


def test_top_k_past_int64_never_reaches_a_step(engine, hf):
    """Was: top_k >= 2**63 passed every check, overflowed int64 in the step and killed the engine loop."""
    prompt = random_prompts(1, hf.config.vocab_size, seed=2)[0]
    params = greedy()
    params.top_k = 2**63  # set after construction: generate validates again
    with pytest.raises(ValueError, match="top_k"):
        engine.generate([prompt], params)
    loop = AsyncEngine(engine).start()
    try:
        bad = loop.submit(prompt, params)
        with pytest.raises(ValueError, match="top_k"):
            bad.result(timeout=60)
        assert len(loop.submit(prompt, greedy()).result(timeout=60).outputs[0].token_ids) == 8
    finally:
        loop.close()


def test_seeds_across_the_whole_range_give_the_results_they_gave(engine, hf):
    """In-range seeds are used as before (reduced to 63 bits), so a seed >= 2**63 matches seed - 2**63."""
    prompt = random_prompts(1, hf.config.vocab_size, seed=3)[0]
    sample = lambda seed: engine.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True, seed=seed,
                                                                   n=2))[0]
    high, low = sample(2**63 + 12345), sample(12345)
    assert [c.token_ids for c in high.outputs] == [c.token_ids for c in low.outputs]


def test_the_job_refuses_them_at_its_config():
    from rollout.settings.schema import SamplingConfig

    with pytest.raises(ValueError, match=r"sampling.top_k=9223372036854775808 is invalid"):
        SamplingConfig(top_k=2**63)
    with pytest.raises(ValueError, match="stop has 65 strings"):
        SamplingConfig(stop=("x",) * 65).to_params()  # the job calls this before it starts
