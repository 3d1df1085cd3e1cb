"""String prompts and stop strings with a real tokenizer (the shipped one in rollout/assets)."""

import pytest

from rollout import Engine, SamplingParams
from rollout.assets import assets_dir
from tests.tiny_models import make_tiny_hf_model


@pytest.fixture(scope="module")
def engine():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(assets_dir()))
    hf = make_tiny_hf_model("llama", vocab_size=len(tok))
    return Engine.from_pretrained(hf, dtype="float32", device="cpu", tokenizer=tok, max_model_len=256)


def test_string_prompt_matches_token_prompt(engine):
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    text = engine.generate(["What is 12 + 7?"], sp)[0]
    ids = engine.tokenizer("What is 12 + 7?")["input_ids"]
    by_ids = engine.generate([ids], sp)[0]
    assert text.prompt_token_ids == ids and text.prompt == "What is 12 + 7?"
    assert text.outputs[0].token_ids == by_ids.outputs[0].token_ids
    assert text.outputs[0].text == engine.tokenizer.decode(by_ids.outputs[0].token_ids, skip_special_tokens=True)


def test_stop_string_ends_and_truncates_text(engine):
    prompt = "What is 3 + 4?"
    free = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0].outputs[0]
    toks = free.token_ids
    # a stop string made of the decoded 5th..6th tokens: generation must end once it appears
    stop = engine.tokenizer.decode(toks[4:6], skip_special_tokens=False).strip()
    if not stop:
        pytest.skip("greedy tokens decode to whitespace on this random model")
    out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                   stop=[stop]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.token_ids == toks[: len(out.token_ids)] and len(out.token_ids) <= 6
    assert stop not in out.text
    full = engine.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    assert stop in full and out.text == full[: full.find(stop)]
