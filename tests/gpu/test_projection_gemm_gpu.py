"""The projections' opt-in GEMMs on the GPU (rollout/layers/linear.py): decode-sized batches through cuBLAS's
transposed product (GEMM_SWAP_ROWS) or the split-K Triton GEMM (SKINNY_GEMM_ROWS), replayed in CUDA graphs, keep
bf16 logprobs as close to Hugging Face's as the plain GEMMs do."""

import pytest
import torch

import rollout.layers.linear as lin
from rollout import Engine, SamplingParams
from tests.gpu.test_engine_gpu import _hf, _prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("knob", ["GEMM_SWAP_ROWS", "SKINNY_GEMM_ROWS"])
@pytest.mark.parametrize("family", ["llama", "qwen3"])  # the bias paths are checked on the CPU
def test_projection_gemm_logprobs_vs_hf(family: str, knob: str, monkeypatch: pytest.MonkeyPatch) -> None:
    hf = _hf(family)
    prompts = _prompts(8, 4096, seed=1)
    monkeypatch.setattr(lin, knob, 64)
    eng = Engine.from_pretrained(hf, dtype="bfloat16", max_model_len=1024, num_blocks=2048)
    outs = eng.generate(prompts, SamplingParams(temperature=1.0, max_tokens=32, ignore_eos=True, seed=0))
    diffs = []
    with torch.no_grad():
        for p, o in zip(prompts, outs):
            toks = o.outputs[0].token_ids
            ids = torch.tensor([p + toks], device="cuda")
            lp = torch.log_softmax(hf(ids).logits[0, len(p) - 1 : -1].float(), -1)
            ref = lp[torch.arange(len(toks)), torch.tensor(toks)]
            diffs.append((ref.cpu() - torch.tensor(o.outputs[0].logprobs)).abs())
    mean = torch.cat(diffs).mean().item()
    print(f"{family} bf16 with {knob}=64: mean |logprob diff| vs HF {mean:.5f}")
    assert mean < 0.01
