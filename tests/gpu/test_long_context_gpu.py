"""Long sequences on the GPU (skipped without CUDA): a 32K single-sequence generation with bf16 and fp8
KV, teacher-forced through Hugging Face; the KV cache sized beside the measured step workspace; fp8's
capacity. Models are small random-init ones with W2's attention shape (12 q heads, 2 kv heads, D 128).
"""

import gc

import pytest
import torch

from rollout import Engine, SamplingParams
from rollout.engine.runners.kv_cache import KVCacheTooLarge

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(autouse=True)
def free_memory():
    """Engines of earlier tests must not shrink the free memory these tests size caches from."""
    gc.collect()
    torch.cuda.empty_cache()


def _hf(vocab=4096, layers=2, seed=0):
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(seed)
    cfg = Qwen3Config(hidden_size=256, intermediate_size=512, num_hidden_layers=layers, num_attention_heads=12,
                      num_key_value_heads=2, head_dim=128, vocab_size=vocab, max_position_embeddings=32768,
                      tie_word_embeddings=True, rope_theta=1e6, initializer_range=0.05)
    with torch.device("cuda"):
        return AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa").eval()


@pytest.mark.parametrize("kv", ["auto", "fp8"])
def test_32k_single_sequence_generation(kv):
    hf = _hf()
    prompt = torch.randint(0, 4096, (1024,), generator=torch.Generator().manual_seed(0)).tolist()
    new = 32000 - len(prompt)
    eng = Engine.from_pretrained(hf, dtype="bfloat16", max_model_len=32768, max_num_seqs=4, kv_cache_dtype=kv)
    out = eng.generate([prompt], SamplingParams(temperature=0, max_tokens=new, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == len(out.logprobs) == new and out.finish_reason == "length"
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + out.token_ids], device="cuda")).logits[0, len(prompt) - 1 : -1]
        lp = torch.log_softmax(logits.float(), -1)
    ref = lp[torch.arange(new, device="cuda"), torch.tensor(out.token_ids, device="cuda")].cpu()
    diff = (ref - torch.tensor(out.logprobs)).abs()
    tail = diff[-4096:].mean().item()  # the last 4K tokens attend over 28K+ of context
    print(f"32K kv={kv}: mean |logprob diff| vs HF bf16 {diff.mean():.4f} (last 4K: {tail:.4f}), "
          f"capacity {eng.kv.num_tokens} tokens")
    assert torch.isfinite(torch.tensor(out.logprobs)).all()
    assert diff.mean() < (0.03 if kv == "auto" else 0.08) and tail < (0.05 if kv == "auto" else 0.1)


def test_explicit_num_blocks_must_leave_the_step_workspace():
    """The 32K OOM of issue 13: the bench sized the cache for every sequence and the engine took it,
    leaving 0.2 GiB for the sampler. Now the engine refuses, names the largest that fits, and that
    one runs a full batch of 256 sampled rows over a 152K vocab (the sampler's heaviest variant)."""
    hf = _hf(vocab=151936)
    opts = dict(dtype="bfloat16", max_model_len=4096, max_num_seqs=256)
    with pytest.raises(KVCacheTooLarge, match="largest num_blocks that fits is") as err:
        Engine.from_pretrained(hf, num_blocks=10**8, **opts)
    largest = err.value.max_num_blocks
    err.value.__traceback__ = None  # frees the refused engine's tensors the traceback still holds
    del err
    gc.collect()
    torch.cuda.empty_cache()
    # The count named must run as named: the engine keeps EXPLICIT_HEADROOM_FRACTION of the device beside it for
    # what the first build left outside the allocator (CUDA context, loaded kernels) and for fragmentation.
    eng = Engine.from_pretrained(hf, num_blocks=largest, **opts)
    # the lm_head's [rows, vocab] logits (bf16: the fused sampler reads them in place, writing nothing [rows, vocab])
    assert eng.kv.workspace_bytes >= 256 * 151936 * 2, eng.kv.workspace_bytes
    prompts = [[i % 100 + 1] * 16 for i in range(256)]
    sp = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, min_p=0.01, max_tokens=8, ignore_eos=True, seed=1)
    outs = eng.generate(prompts, sp)
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)
    print(f"workspace {eng.kv.workspace_bytes / 2**30:.2f} GiB, largest num_blocks {largest}")


def test_fp8_capacity_is_at_least_1_9x_bf16():
    hf = _hf(layers=4)
    caps = {}
    for kv in ("auto", "fp8"):
        eng = Engine.from_pretrained(hf, dtype="bfloat16", max_model_len=32768, max_num_seqs=512,
                                     gpu_memory_utilization=0.15, kv_cache_dtype=kv)
        caps[kv] = eng.kv.num_tokens
        assert caps[kv] < 512 * 32768, "capped by 'enough for every sequence', not by memory"
        del eng
        gc.collect()
        torch.cuda.empty_cache()
    print(f"KV capacity: bf16 {caps['auto']} tokens, fp8 {caps['fp8']} tokens ({caps['fp8'] / caps['auto']:.3f}x)")
    assert caps["fp8"] >= 1.9 * caps["auto"]
