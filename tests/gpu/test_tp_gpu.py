"""Tensor parallelism on two GPUs (skipped unless two are visible): NCCL collectives inside the
async loop and its CUDA graphs compute what one GPU does, update_weights and sleep/wake reach every
rank, and a killed worker stops the engine naming its rank instead of hanging in NCCL."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from rollout import Engine, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                reason="needs 2 GPUs")


def _hf(family: str = "qwen3", seed: int = 0, **kw):
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    torch.manual_seed(seed)
    common = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                  vocab_size=4096, max_position_embeddings=4096, initializer_range=0.1)
    if family == "llama":
        cfg = LlamaConfig(num_key_value_heads=2, **common, **kw)
    else:  # one KV head: replicated on both ranks; tied embeddings
        cfg = Qwen3Config(num_key_value_heads=1, head_dim=64, tie_word_embeddings=True, **common, **kw)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()  # CPU: broadcast from rank 0


def _prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (int(k),), generator=g).tolist() for k in torch.randint(8, 200, (n,), generator=g)]


def _engine(hf, tp: int, **opts) -> Engine:
    return Engine.from_pretrained(hf, dtype="float32", device="cuda", tensor_parallel_size=tp, max_model_len=1024,
                                  num_blocks=2048, max_num_seqs=32, **opts)


def _run(engine: Engine, prompts, params):
    return [[(c.token_ids, c.logprobs) for c in o.outputs] for o in engine.generate(prompts, params)]


def _assert_same(got, want, atol: float = 1e-4) -> None:
    for g_req, w_req in zip(got, want, strict=True):
        for (g_tok, g_lp), (w_tok, w_lp) in zip(g_req, w_req, strict=True):
            assert g_tok == w_tok
            assert torch.allclose(torch.tensor(g_lp), torch.tensor(w_lp), atol=atol, rtol=0)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
@pytest.mark.parametrize("async_mode", [True, False])
def test_tp2_equals_tp1_fp32_with_graphs(family, async_mode):
    hf = _hf(family)
    prompts = _prompts(40, 4096)  # more than max_num_seqs: decode graphs of several sizes, prefill chunks
    params = [SamplingParams(temperature=0, max_tokens=48, ignore_eos=True),
              SamplingParams(temperature=0.8, max_tokens=40, ignore_eos=True, n=2, seed=5),
              SamplingParams(temperature=0.7, top_p=0.9, top_k=50, max_tokens=32, ignore_eos=True, seed=9)] * 14
    params = params[:40]
    one = _engine(hf, 1, async_mode=async_mode)
    want = _run(one, prompts, params)
    del one
    two = _engine(hf, 2, async_mode=async_mode)
    assert two.runner.inner.cuda_graphs
    _assert_same(_run(two, prompts, params), want)


def test_tp2_update_weights_sleep_wake():
    old, new = _hf("llama", seed=0), _hf("llama", seed=1)
    prompts = _prompts(16, 4096, seed=2)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    want = _run(_engine(new, 1), prompts, params)
    engine = _engine(old, 2)
    _run(engine, prompts, params)  # graphs captured with the old weights
    engine.update_weights({n: p.detach().cuda() for n, p in new.named_parameters()})
    _assert_same(_run(engine, prompts, params), want)
    for level in (1, 2):
        engine.sleep(level)
        engine.wake_up()
        _assert_same(_run(engine, prompts, params), want)


def test_killed_worker_stops_the_engine_naming_its_rank():
    engine = _engine(_hf("llama"), 2)
    engine.generate(_prompts(4, 4096), SamplingParams(max_tokens=8))
    os.kill(engine.workers.procs[0].pid, signal.SIGKILL)
    with pytest.raises(RuntimeError, match="worker rank 1 died"):
        engine.generate(_prompts(4, 4096), SamplingParams(max_tokens=8))
