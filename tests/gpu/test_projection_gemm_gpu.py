"""The projections' opt-in GEMMs on the GPU (rollout/layers/linear.py): decode-sized batches through cuBLAS's
transposed product (GEMM_SWAP_ROWS) or the split-K Triton GEMM (SKINNY_GEMM_ROWS), replayed in CUDA graphs, keep
bf16 logprobs as close to Hugging Face's as the plain GEMMs do."""

import pytest
import torch

import rollout.layers.linear as lin
from tests.gpu.test_engine_gpu import _hf, bf16_logprob_diff_vs_hf

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("knob", ["GEMM_SWAP_ROWS", "SKINNY_GEMM_ROWS"])
@pytest.mark.parametrize("family", ["llama", "qwen3"])  # the bias paths are checked on the CPU
def test_projection_gemm_logprobs_vs_hf(family: str, knob: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lin, knob, 64)
    mean = bf16_logprob_diff_vs_hf(_hf(family))
    print(f"{family} bf16 with {knob}=64: mean |logprob diff| vs HF {mean:.5f}")
    assert mean < 0.01
