"""Continuous batching must not change results: alone == in a crowd, across preemption, prefix
sharing, chunked prefill and async mode (float32, CPU)."""

from rollout import SamplingParams
from tests.engine_helpers import assert_matches_hf, greedy, make_engine, random_prompts
from tests.tiny_models import make_tiny_hf_model


def _tokens(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


def test_crowd_with_preemption_equals_alone():
    hf = make_tiny_hf_model("llama")
    prompts = random_prompts(10, hf.config.vocab_size, lo=5, hi=60, seed=5)
    params = [SamplingParams(temperature=0.9, max_tokens=6 + 3 * (i % 4), seed=100 + i, ignore_eos=True)
              for i in range(len(prompts))]
    alone = make_engine(hf, block_size=8)
    ref = [alone.generate([p], [sp])[0] for p, sp in zip(prompts, params)]
    # tight enough that the crowd still preempts past the admission watermark
    crowd = make_engine(hf, block_size=8, max_num_seqs=4, num_blocks=20, max_num_batched_tokens=64)
    outs = crowd.generate(prompts, params)
    assert crowd.get_stats().num_preemptions > 0
    assert _tokens(outs) == _tokens(ref)
    for p, o in zip(prompts, outs):
        assert_matches_hf(hf, p, o.outputs[0], temperature=0.9)
    assert crowd.block_manager.num_free_blocks == crowd.num_blocks


def test_n_samples_share_prompt_blocks():
    hf = make_tiny_hf_model("qwen3")
    prompt = random_prompts(1, hf.config.vocab_size, lo=40, hi=41, seed=6)[0]
    engine = make_engine(hf, block_size=8)
    engine.add_request(prompt, greedy(4, n=4))
    peak = 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        peak = max(peak, engine.num_blocks - engine.block_manager.num_free_blocks)
    # 40 prompt tokens = 5 full blocks; 4 are shared, each child copies the 5th on write (it recomputes
    # the last prompt token) and every sample gets one block for its outputs: 5 + 1 + 3 * 2, not 4 * 6
    assert peak == 12, peak
    out = outs[0]
    single = make_engine(hf, block_size=8).generate([prompt], greedy(4))[0].outputs[0].token_ids
    assert all(c.token_ids == single for c in out.outputs)


def test_prefix_cache_hits_and_no_change():
    hf = make_tiny_hf_model("llama")
    prefix = random_prompts(1, hf.config.vocab_size, lo=33, hi=34, seed=7)[0]
    prompts = [prefix + [i + 1, i + 2] for i in range(3)]
    cached = make_engine(hf, block_size=8)
    first = cached.generate(prompts[:1], greedy(5))
    computed_before = cached.get_stats().num_prompt_tokens
    rest = cached.generate(prompts[1:], greedy(5))
    computed = cached.get_stats().num_prompt_tokens - computed_before
    assert computed < 2 * len(prompts[1]) - 2 * 32 + 4  # the 4 shared full blocks were not recomputed
    plain = make_engine(hf, block_size=8, enable_prefix_caching=False).generate(prompts, greedy(5))
    assert _tokens(first + rest) == _tokens(plain)


def test_chunked_prefill_changes_nothing():
    hf = make_tiny_hf_model("qwen2")
    prompts = random_prompts(3, hf.config.vocab_size, lo=50, hi=90, seed=8)
    big = make_engine(hf, block_size=8).generate(prompts, greedy(6))
    small_engine = make_engine(hf, block_size=8, max_num_batched_tokens=16)
    small = small_engine.generate(prompts, greedy(6))
    assert _tokens(big) == _tokens(small)
    assert small_engine.get_stats().num_steps > 90 // 16


def test_seeds_reproduce_and_differ():
    hf = make_tiny_hf_model("llama")
    prompt = random_prompts(1, hf.config.vocab_size, seed=9)[0]
    engine = make_engine(hf)
    sp = SamplingParams(temperature=1.0, max_tokens=12, seed=42, ignore_eos=True)
    a = engine.generate([prompt], sp)[0].outputs[0].token_ids
    crowd = engine.generate([prompt] + random_prompts(5, hf.config.vocab_size, seed=10),
                            [sp] + [SamplingParams(max_tokens=5)] * 5)
    assert crowd[0].outputs[0].token_ids == a
    b = engine.generate([prompt], SamplingParams(temperature=1.0, max_tokens=12, seed=43, ignore_eos=True))
    assert b[0].outputs[0].token_ids != a


def test_async_mode_matches_sync_and_late_stop_never_leaks():
    hf = make_tiny_hf_model("llama")
    prompts = random_prompts(5, hf.config.vocab_size, seed=11)
    sync = make_engine(hf, async_mode=False).generate(prompts, greedy(12))
    asy_engine = make_engine(hf, async_mode=True)
    assert _tokens(asy_engine.generate(prompts, greedy(12))) == _tokens(sync)
    # stop on the 4th token of each sync output: async sees it one step late and must drop the extra
    params = [greedy(12, stop_token_ids=[o.outputs[0].token_ids[3]]) for o in sync]
    for o, ref in zip(asy_engine.generate(prompts, params), sync):
        c, r = o.outputs[0], ref.outputs[0].token_ids
        cut = r.index(r[3]) + 1
        assert c.token_ids == r[:cut] and c.finish_reason == "stop" and c.stop_reason == r[3]
        assert len(c.logprobs) == cut == len(c.policy_versions)
    assert asy_engine.block_manager.num_free_blocks == asy_engine.num_blocks
