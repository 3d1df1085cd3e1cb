"""Engine(tensor_parallel_size=2) on the CPU over gloo equals the one-process engine.

Each family's tiny model (Qwen2 also with one KV head, replicated on both ranks) runs greedy, seeded
sampling with n > 1, top-k/top-p filtering, min_tokens (EOS suppressed) and every logprob mode; the
tokens must be identical and the logprobs within 1e-5. Then, on one TP engine: update_weights with
full tensors (sharded on arrival) and its all-or-nothing refusals, sleep / wake_up, loading from a
checkpoint directory (each rank reads its own shard), a worker killed mid-run, and fp8 KV (every rank
builds the attention backend rank 0 decided).
"""

from __future__ import annotations

import os
import signal

import pytest
import torch

from rollout import Engine, SamplingParams
from rollout.config import EngineConfig
from rollout.engine.tp.runner import start_tensor_parallel
from rollout.engine.tp.workers import TPWorkers
from rollout.layers import backends
from rollout.layers.backends import AttentionSpec, resolve_attention
from tests.engine_helpers import random_prompts
from tests.tiny_models import make_tiny_hf_model, save_tiny_checkpoint
from tests.tp_helpers import CASES, TOL

PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=0.9, max_tokens=10, ignore_eos=True, n=2, seed=7, logprobs_mode="raw"),
    SamplingParams(temperature=0.7, top_k=20, top_p=0.9, min_p=0.02, max_tokens=8, ignore_eos=True, seed=3,
                   logprobs_mode="processed"),
    SamplingParams(temperature=1.1, max_tokens=9, min_tokens=6, seed=11, logprobs_mode="processed"),
]


def make(source, tp: int = 1, **options) -> Engine:
    options.setdefault("max_model_len", 128)
    return Engine.from_pretrained(source, dtype="float32", device="cpu", tensor_parallel_size=tp, block_size=8,
                                  **options)


def run(engine: Engine, vocab: int) -> list[list[tuple[list[int], list[float]]]]:
    prompts = random_prompts(len(PARAMS), vocab, seed=5)
    outs = engine.generate(prompts, PARAMS)
    return [[(c.token_ids, c.logprobs) for c in o.outputs] for o in outs]


def assert_same(got, want) -> None:
    for g_req, w_req in zip(got, want, strict=True):
        for (g_tok, g_lp), (w_tok, w_lp) in zip(g_req, w_req, strict=True):
            assert g_tok == w_tok
            assert torch.allclose(torch.tensor(g_lp), torch.tensor(w_lp), atol=TOL, rtol=0), (g_lp, w_lp)


@pytest.mark.parametrize("case", CASES)
def test_two_ranks_equal_one(case):
    family, overrides = CASES[case]
    hf = make_tiny_hf_model(family, **overrides)
    hf.generation_config.eos_token_id = 3  # min_tokens then has an EOS to suppress
    want = run(make(hf), hf.config.vocab_size)
    engine = make(hf, tp=2)
    assert engine.model.num_kv_heads == 1  # 2 KV heads split over 2 ranks, or qwen2_kv1's one replicated
    assert_same(run(engine, hf.config.vocab_size), want)


@pytest.fixture(scope="module")
def models():
    return make_tiny_hf_model("llama", seed=0), make_tiny_hf_model("llama", seed=9)


def test_update_weights_sleep_and_refusals(models):
    old, new = models
    vocab = old.config.vocab_size
    engine = make(old, tp=2)
    want_new = run(make(new), vocab)
    good = dict(new.named_parameters())
    bad_shape = {**good, "model.layers.1.mlp.down_proj.weight": torch.zeros(64, 64)}
    nan = {**good, "model.layers.0.self_attn.o_proj.weight": torch.full((64, 64), float("nan"))}
    before = run(engine, vocab)
    for bad, err in ((bad_shape, "shape"), (nan, "finite"), ({"bogus.weight": torch.zeros(1)}, "unknown")):
        with pytest.raises(ValueError, match=err):
            engine.update_weights(bad)
        assert_same(run(engine, vocab), before)  # nothing changed on any rank
    assert engine.update_weights(new.named_parameters()) == 1
    assert_same(run(engine, vocab), want_new)
    for level in (1, 2):
        engine.sleep(level)
        engine.wake_up()
        assert_same(run(engine, vocab), want_new)


def test_checkpoint_dir_loads_a_shard_per_rank(models, tmp_path):
    old, _ = models
    save_tiny_checkpoint(old, tmp_path, shards=2)
    assert_same(run(make(str(tmp_path), tp=2), old.config.vocab_size), run(make(old), old.config.vocab_size))


def test_dead_worker_stops_the_engine_naming_its_rank(models):
    old, _ = models
    engine = make(old, tp=2)
    engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
    os.kill(engine.workers.procs[0].pid, signal.SIGKILL)
    for _ in range(2):  # and stays stopped
        with pytest.raises(RuntimeError, match="worker rank 1 died"):
            engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2))


def test_a_failed_rank0_step_stops_the_engine(models, monkeypatch):
    """The worker already runs the step's collectives: rank 0 cannot roll back, so the engine stops."""
    old, _ = models
    engine = make(old, tp=2)
    monkeypatch.setattr(engine.runner.inner, "execute", lambda plan: (_ for _ in ()).throw(MemoryError("boom")))
    with pytest.raises(MemoryError, match="boom"):
        engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="engine stopped: rank 0's step raised MemoryError"):
        engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
    assert not any(p.is_alive() for p in engine.workers.procs)


def test_every_rank_gets_the_attention_backend_the_engine_decided(models, monkeypatch):
    """The engine decides the backend once, KV dtype included, and hands that spec to every rank: a rank
    deciding "auto" again without the KV dtype would pick flash-attn beside rank 0's Triton under fp8."""
    monkeypatch.setattr(backends, "flash_attn_available", lambda: True)
    cuda = torch.device("cuda")
    assert resolve_attention("auto", cuda, 256, "fp8") == AttentionSpec("triton", 256, "fp8")
    assert resolve_attention("auto", cuda, 256).backend == "flash_attn"
    sent = []
    call = TPWorkers.call
    monkeypatch.setattr(TPWorkers, "call", lambda self, *m: sent.append(m) or call(self, *m))
    old, _ = models
    engine = make(old, tp=2, kv_cache_dtype="fp8")
    assert engine.attn == AttentionSpec("torch", 8, "fp8")
    assert [m[2] for m in sent if m[0] == "init_kv"] == [engine.attn]
    vocab = old.config.vocab_size
    assert_same(run(engine, vocab), run(make(old, kv_cache_dtype="fp8"), vocab))


def test_sizes_and_gpu_count_are_checked_before_any_worker_starts(models, monkeypatch):
    old, _ = models
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        make(old, tp=0)
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) must be divisible by tensor_parallel_size \(3\)"):
        make(old, tp=3)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="tensor_parallel_size=2 needs 2 GPUs from cuda:0, but 1 are visible"):
        start_tensor_parallel(old, "float32", torch.device("cuda"), EngineConfig(tensor_parallel_size=2))
