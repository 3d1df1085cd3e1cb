"""vLLM's extra sampling fields on the engine: validation, top / prompt logprobs, penalties, scoring,
priority, prompt truncation, stop strings in the output, special tokens, min_tokens. CPU, float32, tiny
models, against Hugging Face's logits (teacher-forced) or a plain loop over them."""

from __future__ import annotations

import pytest
import torch

from rollout import Engine, SamplingParams
from tests.engine_helpers import hf_logprobs, make_engine, random_prompts
from tests.tiny_models import make_tiny_hf_model


@pytest.fixture(scope="module")
def hf():
    return make_tiny_hf_model("llama")


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def engine(hf, request):
    return make_engine(hf, block_size=8, async_mode=request.param)


@pytest.mark.parametrize("kwargs, field", [
    (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(repetition_penalty=-1.0), "repetition_penalty"),
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=-2.01), "frequency_penalty"),
    (dict(logprobs=21), "logprobs"), (dict(logprobs=-1), "logprobs"), (dict(prompt_logprobs=21), "prompt_logprobs"),
    (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
    (dict(presence_penalty=float("nan")), "presence_penalty"),
])  # fmt: skip
def test_new_fields_refused_with_their_name(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)
    with pytest.raises(TypeError, match="skip_special_tokens"):
        SamplingParams(skip_special_tokens="no")


def test_priority_refused_with_its_name(engine):
    with pytest.raises(TypeError, match="priority"):
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=2), priority="high")
    with pytest.raises(ValueError, match="priority"):
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=2), priority=1 << 64)


def test_top_logprobs_match_hf(engine, hf):
    prompts = random_prompts(3, hf.config.vocab_size, seed=1)
    for sp in (SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5),
               SamplingParams(temperature=0.8, seed=4, max_tokens=6, ignore_eos=True, logprobs=5)):
        outs = engine.generate(prompts, sp)
        for prompt, out in zip(prompts, outs):
            c = out.outputs[0]
            ref = hf_logprobs(hf, prompt, c.token_ids, sp.temperature or 1.0)
            assert len(c.top_logprobs) == len(c.token_ids)
            for i, top in enumerate(c.top_logprobs):
                assert len(top) == 5
                ids = [t for t, _ in top]
                vals = torch.tensor([v for _, v in top])
                assert ids[0] == int(ref[i].argmax())
                assert torch.allclose(vals, ref[i][ids], atol=1e-4)
                assert bool((vals[:-1] >= vals[1:]).all())
                want, want_ids = ref[i].topk(5)
                assert torch.allclose(vals, want, atol=1e-4)
                if c.token_ids[i] in ids:  # the sampled token's logprob comes from the same distribution
                    assert abs(dict(top)[c.token_ids[i]] - c.logprobs[i]) <= 1e-4
    plain = engine.generate(prompts[:1], SamplingParams(max_tokens=3, seed=1))[0].outputs[0]
    assert plain.top_logprobs is None
    zero = engine.generate(prompts[:1], SamplingParams(max_tokens=3, seed=1, logprobs=0))[0].outputs[0]
    assert zero.top_logprobs == [[], [], []] and zero.token_ids == plain.token_ids


def test_processed_top_logprobs_are_the_sampled_distribution(engine, hf):
    prompt = random_prompts(1, hf.config.vocab_size, seed=2)[0]
    sp = SamplingParams(temperature=1.0, top_k=3, seed=5, max_tokens=4, ignore_eos=True, logprobs=5,
                        logprobs_mode="processed")
    c = engine.generate([prompt], sp)[0].outputs[0]
    for tok, lp, top in zip(c.token_ids, c.logprobs, c.top_logprobs):
        kept = [v for _, v in top if v > float("-inf")]
        assert len(kept) == 3 and abs(torch.tensor(kept).exp().sum().item() - 1) < 1e-5
        assert abs(dict(top)[tok] - lp) <= 1e-5


def test_partial_output_deltas_carry_top_logprobs(hf):
    eng = make_engine(hf, block_size=8, async_mode=True)
    rid = eng.add_request([3, 4, 5, 6], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2))
    seen, tops = [0], []
    while eng.has_unfinished_requests():
        eng.step()
        part = eng.partial_output(rid, since=seen)
        if part is None:
            break
        c = part.outputs[0]
        assert len(c.top_logprobs) == len(c.token_ids)
        tops += c.top_logprobs
        seen[0] += len(c.token_ids)
    full = eng.generate([[3, 4, 5, 6]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2))
    assert tops == full[0].outputs[0].top_logprobs[: len(tops)] and len(tops) >= 4


def test_prompt_logprobs_match_hf(engine, hf):
    prompt = random_prompts(1, hf.config.vocab_size, lo=20, hi=30, seed=3)[0]
    out = engine.generate([prompt], SamplingParams(max_tokens=2, prompt_logprobs=3, seed=0))[0]
    ref = hf_logprobs(hf, prompt[:1], prompt[1:])
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    got = torch.tensor(out.prompt_logprobs[1:])
    assert torch.allclose(got, ref[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])], atol=1e-4)
    for i, top in enumerate(out.prompt_top_logprobs[1:]):
        assert len(top) == 3 and top[0][0] == int(ref[i].argmax())


def _hf_greedy_with_penalties(hf, prompt, n, rep, pres, freq):
    """The oracle: HF logits, vLLM's penalties written out plainly, argmax."""
    ids = list(prompt)
    out = []
    for _ in range(n):
        with torch.no_grad():
            x = hf(torch.tensor([ids])).logits[0, -1].float()
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=x.numel()).float() if out else \
            torch.zeros_like(x)
        seen = torch.zeros_like(x, dtype=torch.bool)
        seen[torch.tensor(ids)] = True
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
        x = x - freq * counts - pres * (counts > 0).float()
        t = int(x.argmax())
        out.append(t)
        ids.append(t)
    return out


def test_penalties_follow_a_plain_loop_over_hf_logits(engine, hf):
    prompts = random_prompts(3, hf.config.vocab_size, seed=5)
    settings = [(1.5, 0.0, 0.0), (1.0, 1.0, 0.5), (1.2, -0.5, 1.5)]
    params = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, repetition_penalty=r,
                             presence_penalty=p, frequency_penalty=f) for r, p, f in settings]
    plain = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outs = engine.generate(prompts + [prompts[0]], params + [plain])  # a row without penalties in the batch
    for prompt, (r, p, f), out in zip(prompts, settings, outs):
        assert out.outputs[0].token_ids == _hf_greedy_with_penalties(hf, prompt, 10, r, p, f)
    assert outs[3].outputs[0].token_ids == _hf_greedy_with_penalties(hf, prompts[0], 10, 1.0, 0.0, 0.0)
    alone = engine.generate([prompts[2]], params[2])[0].outputs[0]
    assert alone.token_ids == outs[2].outputs[0].token_ids
    assert torch.allclose(torch.tensor(alone.logprobs), torch.tensor(outs[2].outputs[0].logprobs), atol=1e-5)


def test_penalties_survive_preemption(hf):
    """Few KV blocks: sequences are preempted and recomputed; their counts are rebuilt from their tokens."""
    prompts = random_prompts(4, hf.config.vocab_size, lo=10, hi=14, seed=6)
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, repetition_penalty=1.4, frequency_penalty=0.7)
    roomy = make_engine(hf, block_size=4).generate(prompts, sp)
    tight = make_engine(hf, block_size=4, num_blocks=24, async_mode=True)
    outs = tight.generate(prompts, sp)
    assert tight.get_stats().num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in roomy]


@pytest.mark.parametrize("sp", [
    SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
    SamplingParams(temperature=0.7, seed=3, max_tokens=8, ignore_eos=True),
    SamplingParams(temperature=1.0, seed=4, top_k=20, top_p=0.9, max_tokens=8, ignore_eos=True,
                   logprobs_mode="processed"),
    SamplingParams(temperature=0.9, seed=5, max_tokens=8, ignore_eos=True, logprobs_mode="raw"),
], ids=["greedy", "policy", "processed", "raw"])  # fmt: skip
def test_score_gives_back_the_generations_logprobs(engine, hf, sp):
    prompts = random_prompts(3, hf.config.vocab_size, seed=7)
    outs = engine.generate(prompts, sp)
    seqs = [p + o.outputs[0].token_ids for p, o in zip(prompts, outs)]
    scored = engine.score(seqs, top_logprobs=2, sampling_params=sp)
    for p, o, s in zip(prompts, outs, scored):
        got = torch.tensor(s.prompt_logprobs[len(p):])
        assert torch.allclose(got, torch.tensor(o.outputs[0].logprobs), atol=1e-4), (got, o.outputs[0].logprobs)
        assert s.prompt_logprobs[0] is None and len(s.prompt_top_logprobs[1]) == 2 and s.outputs == []


def test_score_start_and_prefix_cache(hf):
    eng = make_engine(hf, block_size=4)
    seq = random_prompts(1, hf.config.vocab_size, lo=30, hi=31, seed=8)[0]
    full = eng.score([seq])[0].prompt_logprobs
    before = eng.get_stats().num_prefix_cached_tokens
    tail = eng.score([seq], logprob_start_len=20)[0].prompt_logprobs
    assert eng.get_stats().num_prefix_cached_tokens - before >= 16  # the blocks before token 19 were reused
    assert tail[:20] == [None] * 20
    assert torch.allclose(torch.tensor(tail[20:]), torch.tensor(full[20:]), atol=1e-5)
    assert eng.score([[7]])[0].prompt_logprobs == [None]
    with pytest.raises(ValueError, match="logprob_start_len"):
        eng.score([seq], logprob_start_len=-1)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        eng.score([seq], top_logprobs=21)
    with pytest.raises(ValueError, match="sequence 0"):
        eng.score([list(range(300))])


def test_priority_orders_the_waiting_queue(hf):
    eng = make_engine(hf, max_num_seqs=1)
    sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    order = []
    for name, prio in (("a", 0), ("b", 5), ("c", -1), ("d", 0), ("e", -1)):
        eng.add_request([1, 2, 3], sp, request_id=name, priority=prio)
    while eng.has_unfinished_requests():
        order += [o.request_id for o in eng.step()]
    assert order == ["c", "e", "a", "d", "b"]  # lower first, FCFS among equals


def test_truncate_prompt_tokens_keeps_the_last_k(engine, hf):
    prompt = random_prompts(1, hf.config.vocab_size, lo=20, hi=21, seed=9)[0]
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    cut = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True,
                                                   truncate_prompt_tokens=7))[0]
    ref = engine.generate([prompt[-7:]], sp)[0]
    assert cut.prompt_token_ids == prompt[-7:] and cut.outputs[0].token_ids == ref.outputs[0].token_ids
    long = engine.generate([prompt], SamplingParams(max_tokens=2, truncate_prompt_tokens=100, seed=1))[0]
    assert long.prompt_token_ids == prompt
    with pytest.raises(ValueError, match="max_model_len"):
        engine.generate([list(range(3)) * 100], SamplingParams(max_tokens=2))
    ok = engine.generate([list(range(3)) * 100], SamplingParams(max_tokens=2, truncate_prompt_tokens=50))[0]
    assert len(ok.prompt_token_ids) == 50


@pytest.fixture(scope="module")
def text_engine():
    from transformers import AutoTokenizer

    from rollout.assets import assets_dir

    tok = AutoTokenizer.from_pretrained(str(assets_dir()))
    hf = make_tiny_hf_model("llama", vocab_size=len(tok))
    return Engine.from_pretrained(hf, dtype="float32", device="cpu", tokenizer=tok, max_model_len=256)


def _stop_of(engine, prompt, start, n=24):
    free = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0].outputs[0]
    stop = engine.tokenizer.decode(free.token_ids[start : start + 2], skip_special_tokens=False).strip()
    if not stop:
        pytest.skip("greedy tokens decode to whitespace on this random model")
    return free, stop


def test_include_stop_str_in_output(text_engine):
    free, stop = _stop_of(text_engine, "What is 3 + 4?", 4)
    base = dict(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop])
    cut = text_engine.generate(["What is 3 + 4?"], SamplingParams(**base))[0].outputs[0]
    kept = text_engine.generate(["What is 3 + 4?"], SamplingParams(**base, include_stop_str_in_output=True))[0]
    kept = kept.outputs[0]
    assert kept.token_ids == cut.token_ids and kept.stop_reason == stop
    assert kept.text == cut.text + stop and kept.text.endswith(stop)


def test_min_tokens_blocks_stop_strings_and_stop_ids(text_engine):
    free, stop = _stop_of(text_engine, "What is 5 + 1?", 1)
    base = dict(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop])
    early = text_engine.generate(["What is 5 + 1?"], SamplingParams(**base))[0].outputs[0]
    late = text_engine.generate(["What is 5 + 1?"], SamplingParams(**base, min_tokens=12))[0].outputs[0]
    assert len(early.token_ids) <= 3 and (len(late.token_ids) >= 12 or late.finish_reason == "length")
    assert late.token_ids[: len(early.token_ids)] == early.token_ids  # the early match did not stop it
    if late.finish_reason == "stop":
        assert late.text.endswith("") and stop not in late.text[len(late.text) - len(stop):]
    tok = free.token_ids[2]
    ids = text_engine.generate(["What is 5 + 1?"], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                                                 stop_token_ids=[tok], min_tokens=6))[0].outputs[0]
    assert tok not in ids.token_ids[:6] and len(ids.token_ids) >= 6


def test_skip_and_space_special_tokens(text_engine):
    tok = text_engine.tokenizer
    bos, eos = tok.convert_tokens_to_ids("<|bos|>"), tok.convert_tokens_to_ids("<|eos|>")
    words = tok("hello world", add_special_tokens=False)["input_ids"]
    from rollout.engine.detokenize import decode_output

    ids = [bos, *words, eos, *words]
    assert decode_output(tok, ids, SamplingParams(), None) == tok.decode(ids, skip_special_tokens=True)
    spaced = decode_output(tok, ids, SamplingParams(skip_special_tokens=False), None)
    tight = decode_output(tok, ids, SamplingParams(skip_special_tokens=False, spaces_between_special_tokens=False),
                          None)
    assert "<|eos|>" in spaced and "<|eos|> " in spaced and tight == tok.decode(ids, skip_special_tokens=False)
    assert spaced != tight
    out = text_engine.generate(["hi"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                                      skip_special_tokens=False))[0].outputs[0]
    assert out.text == decode_output(tok, out.token_ids, SamplingParams(skip_special_tokens=False), None)


def test_top_logprobs_with_penalties_are_the_penalised_distribution(engine, hf):
    """Greedy with penalties: the top alternative is the token drawn, with the logprob it came with (the
    alternatives are taken before this step's token is counted)."""
    prompt = random_prompts(1, hf.config.vocab_size, seed=11)[0]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3, frequency_penalty=2.0,
                        presence_penalty=1.0, repetition_penalty=1.5)
    c = engine.generate([prompt], sp)[0].outputs[0]
    for tok, lp, top in zip(c.token_ids, c.logprobs, c.top_logprobs):
        assert top[0][0] == tok and abs(top[0][1] - lp) <= 1e-5


def test_prompt_logprobs_after_a_prefix_hit_and_with_n(hf):
    """A cached prompt is computed again where logprobs are wanted; every sample shares one prompt_logprobs."""
    eng = make_engine(hf, block_size=4)
    prompt = random_prompts(1, hf.config.vocab_size, lo=26, hi=27, seed=12)[0]
    eng.generate([prompt], SamplingParams(max_tokens=2, seed=0))  # caches the prompt's blocks
    out = eng.generate([prompt], SamplingParams(n=2, max_tokens=3, seed=1, prompt_logprobs=0, logprobs=1))[0]
    ref = hf_logprobs(hf, prompt[:1], prompt[1:])
    want = ref[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    assert torch.allclose(torch.tensor(out.prompt_logprobs[1:]), want, atol=1e-4)
    assert out.prompt_top_logprobs is None  # prompt_logprobs=0: no alternatives asked, none kept
    assert [len(c.top_logprobs) for c in out.outputs] == [3, 3]


def test_async_engine_passes_priority_through(hf):
    from rollout.engine.async_engine import AsyncEngine

    loop = AsyncEngine(make_engine(hf, max_num_seqs=1))
    order = []
    sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    futs = [loop.submit([1, 2, 3], sp, request_id=name, priority=prio)
            for name, prio in (("a", 3), ("b", -2), ("c", 0))]
    for f in futs:
        f.add_done_callback(lambda f: order.append(f.result().request_id))
    loop.start()
    try:
        for f in futs:
            f.result(timeout=60)
    finally:
        loop.close()
    assert order == ["b", "c", "a"]


def test_penalty_rows_build_reuse_and_free():
    """The device-side counts: built from the host's known tokens, kept while the sequence samples, counted
    on the device, freed when it leaves a step (and rebuilt from its tokens when it comes back)."""
    from rollout.engine.plan import SeqPlan
    from rollout.engine.runners.penalties import PenaltyRows
    from rollout.layers.sampler import Penalties, count_samples

    pr = PenaltyRows(4, 10, torch.device("cpu"))

    def plan(seq_id, history, pen=(1.2, 0.0, 0.0)):
        return SeqPlan(seq_id, [0], 0, [], True, penalties=pen, history=history, num_prompt_tokens=2)

    a, b, c = plan(0, [1, 2, 3, 3, -1]), plan(1, [4, 4, -1]), plan(2, [5, 6, -1], pen=None)
    rows, new = pr.assign([a, b, c])
    assert rows[2] == pr.zero_row and {r for _, r in new} == set(rows[:2])
    hist = pr.build(new)
    assert hist[rows[0]].tolist() == [0, 1, 1, 4, 0, 0, 0, 0, 0, 0]  # prompt 1, 2; output 3 twice; -1 in flight
    assert hist[rows[1]].tolist() == [0, 0, 0, 0, 1, 0, 0, 0, 0, 0]
    settings = torch.tensor([1.2, 1.2, 1.0])
    pen = Penalties(hist, torch.tensor(rows), settings, torch.zeros(3), torch.zeros(3))
    count_samples(pen, torch.tensor([7, 4, 9]))
    assert hist[rows[0], 7] == 2 and hist[rows[1], 4] == 3 and not hist[pr.zero_row].any()
    again, new = pr.assign([a, b])
    assert again == rows[:2] and new == []  # known sequences: no rebuild
    only_b, new = pr.assign([b])
    assert only_b == [rows[1]] and new == []  # a left the step: its row is free again
    back, new = pr.assign([plan(0, [1, 2, 3, 3, 7, -1]), b])
    assert [r for _, r in new] == [back[0]]
    pr.build(new)
    assert hist[back[0]].tolist() == [0, 1, 1, 4, 0, 0, 0, 2, 0, 0]


@pytest.mark.parametrize("async_mode", [False, True])
def test_prompt_logprobs_across_prefill_chunks(hf, async_mode):
    """Chunked prefill: the last position of a chunk scores the first token of the next one."""
    eng = make_engine(hf, block_size=4, max_num_batched_tokens=7, async_mode=async_mode)
    seqs = random_prompts(3, hf.config.vocab_size, lo=18, hi=30, seed=13)
    scored = eng.score(seqs, top_logprobs=1)
    gen = eng.generate(seqs[:1], SamplingParams(max_tokens=2, seed=0, prompt_logprobs=0))[0]
    for seq, out in zip(seqs, scored):
        ref = hf_logprobs(hf, seq[:1], seq[1:])
        want = ref[torch.arange(len(seq) - 1), torch.tensor(seq[1:])]
        assert torch.allclose(torch.tensor(out.prompt_logprobs[1:]), want, atol=1e-4)
        assert [t[0][0] for t in out.prompt_top_logprobs[1:]] == ref.argmax(-1).tolist()
    assert torch.allclose(torch.tensor(gen.prompt_logprobs[1:]), torch.tensor(scored[0].prompt_logprobs[1:]), atol=1e-5)
