"""Tensor parallelism in the model: two gloo ranks on the CPU compute what one process does.

Every family (Qwen2 both tied with 2 KV heads and with a single, replicated KV head; Llama with all
biases) is loaded from a checkpoint (sharded on the fly), run through chunked prefill and decode in
float32, and sampled with the vocabulary-parallel sampler under every sampler path. Logits and
logprobs must equal one process's within 1e-5 and the tokens exactly (tests/test_tp_engine.py runs
the same through the engine, with update_weights).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rollout.distributed import TPGroup
from rollout.layers.attention import TorchAttentionBackend
from rollout.layers.backends import AttentionSpec
from rollout.layers.parallel import check_tp_shapes
from rollout.layers.parallel_sampler import sample_vocab_parallel
from rollout.layers.sampler import SamplingTensors
from rollout.models import get_model_class
from rollout.models.loader import load_checkpoint, load_hf_config, load_named_tensors
from rollout.models.weights import WeightMapper
from tests.tiny_models import make_kv_caches, make_metadata, make_tiny_hf_model, save_tiny_checkpoint
from tests.tp_helpers import CASES, TOL, run_ranks

BLOCK_SIZE, NUM_BLOCKS = 4, 64
STEPS = [[5, 9, 20], [1, 1, 12], [1, 1, 1]]  # prefill + a chunked prefill, then decode
VARIANTS = ("mixed", "greedy", "suppress", "filter")


def sampling(variant: str, n: int, step: int) -> SamplingTensors:
    i = torch.arange(n)
    temps = torch.tensor([0.0, 0.7, 1.0, 1.3])[i % 4]
    if variant == "greedy":
        temps = torch.zeros(n)
    suppress = None
    if variant == "suppress":  # ids in both halves of the vocabulary, -1 padded
        suppress = torch.stack([(i * 37) % 256, (i * 11 + 130) % 256, torch.full((n,), -1)], dim=-1)
    filt = variant == "filter"
    return SamplingTensors(
        temperature=temps,
        top_k=torch.tensor([0, 5, 0, 20])[i % 4] if filt else torch.zeros(n, dtype=torch.int64),
        top_p=torch.tensor([1.0, 0.9, 0.8, 1.0])[i % 4] if filt else torch.ones(n),
        min_p=torch.tensor([0.0, 0.0, 0.05, 0.1])[i % 4] if filt else torch.zeros(n),
        seed=1000 + i * 7919,
        position=step * 7 + i,
        mode=i % 3,
        suppress_ids=suppress,
        needs_filter=filt,
        all_greedy=variant == "greedy",
    )


@torch.no_grad()
def run_model(model, tp: TPGroup) -> dict[str, list[torch.Tensor]]:
    """Full-vocabulary logits of every step, and (tokens, logprobs) of every sampler variant."""
    g = torch.Generator().manual_seed(1)
    lengths = [sum(s[i] for s in STEPS) for i in range(len(STEPS[0]))]
    seqs = [torch.randint(0, model.vocab_size, (n,), generator=g).tolist() for n in lengths]
    kv = make_kv_caches(model, NUM_BLOCKS, BLOCK_SIZE)
    done, out = [0] * len(seqs), {"logits": [], **{v: [] for v in VARIANTS}}
    for step, counts in enumerate(STEPS):
        meta = make_metadata([(done[i], n) for i, n in enumerate(counts)], BLOCK_SIZE, NUM_BLOCKS)
        ids = torch.tensor([t for i, n in enumerate(counts) for t in seqs[i][done[i] : done[i] + n]])
        local = model.compute_logits(model(ids, meta.positions, kv, meta, TorchAttentionBackend()))
        out["logits"].append(tp.all_gather(local).permute(1, 0, 2).reshape(len(ids), -1))
        for v in VARIANTS:
            out[v].append(torch.stack(sample_vocab_parallel(local, sampling(v, len(ids), step), tp, model.vocab_start)))
        done = [d + n for d, n in zip(done, counts)]
    return out


def build(path: Path, tp: TPGroup):
    config = load_hf_config(path)
    model = get_model_class(config)(config, tp).eval()
    load_checkpoint(model, path)
    return model


def run_case(case_dir: Path, tp: TPGroup) -> dict[str, list[torch.Tensor]]:
    return run_model(build(case_dir, tp), tp)


def _rank_main(tp: TPGroup, root: str) -> None:
    results = {case: run_case(Path(root) / case, tp) for case in CASES}
    if tp.rank == 0:
        torch.save(results, Path(root) / "tp2.pt")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    for case, (family, overrides) in CASES.items():
        save_tiny_checkpoint(make_tiny_hf_model(family, **overrides), root / case)
    run_ranks(_rank_main, 2, str(root), timeout=240)
    return root


@pytest.mark.parametrize("case", CASES)
def test_two_ranks_equal_one(case, checkpoints):
    got = torch.load(checkpoints / "tp2.pt")[case]
    want = run_case(checkpoints / case, TPGroup.single())
    for g, w in zip(got["logits"], want["logits"], strict=True):
        assert (g - w).abs().max().item() <= TOL, (g - w).abs().max().item()
    for v in VARIANTS:
        for g, w in zip(got[v], want[v], strict=True):
            assert torch.equal(g[0], w[0]), (v, "tokens differ")
            assert (g[1] - w[1]).abs().max().item() <= TOL, (v, (g[1] - w[1]).abs().max().item())


def _fake_rank(rank: int) -> TPGroup:
    return TPGroup(rank, 2, group=object())  # building and loading a shard communicates nothing


def test_shards_hold_their_part_of_each_full_tensor():
    hf = make_tiny_hf_model("qwen2", num_key_value_heads=1)
    full = dict(hf.named_parameters())
    parts = []
    for rank in range(2):
        model = get_model_class(hf.config)(hf.config, _fake_rank(rank))
        load_named_tensors(model, hf.named_parameters())
        assert model.num_kv_heads == 1 and model.lm_head.weight is model.model.embed_tokens.weight
        assert set(WeightMapper(model).hf_names()) == set(hf.state_dict())
        parts.append(dict(model.named_parameters()))
    attn = "model.layers.1.self_attn."
    qkv = [p[attn + "qkv_proj.weight"] for p in parts]
    assert torch.equal(torch.cat([q[:32] for q in qkv]), full[attn + "q_proj.weight"])  # 2 of 4 heads each
    assert all(torch.equal(q[32:48], full[attn + "k_proj.weight"]) for q in qkv)  # the one KV head, replicated
    assert torch.equal(torch.cat([p[attn + "o_proj.weight"] for p in parts], 1), full[attn + "o_proj.weight"])
    emb = "model.embed_tokens.weight"
    assert torch.equal(torch.cat([p[emb] for p in parts]), full[emb])


def test_sizes_that_do_not_divide_are_named():
    def shape(**kw):
        return SimpleNamespace(**{**dict(num_attention_heads=8, num_key_value_heads=2, intermediate_size=128,
                                         vocab_size=256), **kw})

    with pytest.raises(ValueError, match=r"num_attention_heads \(8\).*tensor_parallel_size \(3\)"):
        check_tp_shapes(shape(), 3)
    with pytest.raises(ValueError, match=r"num_key_value_heads \(6\).*tensor_parallel_size \(4\)"):
        check_tp_shapes(shape(num_attention_heads=12, num_key_value_heads=6), 4)
    with pytest.raises(ValueError, match=r"multiple of num_key_value_heads \(3\)"):
        check_tp_shapes(shape(num_attention_heads=12, num_key_value_heads=3), 4)
    with pytest.raises(ValueError, match=r"intermediate_size \(130\)"):
        check_tp_shapes(shape(intermediate_size=130), 4)
    with pytest.raises(ValueError, match=r"vocab_size \(250\)"):
        check_tp_shapes(shape(vocab_size=250), 4)
    check_tp_shapes(shape(num_key_value_heads=1), 4)  # one KV head: replicated


def test_a_rank_measures_its_step_memory_alone(monkeypatch):
    """The KV sizing runs dummy steps on each rank by itself (rank 0 in the engine, a worker as it builds its
    cache): their collectives must stay local, or the rank waits in NCCL for peers that never join."""
    from rollout.engine.runners import memory_profile
    from rollout.engine.runners.memory_profile import dummy_step, local_collectives

    hf = make_tiny_hf_model("qwen2")
    model = get_model_class(hf.config)(hf.config, _fake_rank(0))  # no peer will ever join a collective
    load_named_tensors(model, hf.named_parameters())
    caches = make_kv_caches(model, 1, BLOCK_SIZE, torch.float32)
    backend = TorchAttentionBackend()
    with pytest.raises((RuntimeError, TypeError, AttributeError, ValueError)):  # a real collective: no group
        dummy_step(model, caches, backend, [3, 1], 4, torch.device("cpu"))
    with local_collectives(model):
        tokens, logprobs = dummy_step(model, caches, backend, [3, 1], 4, torch.device("cpu"))
    assert tokens.shape == (2,) and bool(torch.isfinite(logprobs).all())
    assert model.tp.communicates  # local mode ends with the block

    seen = []
    monkeypatch.setattr(memory_profile, "_step_peak", lambda m, *a: seen.append(m.tp.communicates) or 0)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    config = SimpleNamespace(attention_backend="torch", block_size=BLOCK_SIZE, kv_cache_dtype="auto",
                             cuda_graphs=False, max_num_seqs=2, num_rows=2, max_num_batched_tokens=8)
    attn = AttentionSpec("torch", BLOCK_SIZE, "auto")
    memory_profile.measure_step_workspace(model, config, attn, torch.device("cpu"), 16, caches)
    assert seen and not any(seen)
