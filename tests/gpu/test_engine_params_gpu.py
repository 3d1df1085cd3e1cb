"""Issue 21's engine extras on the GPU (skipped without CUDA): penalties with device-side counts through
the async path (carry-over, CUDA graphs) equal the sync path's tokens; top logprobs come from the sampled
distribution; ``Engine.score`` gives back a generation's own logprobs (float32, <= 1e-4)."""

import pytest
import torch

from rollout import Engine, SamplingParams
from tests.gpu.test_engine_gpu import _hf, _prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

PEN = dict(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.8)


def _engine(hf, **opts):
    return Engine.from_pretrained(hf, dtype="float32", max_model_len=1024, num_blocks=4096, max_num_seqs=32, **opts)


def test_penalties_async_graphs_equal_sync():
    hf = _hf(dtype=torch.float32)
    prompts = _prompts(40, 4096)
    params = [SamplingParams(temperature=0 if i % 2 else 0.8, seed=i, max_tokens=48, ignore_eos=True, logprobs=4,
                             **(PEN if i % 3 else {})) for i in range(len(prompts))]
    runs = {name: _engine(hf, **opts).generate(prompts, params)
            for name, opts in {"async": dict(async_mode=True), "sync": dict(async_mode=False)}.items()}
    for a, b in zip(runs["async"], runs["sync"]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert torch.allclose(torch.tensor(a.outputs[0].logprobs), torch.tensor(b.outputs[0].logprobs), atol=1e-5)
    for p, out in zip(params, runs["async"]):
        c = out.outputs[0]
        assert len(c.top_logprobs) == len(c.token_ids) and all(len(t) == 4 for t in c.top_logprobs)
        if p.temperature == 0:  # greedy: the top alternative is the token drawn, with its logprob
            for tok, lp, top in zip(c.token_ids, c.logprobs, c.top_logprobs):
                assert top[0][0] == tok and abs(top[0][1] - lp) < 1e-4


def test_penalties_change_tokens_and_rows_without_them_do_not():
    hf = _hf(dtype=torch.float32)
    prompts = _prompts(8, 4096, seed=1)
    eng = _engine(hf)
    plain = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    base = eng.generate(prompts, plain)
    mixed = eng.generate(prompts, [SamplingParams(temperature=0, max_tokens=32, ignore_eos=True,
                                                  **(PEN if i % 2 else {})) for i in range(8)])
    for a, b in zip(base[::2], mixed[::2]):  # rows without penalties beside rows with them: unchanged
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert any(a.outputs[0].token_ids != b.outputs[0].token_ids for a, b in zip(base[1::2], mixed[1::2]))


@pytest.mark.parametrize("sp", [
    SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
    SamplingParams(temperature=0.7, seed=1, max_tokens=32, ignore_eos=True),
    SamplingParams(temperature=1.0, seed=2, top_p=0.9, max_tokens=32, ignore_eos=True, logprobs_mode="processed"),
], ids=["greedy", "policy", "processed"])  # fmt: skip
def test_score_gives_back_generation_logprobs(sp):
    hf = _hf(dtype=torch.float32)
    prompts = _prompts(24, 4096, seed=2)
    eng = _engine(hf)
    outs = eng.generate(prompts, sp)
    scored = eng.score([p + o.outputs[0].token_ids for p, o in zip(prompts, outs)], sampling_params=sp,
                       top_logprobs=3)
    for p, o, s in zip(prompts, outs, scored):
        got = torch.tensor(s.prompt_logprobs[len(p):])
        assert torch.allclose(got, torch.tensor(o.outputs[0].logprobs), atol=1e-4)
        assert all(len(t) == 3 for t in s.prompt_top_logprobs[1:])
