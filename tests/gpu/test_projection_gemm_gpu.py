"""The projections' opt-in GEMMs on the GPU (rollout/layers/linear.py): decode-sized batches through cuBLAS's
transposed product or the split-K Triton GEMM (routed per layer, as the bench's GEMM_SWAP_ROWS / SKINNY_GEMM_ROWS
do), replayed in CUDA graphs, keep bf16 logprobs as close to Hugging Face's as the plain GEMMs do; so does the engine
with gemm_autotune, which times them per graph size (rollout/layers/gemm_tune.py)."""

import pytest
import torch

import rollout.engine.runners.cuda as cuda_runner
import rollout.layers.linear as lin
from rollout import Engine
from rollout.layers.gemm_tune import route_rows
from tests.gpu.test_engine_gpu import _hf, bf16_logprob_diff_vs_hf

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("method", ["swap", "skinny"])
@pytest.mark.parametrize("family", ["llama", "qwen3"])  # the bias paths are checked on the CPU
def test_projection_gemm_logprobs_vs_hf(family: str, method: str, monkeypatch: pytest.MonkeyPatch) -> None:
    routed = []
    real_init = Engine.__init__

    def init(self, *a, **kw):  # every engine the helper builds routes its projections' batches of <= 64 rows
        real_init(self, *a, **kw)
        routed.append(route_rows(self.model, method, 64))

    ran = []
    real_gemm = lin.gemm

    def gemm(x, weight, bias, m):
        ran.append(m)
        return real_gemm(x, weight, bias, m)

    monkeypatch.setattr(Engine, "__init__", init)
    monkeypatch.setattr(lin, "gemm", gemm)
    mean = bf16_logprob_diff_vs_hf(_hf(family))
    assert routed and routed[0] >= 4, routed
    assert method in ran, "no projection ran the routed method"
    print(f"{family} bf16 with {method} for <= 64 rows: mean |logprob diff| vs HF {mean:.5f}")
    assert mean < 0.01


@pytest.mark.parametrize("family", ["llama", "qwen3"])  # the bias paths are checked on the CPU
def test_gemm_autotune_logprobs_vs_hf(family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each decode graph size is tuned once, before its first capture: every projection group gets a pick with
    cuBLAS and the transposed product timed (and the Triton GEMM), and the logprobs stay HF's."""
    tuned = []
    real = cuda_runner.tune_gemms

    def tune(model, rows):
        tuned.append((rows, real(model, rows)))
        return tuned[-1][1]

    monkeypatch.setattr(cuda_runner, "tune_gemms", tune)
    mean = bf16_logprob_diff_vs_hf(_hf(family), gemm_autotune=True)
    sizes = [rows for rows, _ in tuned]
    assert sizes and len(sizes) == len(set(sizes)), sizes  # once per graph size
    for rows, picks in tuned:
        assert len(picks) >= 4, picks  # qkv, o_proj, gate_up, down
        for p in picks:
            assert {m for m, _ in p.us} == {"cublas", "swap", "skinny"}, p
            print(f"{family} rows {rows}: {p.as_record()}")
    print(f"{family} bf16 with gemm_autotune: mean |logprob diff| vs HF {mean:.5f}")
    assert mean < 0.01
