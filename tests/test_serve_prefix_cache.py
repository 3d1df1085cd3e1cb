"""Prefix-cache hits reported per request (``RequestOutput.num_cached_tokens``, OpenAI's
``usage.prompt_tokens_details.cached_tokens``, SGLang's ``meta_info.cached_tokens``), and multi-turn chat
over the OpenAI API reusing the conversation's KV turn after turn (issue 22 item 5), measured.

The chat model is a tiny random Llama with a word-level tokenizer (every generated token decodes to a word
that encodes back to the same id) and the embedded model's chat template; its lm_head cannot pick a special
token other than EOS (their rows are zero: greedy never takes a 0 logit over 250 random ones), so the text an
agent sends back re-renders to exactly the ids generated, as a trained model's clean text does.
"""

from __future__ import annotations

import json

import pytest
import torch
from fastapi.testclient import TestClient

from rollout import Engine, SamplingParams
from rollout.serve.app import build_app
from rollout.serve.config import ServeConfig
from tests.engine_helpers import make_engine
from tests.tiny_models import make_tiny_hf_model

BLOCK = 4
SPECIALS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>"]
EOS = 2
TEMPLATE = ("{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}"
            "{{ eos_token }}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


def word_tokenizer(vocab_size: int = 256):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + [f"w{i}" for i in range(vocab_size - len(SPECIALS))])}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<|pad|>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # words joined by one space
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<|bos|>", eos_token="<|eos|>",
                                   pad_token="<|pad|>", unk_token="<|pad|>", additional_special_tokens=SPECIALS[3:],
                                   chat_template=TEMPLATE)


@pytest.fixture(scope="module")
def client():
    hf = make_tiny_hf_model("llama", seed=3)
    with torch.no_grad():
        for i in range(len(SPECIALS)):
            if i != EOS:
                hf.lm_head.weight[i].zero_()
        hf.lm_head.weight[EOS] = 1.1 * hf.lm_head.weight[173]  # EOS wherever w167 would win: some turns stop
    eng = Engine.from_pretrained(hf, dtype="float32", device="cpu", tokenizer=word_tokenizer(),
                                 max_model_len=512, block_size=BLOCK, num_blocks=256)
    with TestClient(build_app(eng, ServeConfig(), "tiny")) as c:
        yield c


def _floor(n: int) -> int:
    return n // BLOCK * BLOCK


# ---- 1. per-request cached tokens -------------------------------------------------------------------------
def test_request_output_counts_prefix_hits_at_first_scheduling():
    engine = make_engine(make_tiny_hf_model("llama", seed=0), block_size=BLOCK, num_blocks=64)
    prompt = list(range(3, 13))  # 10 tokens: 2 full blocks before the one holding the last token
    params = SamplingParams(n=2, max_tokens=3, ignore_eos=True, seed=1)
    cold, = engine.generate([prompt], params)
    warm, other = engine.generate([prompt, [7, 8, 9]], params)
    assert cold.num_cached_tokens == 0
    assert warm.num_cached_tokens == 8 and other.num_cached_tokens == 0
    longer, = engine.generate([prompt + cold.outputs[0].token_ids + [5]], params)
    assert longer.num_cached_tokens == 12  # the finished completion's full block was cached too


def test_usage_reports_cached_tokens_on_both_endpoints_and_streams(client):
    prompt = list(range(10, 31))  # 21 tokens: 5 blocks may hit
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0}
    first = client.post("/v1/completions", json=body).json()["usage"]
    second = client.post("/v1/completions", json=body).json()["usage"]
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    assert second["prompt_tokens_details"] == {"cached_tokens": 20} and second["prompt_tokens"] == 21

    events = client.post("/v1/completions", json=body | {"stream": True, "stream_options": {"include_usage": True}})
    chunks = [json.loads(x[6:]) for x in events.text.split("\n\n") if x.startswith("data: {")]
    assert chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 20}

    messages = [{"role": "user", "content": " ".join(f"w{i}" for i in range(30))}]
    chat = {"model": "tiny", "messages": messages, "max_tokens": 2, "temperature": 0}
    client.post("/v1/chat/completions", json=chat)
    usage = client.post("/v1/chat/completions", json=chat).json()["usage"]
    assert usage["prompt_tokens"] == 34 and usage["prompt_tokens_details"] == {"cached_tokens": 32}

    sg = client.post("/generate", json={"input_ids": prompt, "sampling_params": {"max_new_tokens": 2}}).json()
    assert sg["meta_info"]["cached_tokens"] == 20


def test_first_scheduling_hits_stay_after_the_sequence_is_recomputed():
    """vLLM's meaning: a request recomputed later (weights changed, preempted) keeps the hits of its first
    admission, though its re-allocation finds its own earlier blocks."""
    from tests.test_scheduler import Harness

    h = Harness(block_size=BLOCK)
    prompt = list(range(10, 19))  # 9 tokens: 2 blocks may hit
    h.add(prompt, max_tokens=2, ignore_eos=True)
    while h.sched.has_unfinished():
        h.step()
    rid = h.add(prompt, max_tokens=12, ignore_eos=True)
    seq = h.sched.requests[rid].seqs[0]
    for _ in range(6):
        h.step()
    assert seq.num_first_cached_tokens == seq.num_cached_tokens == 8
    h.sched.recompute_running()
    h.step()
    assert seq.num_cached_tokens > 8 and seq.num_first_cached_tokens == 8
    h.check()


# ---- 2. multi-turn agents over the OpenAI API ----------------------------------------------------------------
def test_each_chat_turn_reuses_the_whole_previous_conversation(client):
    """An agent loop: each request is the whole conversation so far (the assistant turns as text). Every
    later turn finds the previous prompt and its completion in the prefix cache, up to the block holding
    the previous turn's last token (the sampled final token is never an input, so its KV does not exist),
    and the template's re-rendering of the assistant turn gives back exactly the generated ids."""
    messages = [{"role": "system", "content": "w7 w8 w9 w10 w11"},
                {"role": "user", "content": " ".join(f"w{i}" for i in range(40, 57))}]
    prev: list[int] | None = None
    computed = total = 0
    finishes = set()
    for turn, max_tokens in enumerate((11, 14, 9, 13)):
        r = client.post("/v1/chat/completions", json={"model": "tiny", "messages": messages, "temperature": 0,
                                                       "max_tokens": max_tokens})
        assert r.status_code == 200, r.text
        body = r.json()
        choice, usage, prompt = body["choices"][0], body["usage"], body["prompt_token_ids"]
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        if prev is None:
            assert cached == 0
        else:
            assert prompt[: len(prev)] == prev, f"turn {turn}: the re-rendered conversation differs from the ids"
            assert cached >= _floor(len(prev) - 1), (turn, cached, len(prev))
            assert cached <= _floor(len(prompt) - 1)
        computed += usage["prompt_tokens"] - cached
        total += usage["prompt_tokens"]
        prev = prompt + choice["token_ids"]
        finishes.add(choice["finish_reason"])
        messages += [{"role": "assistant", "content": choice["message"]["content"]},
                     {"role": "user", "content": f"w{100 + turn} w{120 + turn} w{140 + turn}"}]
    assert finishes == {"stop", "length"}  # an EOS-ended turn re-renders with the template's own EOS
    assert computed < 0.5 * total  # 4 turns: most of each later prompt is the conversation before it


def test_multiturn_bench_reports_the_hit_rate(client):
    from tests.script_helpers import load_bench

    bench = load_bench("multiturn_cache")
    bench.WORDS = tuple(f"w{i}" for i in range(60, 90))  # the word-level tokenizer's words

    def post(route: str, body: dict) -> dict:
        r = client.post(route, json=body)
        assert r.status_code == 200, r.text
        return r.json()

    line = bench.run(post, "tiny", conversations=3, turns=3, max_tokens=6, user_words=8, concurrency=3,
                     temperature=0.0)
    assert line["later_turns"] == 6 and line["drifted_turns"] == 0
    assert line["reusable_tokens"] == line["previous_tokens"]
    assert line["prefill_tokens"] == line["prompt_tokens"] - line["cached_tokens"]
    assert line["cached_of_reusable"] >= 0.8 and line["later_turns_hit_rate"] >= 0.6
