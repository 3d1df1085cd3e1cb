"""Public API behaviour: stops, online use, weight updates and every bad input (the engine keeps serving)."""

import pytest
import torch

from rollout import Engine, SamplingParams
from tests.engine_helpers import assert_matches_hf, greedy, make_engine, random_prompts
from tests.tiny_models import make_tiny_hf_model


@pytest.fixture(scope="module")
def hf():
    return make_tiny_hf_model("llama")


@pytest.fixture()
def engine(hf):
    return make_engine(hf, block_size=8)


def test_empty_prompt_list(engine):
    assert engine.generate([], greedy()) == []


@pytest.mark.parametrize(
    "prompt, err",
    [([], ValueError), ([1, 2.5], TypeError), ([1, -1], ValueError), ([1, 10**6], ValueError),
     ("hello", ValueError), (3, TypeError), ([1] * 300, ValueError)],
)
def test_bad_prompt_is_refused_and_engine_keeps_serving(engine, hf, prompt, err):
    good = random_prompts(2, hf.config.vocab_size, seed=1)
    with pytest.raises(err):
        engine.generate([good[0], prompt], greedy())
    assert not engine.has_unfinished_requests()  # nothing half-queued
    out = engine.generate(good, greedy())
    assert len(out) == 2 and all(len(o.outputs[0].token_ids) == 8 for o in out)


@pytest.mark.parametrize(
    "kwargs, err",
    [(dict(temperature=-0.1), ValueError), (dict(top_p=0.0), ValueError), (dict(top_p=1.5), ValueError),
     (dict(top_k=-2), ValueError), (dict(min_p=1.5), ValueError), (dict(n=0), ValueError),
     (dict(max_tokens=0), ValueError), (dict(min_tokens=5, max_tokens=3), ValueError),
     (dict(temperature="hot"), TypeError), (dict(logprobs_mode="nope"), ValueError)],
)
def test_bad_sampling_params(kwargs, err):
    with pytest.raises(err) as info:
        SamplingParams(**kwargs)
    assert any(k in str(info.value) for k in kwargs)


def test_params_list_length_mismatch_and_too_long(engine, hf):
    prompts = random_prompts(3, hf.config.vocab_size, seed=2)
    with pytest.raises(ValueError, match="3 prompts"):
        engine.generate(prompts, [greedy()] * 2)
    with pytest.raises(ValueError, match="max_model_len"):
        engine.generate(prompts[:1], greedy(max_tokens=250))


def test_finish_reasons_min_tokens_and_eos(hf):
    eos = 5
    hf.generation_config.eos_token_id = eos
    engine = make_engine(hf)
    prompt = random_prompts(1, hf.config.vocab_size, seed=3)[0]
    ref = engine.generate([prompt], greedy(6))[0].outputs[0]
    # make the 3rd greedy token an EOS: the engine stops there unless ignore_eos / min_tokens
    engine.eos_ids = frozenset({ref.token_ids[2]})
    stopped = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=6))[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.token_ids == ref.token_ids[:3]
    kept = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0].outputs[0]
    assert kept.finish_reason == "length" and kept.token_ids == ref.token_ids
    late = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=6, min_tokens=5))[0].outputs[0]
    assert ref.token_ids[2] not in late.token_ids[:5]
    assert_matches_hf(hf, prompt, late, temperature=1.0)  # policy logprobs are unmasked log softmax


def test_online_add_step_abort(engine, hf):
    prompts = random_prompts(3, hf.config.vocab_size, seed=4)
    ids = [engine.add_request(p, greedy(30)) for p in prompts]
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request(prompts[0], greedy(), request_id=ids[0])
    engine.step()
    engine.abort(ids[1])
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = out
    assert done[ids[1]].outputs[0].finish_reason == "abort"
    assert done[ids[0]].outputs[0].finish_reason == "length" and len(done[ids[0]].outputs[0].token_ids) == 30
    assert engine.block_manager.num_free_blocks == engine.num_blocks


def test_update_weights_all_or_nothing_and_follows_new_model(hf):
    engine = make_engine(hf)
    prompt = random_prompts(1, hf.config.vocab_size, seed=5)[0]
    before = engine.generate([prompt], greedy(6))[0].outputs[0]
    names = dict(hf.named_parameters())
    good_name = "model.layers.0.mlp.down_proj.weight"
    bad_cases = [
        [(good_name, torch.zeros_like(names[good_name])), ("model.nope.weight", torch.zeros(3))],
        [(good_name, torch.zeros_like(names[good_name])), ("model.norm.weight", torch.zeros(7))],
        [(good_name, torch.full_like(names[good_name], float("nan")))],
    ]
    for bad in bad_cases:
        with pytest.raises((ValueError, KeyError, TypeError)) as info:
            engine.update_weights(bad)
        assert bad[-1][0] in str(info.value)
        assert engine.policy_version == 0
        assert engine.generate([prompt], greedy(6))[0].outputs[0].token_ids == before.token_ids
    new = make_tiny_hf_model("llama", seed=123)
    assert engine.update_weights(new.named_parameters()) == 1
    after = engine.generate([prompt], greedy(6))[0].outputs[0]
    assert after.policy_versions == [1] * 6
    assert_matches_hf(new, prompt, after)
    assert engine.update_weights(new.named_parameters(), version=7) == 7 and engine.policy_version == 7
    for empty in ([], {}):  # an empty update is a caller's bug, never a silent version bump
        with pytest.raises(ValueError, match="no tensors"):
            engine.update_weights(empty)
    with pytest.raises(ValueError, match=r"version must be an int in \[7, 2\*\*63\)"):
        engine.update_weights(new.named_parameters(), version=-1)
    assert engine.policy_version == 7


def test_unknown_engine_option_and_unsupported_model(hf):
    with pytest.raises(TypeError, match="max_num_seq"):
        Engine.from_pretrained(hf, device="cpu", max_num_seq=3)
    with pytest.raises(ValueError, match="block_size"):
        Engine.from_pretrained(hf, device="cpu", block_size=12)
    with pytest.raises(ValueError, match="dtype"):
        Engine.from_pretrained(hf, device="cpu", dtype="float64")
    with pytest.raises(ValueError, match="max_model_len 100000"):
        Engine.from_pretrained(hf, device="cpu", max_model_len=100_000)
    with pytest.raises(ValueError, match="attention_backend"):
        Engine.from_pretrained(hf, device="cpu", attention_backend="xformers")


def test_backend_choice():
    from rollout.layers.backends import flash_attn_available, resolve_attention

    assert resolve_attention("auto", torch.device("cpu")).build().name == "torch"
    if not flash_attn_available():
        with pytest.raises(ValueError, match="flash-attn"):
            resolve_attention("flash_attn", torch.device("cpu"))


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_wake_gives_identical_results(hf, level):
    engine = make_engine(hf)
    prompts = random_prompts(3, hf.config.vocab_size, seed=6)
    before = engine.generate(prompts, greedy(8))
    assert engine.sleep(level=level) > 0 and engine.is_sleeping
    engine.wake_up()
    after = engine.generate(prompts, greedy(8))
    assert [o.outputs[0].token_ids for o in after] == [o.outputs[0].token_ids for o in before]
    with pytest.raises(ValueError, match="level"):
        engine.sleep(level=3)


def test_stats_count_steps_tokens_and_bytes(hf):
    engine = make_engine(hf, block_size=8)
    prompts = random_prompts(3, hf.config.vocab_size, seed=7)
    engine.generate(prompts, greedy(5))
    st = engine.get_stats()
    assert st.num_generated_tokens == 15 and st.num_prompt_tokens == sum(len(p) for p in prompts)
    assert st.num_steps >= 5 and st.num_running_seqs == 0 and st.gpu_busy_frac is None
    weights = engine.model.weight_bytes_per_step()
    emb = engine.model.model.embed_tokens.weight
    assert weights == sum(p.numel() * p.element_size() for p in engine.model.parameters()) - emb.numel() * 4
    assert st.bytes_read > st.num_steps * weights  # weights every step, plus the live KV


def test_partial_output_streams_known_tokens_only(hf):
    eng = make_engine(hf, block_size=8, async_mode=True)
    rid = eng.add_request([1, 2, 3], SamplingParams(max_tokens=6, ignore_eos=True, temperature=0))
    seen = []
    while eng.has_unfinished_requests():
        done = eng.step()
        part = eng.partial_output(rid)
        if part is not None:
            assert not part.finished and -1 not in part.outputs[0].token_ids
            assert len(part.outputs[0].token_ids) == len(part.outputs[0].logprobs)
            seen.append(list(part.outputs[0].token_ids))
        for out in done:
            assert out.request_id == rid and out.finished
            final = out.outputs[0].token_ids
    assert eng.partial_output(rid) is None and seen and all(final[: len(s)] == s for s in seen)
