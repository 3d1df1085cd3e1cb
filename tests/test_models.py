"""Our model implementations against Hugging Face's own forward, plus weight mapping and loading."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from rollout.layers.attention import TorchAttentionBackend
from rollout.layers.rotary import RotaryEmbedding, compute_inv_freq
from rollout.models import get_model_class
from rollout.models.loader import load_checkpoint, load_hf_config, load_named_tensors
from rollout.models.weights import WeightMapper
from tests.tiny_models import (
    FAMILIES,
    hf_logits,
    make_kv_caches,
    make_metadata,
    make_tiny_hf_model,
    save_tiny_checkpoint,
    tiny_config,
)

TOL = 1e-4
BLOCK_SIZE, NUM_BLOCKS = 4, 64


def build_ours(hf_model):
    model = get_model_class(hf_model.config)(hf_model.config)
    load_named_tensors(model, hf_model.named_parameters())
    return model.eval()


def run_steps(model, seqs, steps):
    """Feed ``seqs`` through the paged cache in ``steps`` (one list of new-token counts per step, one
    flattened batch each); return every token's logits per sequence, concatenated over steps."""
    kv = make_kv_caches(model, NUM_BLOCKS, BLOCK_SIZE)
    done, out = [0] * len(seqs), [[] for _ in seqs]
    for counts in steps:
        meta = make_metadata([(done[i], n) for i, n in enumerate(counts)], BLOCK_SIZE, NUM_BLOCKS)
        ids = torch.tensor([t for i, n in enumerate(counts) for t in seqs[i][done[i] : done[i] + n]])
        with torch.no_grad():
            logits = model.compute_logits(model(ids, meta.positions, kv, meta, TorchAttentionBackend()))
        assert logits.dtype == torch.float32
        for i, chunk in enumerate(logits.split(counts)):
            out[i].append(chunk)
            done[i] += counts[i]
    return [torch.cat(o) for o in out]


def random_seqs(lengths, vocab, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


# Step 1: two whole prompts and the first chunk of a third; step 2: decode two, finish the chunked
# prefill; steps 3-4: pure decode. Lengths pass the mistral window (8) and llama3's old context (64).
STEPS = [[5, 9, 40], [1, 1, 30], [1, 1, 1], [1, 1, 1]]


def assert_matches_hf(hf_model, model, steps=STEPS):
    lengths = [sum(s[i] for s in steps) for i in range(len(steps[0]))]
    seqs = random_seqs(lengths, hf_model.config.vocab_size)
    for seq, ours in zip(seqs, run_steps(model, seqs, steps)):
        diff = (ours - hf_logits(hf_model, seq)).abs().max().item()
        assert diff <= TOL, diff


@pytest.mark.parametrize("family", FAMILIES)
def test_matches_hf_prefill_chunked_and_decode(family):
    hf = make_tiny_hf_model(family)
    assert_matches_hf(hf, build_ours(hf))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("shards", [1, 2])
def test_checkpoint_loads_and_matches_hf(family, shards, tmp_path):
    hf = make_tiny_hf_model(family, seed=3)
    save_tiny_checkpoint(hf, tmp_path, shards=shards)
    config = load_hf_config(tmp_path)
    assert config.architectures == [type(hf).__name__]
    model = get_model_class(config)(config)
    load_checkpoint(model, tmp_path)
    mapper = WeightMapper(model)
    for name, tensor in hf.state_dict().items():
        torch.testing.assert_close(mapper.resolve(name).dst(), tensor, rtol=0, atol=0)
    assert_matches_hf(hf, model.eval(), steps=[[6, 3], [1, 4], [1, 1]])


@pytest.mark.parametrize("family", FAMILIES)
def test_mapper_accepts_exactly_hf_names(family):
    hf = make_tiny_hf_model(family)
    mapper = WeightMapper(get_model_class(hf.config)(hf.config))
    assert set(mapper.hf_names()) == set(hf.state_dict())  # tied lm_head.weight included
    for name, tensor in hf.state_dict().items():
        assert mapper.expected_shape(name) == tuple(tensor.shape)


def test_qwen2_sliding_layers_from_layer_types():
    hf = make_tiny_hf_model("qwen2", use_sliding_window=True, sliding_window=6, max_window_layers=1)
    model = build_ours(hf)
    assert model.sliding_windows == (None, 6)
    assert_matches_hf(hf, model)


def test_qwen3_with_attention_bias():
    hf = make_tiny_hf_model("qwen3", attention_bias=True)
    assert_matches_hf(hf, build_ours(hf), steps=[[7, 12], [1, 1]])


def test_tied_lm_head_shares_embedding_storage():
    hf = make_tiny_hf_model("qwen2")
    model = build_ours(hf)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    new = torch.randn_like(model.lm_head.weight)
    WeightMapper(model).copy_("lm_head.weight", new)
    assert torch.equal(model.model.embed_tokens.weight, new)


def test_copy_is_in_place_and_converts_dtype():
    hf = make_tiny_hf_model("llama")
    model = build_ours(hf)
    mapper = WeightMapper(model)
    qkv = model.model.layers[1].self_attn.qkv_proj.weight
    ptr = qkv.data_ptr()
    k_new = torch.randn(mapper.expected_shape("model.layers.1.self_attn.k_proj.weight"), dtype=torch.float64)
    mapper.copy_("model.layers.1.self_attn.k_proj.weight", k_new)
    assert qkv.data_ptr() == ptr and qkv.dtype == torch.float32
    q_size = model.hf_config.num_attention_heads * model.head_dim
    torch.testing.assert_close(qkv.data[q_size : q_size + k_new.shape[0]], k_new.float())
    torch.testing.assert_close(qkv.data[:q_size], hf.model.layers[1].self_attn.q_proj.weight)


def test_validate_rejects_bad_weights_naming_them():
    mapper = WeightMapper(build_ours(make_tiny_hf_model("mistral")))
    good = "model.layers.0.mlp.up_proj.weight"
    with pytest.raises(ValueError, match="model.layers.0.mlp.bogus.weight"):
        mapper.validate("model.layers.0.mlp.bogus.weight", torch.zeros(1))
    with pytest.raises(KeyError, match="bogus"):
        mapper.resolve("bogus")
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.up_proj\.weight.*\(3, 3\).*\(128, 64\)"):
        mapper.validate(good, torch.zeros(3, 3))
    with pytest.raises(TypeError, match=good):
        mapper.validate(good, torch.zeros(128, 64, dtype=torch.int64))
    with pytest.raises(TypeError, match=good):
        mapper.validate(good, [[0.0]])
    mapper.validate(good, torch.zeros(128, 64, dtype=torch.bfloat16))
    mapper.copy_("model.layers.0.self_attn.rotary_emb.inv_freq", torch.zeros(8))  # tolerated, skipped


def test_missing_weight_is_reported():
    hf = make_tiny_hf_model("llama")
    model = get_model_class(hf.config)(hf.config)
    partial = [(n, t) for n, t in hf.named_parameters() if "layers.1.self_attn.v_proj" not in n]
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.v_proj\.weight"):
        load_named_tensors(model, partial)


def test_unsupported_architecture_lists_supported():
    config = LlamaConfig(architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel.*LlamaForCausalLM.*MistralForCausalLM.*Qwen3"):
        get_model_class(config)
    assert get_model_class(tiny_config("qwen3")).__name__ == "Qwen3ForCausalLM"  # by model_type


def test_load_hf_config_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_hf_config(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf_config(tmp_path)
    tiny_config("llama").save_pretrained(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match=r"no \*\.safetensors.*pytorch_model\.bin"):
        load_hf_config(tmp_path)
    index = {"weight_map": {"a": "gone.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match="gone.safetensors"):
        load_hf_config(tmp_path)


ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": tiny_config("llama").rope_parameters,
    "yarn": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 128},
}


@pytest.mark.parametrize("rope", list(ROPES))
def test_rotary_table_matches_hf(rope):
    config = tiny_config("llama", rope_parameters=dict(ROPES[rope]))
    head_dim = config.hidden_size // config.num_attention_heads
    ours = RotaryEmbedding.from_config(config, head_dim)
    positions = torch.arange(config.max_position_embeddings)
    cos, sin = ours(positions)
    hf_cos, hf_sin = LlamaRotaryEmbedding(config)(torch.zeros(1, dtype=torch.float32), positions[None])
    torch.testing.assert_close(cos, hf_cos[0, :, : head_dim // 2], rtol=0, atol=0)
    torch.testing.assert_close(sin, hf_sin[0, :, : head_dim // 2], rtol=0, atol=0)


def test_rotary_reads_transformers4_spelling():
    scaling = {"type": "linear", "factor": 2.0}
    old = SimpleNamespace(rope_theta=500000.0, max_position_embeddings=512, rope_scaling=scaling)
    new = tiny_config("llama", rope_parameters={"rope_type": "linear", "rope_theta": 500000.0, "factor": 2.0})
    assert torch.equal(compute_inv_freq(old, 16)[0], compute_inv_freq(new, 16)[0])
    plain = SimpleNamespace(rope_theta=500000.0, max_position_embeddings=512, rope_scaling=None)
    assert not torch.equal(compute_inv_freq(plain, 16)[0], compute_inv_freq(old, 16)[0])
    with pytest.raises(ValueError, match="dynamic.*llama3"):
        compute_inv_freq(SimpleNamespace(max_position_embeddings=64, rope_scaling={"type": "dynamic"}), 16)


def test_bf16_build_keeps_rotary_float32():
    hf = make_tiny_hf_model("qwen3")
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = build_ours(hf)
    finally:
        torch.set_default_dtype(old)
    assert model.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.bfloat16
    assert model.model.rotary_emb.cos_sin_cache.dtype == torch.float32
    model.half()
    assert model.model.rotary_emb.cos_sin_cache.dtype == torch.float32
    model.to(torch.bfloat16)
    seqs = random_seqs([12], hf.config.vocab_size)
    logits = run_steps(model, seqs, [[10], [1], [1]])[0]
    assert (logits - hf_logits(hf, seqs[0])).abs().max().item() < 0.25  # bf16 rounding only


def test_compute_logits_keeps_the_model_dtype_when_asked() -> None:
    """``compute_logits(h, float32=False)`` hands the lm_head's own dtype to the fused sampler (no [N, vocab]
    float32 copy per step); the default stays float32, equal to it converted."""
    hf = make_tiny_hf_model("llama")
    model = build_ours(hf).to(torch.bfloat16)
    h = torch.randn(3, hf.config.hidden_size, dtype=torch.bfloat16)
    with torch.no_grad():
        raw, full = model.compute_logits(h, float32=False), model.compute_logits(h)
    assert raw.dtype == torch.bfloat16 and full.dtype == torch.float32
    assert torch.equal(raw.float(), full)
