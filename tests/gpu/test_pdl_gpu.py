"""Programmatic dependent launch on the GPU (rollout/kernels/pdl.py, ``PDL``): the decode step's Triton kernels
launched early, each waiting on the one before, give the same tokens and logprobs bit for bit as plain launches,
in graphs (bf16 and fp8 KV: the chunked and the stream split, their reduce) and eagerly."""

import pytest
import torch

import rollout.kernels.pdl as pdl
from rollout import Engine, SamplingParams
from tests.gpu.test_engine_gpu import _hf, _prompts

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9, reason="needs CUDA on sm_90+"
)


@pytest.mark.parametrize("kv,graphs", [("auto", True), ("fp8", True), ("auto", False)])
def test_pdl_same_tokens_and_logprobs(kv: str, graphs: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    hf = _hf("llama")
    prompts = _prompts(24, 4096, lo=8, hi=1500, seed=3)  # long and short: several chunks, so the reduce runs
    sp = SamplingParams(temperature=1.0, seed=7, max_tokens=48, ignore_eos=True, logprobs=0)
    runs = {}
    for on in (False, True):
        monkeypatch.setattr(pdl, "PDL", on)
        eng = Engine.from_pretrained(hf, dtype="bfloat16", max_model_len=2048, num_blocks=4096, max_num_seqs=32,
                                     kv_cache_dtype=kv, cuda_graphs=graphs)
        assert bool(pdl.pdl_launch(torch.device("cuda"))) is on
        outs = eng.generate(prompts, sp)
        runs[on] = [(c.token_ids, c.logprobs) for o in outs for c in o.outputs]
        del eng
    assert runs[True] == runs[False]
