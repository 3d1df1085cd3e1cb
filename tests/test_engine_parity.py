"""The oracle: Hugging Face transformers with the same weights (DESIGN section 3)."""

import pytest

from rollout import SamplingParams
from tests.engine_helpers import assert_matches_hf, greedy, make_engine, random_prompts
from tests.tiny_models import make_tiny_hf_model, save_tiny_checkpoint

FAMILIES = ["llama", "qwen2", "qwen3", "mistral"]


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_parity(family):
    hf = make_tiny_hf_model(family)
    engine = make_engine(hf, block_size=8)
    prompts = random_prompts(4, hf.config.vocab_size, seed=1)
    outs = engine.generate(prompts, greedy(max_tokens=10))
    for prompt, out in zip(prompts, outs):
        assert out.prompt_token_ids == prompt
        assert len(out.outputs[0].token_ids) == 10 and out.outputs[0].finish_reason == "length"
        assert_matches_hf(hf, prompt, out.outputs[0])


@pytest.mark.parametrize("family", FAMILIES)
def test_sampled_policy_logprobs(family):
    hf = make_tiny_hf_model(family)
    engine = make_engine(hf, block_size=8)
    prompts = random_prompts(3, hf.config.vocab_size, seed=2)
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, max_tokens=8, ignore_eos=True, n=2, seed=3)
    for prompt, out in zip(prompts, engine.generate(prompts, params)):
        assert len(out.outputs) == 2
        for c in out.outputs:
            assert_matches_hf(hf, prompt, c, temperature=0.8)


def test_checkpoint_dir_and_sharded(tmp_path):
    hf = make_tiny_hf_model("qwen2")
    save_tiny_checkpoint(hf, tmp_path / "ckpt", shards=2)
    from rollout import Engine

    engine = Engine.from_pretrained(str(tmp_path / "ckpt"), dtype="float32", device="cpu", max_model_len=128)
    prompt = random_prompts(1, hf.config.vocab_size, seed=4)[0]
    out = engine.generate([prompt], greedy(6))[0]
    assert_matches_hf(hf, prompt, out.outputs[0])
