"""Co-location on the GPU (skipped without CUDA): memory released by sleep (printed), identical results after
wake, weights pushed while asleep served after wake, in-flight pushes with per-token versions under graphs."""

import gc

import pytest
import torch

from rollout import Engine, SamplingParams
from trainer_hooks.weights import bench_weight_push, push_weights

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

MiB = 2**20


def _hf(seed=0):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                      num_key_value_heads=2, vocab_size=4096, max_position_embeddings=4096)
    with torch.device("cuda"):
        return AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()


def _engine(hf, **kw):
    return Engine.from_pretrained(hf, dtype="bfloat16", max_model_len=1024, num_blocks=4096, **kw)


def _prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 4096, (int(k),), generator=g).tolist() for k in torch.randint(8, 200, (n,), generator=g)]


def _results(outs):
    return [[(c.token_ids, c.logprobs) for c in o.outputs] for o in outs]


PARAMS = [SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
          SamplingParams(n=3, temperature=0.9, top_p=0.95, max_tokens=32, ignore_eos=True, seed=4)]


def _allocated():
    gc.collect()  # tensors the engine dropped but a reference cycle still holds would count as live
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_releases_memory_and_wake_restores_results(level):
    hf = _hf()
    eng = _engine(hf)
    prompts = _prompts(12)
    params = [PARAMS[i % 2] for i in range(len(prompts))]
    before = _results(eng.generate(prompts, params))
    kv = eng.get_stats().kv_cache_bytes
    weights = sum(p.numel() * p.element_size() for p in eng.model.parameters())
    awake = _allocated()
    reported = eng.sleep(level=level)
    asleep = _allocated()
    released = awake - asleep
    expected = kv + (weights if level == 2 else 0)
    print(f"sleep(level={level}): memory_allocated fell by {released / MiB:.1f} MiB "
          f"(engine reports {reported / MiB:.1f} MiB; KV cache {kv / MiB:.1f} MiB, weights {weights / MiB:.1f} MiB)")
    assert released >= 0.99 * expected and reported >= expected
    assert eng.get_stats().kv_cache_bytes == 0
    eng.wake_up()
    print(f"wake_up: memory_allocated back to {(_allocated() - asleep) / MiB:.1f} MiB above the sleeping level")
    assert _results(eng.generate(prompts, params)) == before


def test_weights_pushed_while_asleep_are_served_after_wake():
    old, new = _hf(0), _hf(1)
    prompts = _prompts(8, seed=1)
    eng = _engine(old)
    eng.generate(prompts, PARAMS[0])  # graphs captured against the old storage
    eng.sleep(level=2)
    assert push_weights(eng, new.named_parameters(), version=7) == 7  # GPU tensors into offloaded weights
    eng.wake_up()
    params = [PARAMS[i % 2] for i in range(len(prompts))]
    got = eng.generate(prompts, params)
    want = _engine(new).generate(prompts, params)
    assert _results(got) == _results(want)
    assert all(v == 7 for o in got for c in o.outputs for v in c.policy_versions)


@torch.no_grad()
def _mean_gap(hf, prompt, toks, lps, positions):
    ids = torch.tensor([prompt + toks], device="cuda")
    ref = torch.log_softmax(hf(ids).logits[0, len(prompt) - 1: -1].float(), -1)
    idx = torch.tensor(positions)
    want = ref[idx.cuda(), torch.tensor(toks, device="cuda")[idx.cuda()]].cpu()
    return (want - torch.tensor(lps)[idx]).abs().mean().item()


@pytest.mark.parametrize("async_mode", [True, False])
def test_in_flight_push_switches_versions_on_gpu(async_mode):
    old, new = _hf(0), _hf(1)
    prompts = _prompts(16, seed=2)
    eng = _engine(old, async_mode=async_mode)
    sp = SamplingParams(temperature=1.0, max_tokens=48, ignore_eos=True, seed=9)
    ids = [eng.add_request(p, sp) for p in prompts]
    done = {}
    for _ in range(12):
        done.update({o.request_id: o for o in eng.step()})
    push_weights(eng, new.named_parameters())
    while eng.has_unfinished_requests():
        done.update({o.request_id: o for o in eng.step()})
    gaps = {0: [], 1: []}
    for rid, p in zip(ids, prompts):
        c = done[rid].outputs[0]
        switch = c.policy_versions.index(1)
        assert c.policy_versions == [0] * switch + [1] * (48 - switch) and 0 < switch < 48
        gaps[0].append(_mean_gap(old, p, c.token_ids, c.logprobs, list(range(switch))))
        gaps[1].append(_mean_gap(new, p, c.token_ids, c.logprobs, list(range(switch, 48))))
    mean = {v: sum(g) / len(g) for v, g in gaps.items()}
    print(f"async={async_mode}: mean |logprob - HF bf16| before the push {mean[0]:.5f}, after {mean[1]:.5f}")
    assert mean[0] < 0.01 and mean[1] < 0.01


def test_bench_weight_push_on_gpu():
    eng, new = _engine(_hf(0)), _hf(1)
    prompts = _prompts(8, seed=3)
    eng.generate(prompts, PARAMS[0])  # graphs captured under the old weights
    result = bench_weight_push(eng, new, repeats=2)
    print({k: round(v, 4) for k, v in result.items()})
    assert result["device_s"] > 0 and result["pinned_host_s"] > 0
    # What counts: after the pushes the engine serves the new model, exactly as one built from it.
    params = [PARAMS[i % 2] for i in range(len(prompts))]
    assert _results(eng.generate(prompts, params)) == _results(_engine(new).generate(prompts, params))
