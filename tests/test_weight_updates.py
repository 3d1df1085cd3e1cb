"""Weight updates (issue 5): HF names, subsets, dtypes, streaming, tied heads, all-or-nothing rejection,
prefix-cache invalidation, and in-flight swaps with per-token policy versions (steps and threads)."""

from __future__ import annotations

import copy
import re
import threading
import time

import pytest
import torch
from torch import nn

from tests.engine_helpers import assert_matches_hf, greedy, hf_logprobs, make_engine, random_prompts
from tests.tiny_models import make_tiny_hf_model
from trainer_hooks.weights import HFWeights, bench_weight_push, normalize_name, push_weights


@pytest.fixture(scope="module")
def old():
    return make_tiny_hf_model("llama", seed=0)


@pytest.fixture(scope="module")
def new():
    return make_tiny_hf_model("llama", seed=1)


def _engine_update(engine, tensors, version=None):
    return engine.update_weights(tensors, version=version)


UPDATES = {"engine.update_weights": _engine_update, "push_weights": push_weights}


@pytest.fixture(params=sorted(UPDATES))
def update(request):
    return UPDATES[request.param]


def _snapshot(engine) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in engine.model.state_dict().items()}


def _same_weights(engine, snap) -> bool:
    return all(torch.equal(v, snap[k]) for k, v in engine.model.state_dict().items())


# ---- names ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "wrapped, plain",
    [
        ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.q_proj.weight"),
        ("module.model.norm.weight", "model.norm.weight"),
        ("module.module.lm_head.weight", "lm_head.weight"),
        ("_orig_mod.model.embed_tokens.weight", "model.embed_tokens.weight"),
        ("module._orig_mod.model.layers.1.mlp.up_proj.weight", "model.layers.1.mlp.up_proj.weight"),
        ("model.layers.0._fsdp_wrapped_module._checkpoint_wrapped_module.mlp.down_proj.weight",
         "model.layers.0.mlp.down_proj.weight"),
        ("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight",
         "model.layers.0.self_attn.q_proj.weight"),
        ("model.layers.0.self_attn.q_proj.base_layer.weight", "model.layers.0.self_attn.q_proj.weight"),
        ("base_model.model.lm_head.modules_to_save.default.weight", "lm_head.weight"),
        ("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight", None),
        ("base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight", None),
        ("base_model.model.lm_head.original_module.weight", None),
    ],
)
def test_normalize_name(wrapped, plain):
    assert normalize_name(wrapped) == plain


class _Lora(nn.Module):
    """PEFT's LoRA layer layout: the original Linear as ``base_layer`` plus adapter factors."""

    def __init__(self, base: nn.Linear) -> None:
        super().__init__()
        self.base_layer = base
        self.lora_A = nn.ModuleDict({"default": nn.Linear(base.in_features, 2, bias=False)})
        self.lora_B = nn.ModuleDict({"default": nn.Linear(2, base.out_features, bias=False)})


def _peft_like(hf):
    model = copy.deepcopy(hf)
    for layer in model.model.layers:
        layer.self_attn.q_proj = _Lora(layer.self_attn.q_proj)
        layer.self_attn.v_proj = _Lora(layer.self_attn.v_proj)
    outer = nn.Module()
    outer.base_model = nn.Module()
    outer.base_model.model = model
    return outer


def test_wrapped_models_push_under_plain_names(old, new):
    engine = make_engine(old, block_size=8)
    prompt = random_prompts(1, old.config.vocab_size, seed=3)[0]
    ddp_compiled = nn.Module()
    ddp_compiled.module = nn.Module()
    ddp_compiled.module._orig_mod = new
    peft = _peft_like(old)
    assert any(".lora_A." in n for n, _ in peft.named_parameters())
    for source, expected, version in ((ddp_compiled, new, 1), (peft, old, 2)):
        assert set(HFWeights(source).names()) == {n for n, _ in old.named_parameters()}
        assert push_weights(engine, HFWeights(source)) == version
        assert_matches_hf(expected, prompt, engine.generate([prompt], greedy(6))[0].outputs[0])


# ---- what an update accepts ---------------------------------------------------------------------------
def test_subset_update_changes_only_those_weights(old, new, update):
    engine = make_engine(old, block_size=8)
    names = ["model.layers.1.mlp.down_proj.weight", "model.layers.0.self_attn.k_proj.weight"]
    mixed = copy.deepcopy(old)
    new_params = dict(new.named_parameters())
    with torch.no_grad():
        for name, p in mixed.named_parameters():
            if name in names:
                p.copy_(new_params[name])
    assert update(engine, [(n, new_params[n].detach()) for n in names]) == 1
    for prompt in random_prompts(2, old.config.vocab_size, seed=4):
        assert_matches_hf(mixed, prompt, engine.generate([prompt], greedy(6))[0].outputs[0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_other_float_dtypes_are_converted(old, new, update, dtype):
    engine = make_engine(old, block_size=8)
    cast = {n: p.detach().to(dtype) for n, p in new.named_parameters()}
    reference = copy.deepcopy(new)
    with torch.no_grad():  # what a float32 engine holds after the cast: bf16 rounding stays, fp64 is exact
        for n, p in reference.named_parameters():
            p.copy_(cast[n].float())
    update(engine, cast)
    prompt = random_prompts(1, old.config.vocab_size, seed=5)[0]
    assert_matches_hf(reference, prompt, engine.generate([prompt], greedy(6))[0].outputs[0])


@pytest.mark.parametrize("form", ["generator", "iterator", "hf_weights", "module"])
def test_streamed_sources(old, new, form):
    engine = make_engine(old, block_size=8)
    sources = {
        "generator": lambda: ((n, p.detach().clone()) for n, p in new.named_parameters()),
        "iterator": lambda: iter(list(new.named_parameters())),
        "hf_weights": lambda: HFWeights(new),
        "module": lambda: new,
    }
    assert push_weights(engine, sources[form](), version=5) == 5 == engine.policy_version
    prompt = random_prompts(1, old.config.vocab_size, seed=6)[0]
    out = engine.generate([prompt], greedy(6))[0].outputs[0]
    assert out.policy_versions == [5] * 6
    assert_matches_hf(new, prompt, out)


def test_engine_update_weights_takes_a_generator(old, new):
    engine = make_engine(old, block_size=8)
    engine.update_weights((n, p.detach()) for n, p in new.named_parameters())
    prompt = random_prompts(1, old.config.vocab_size, seed=7)[0]
    assert_matches_hf(new, prompt, engine.generate([prompt], greedy(6))[0].outputs[0])


def test_tied_lm_head_name_updates_the_shared_embedding(update):
    old_q, new_q = make_tiny_hf_model("qwen2", seed=0), make_tiny_hf_model("qwen2", seed=1)
    assert old_q.config.tie_word_embeddings and "lm_head.weight" not in dict(old_q.named_parameters())
    engine = make_engine(old_q, block_size=8)
    head = new_q.lm_head.weight.detach()
    update(engine, [("lm_head.weight", head)])
    reference = copy.deepcopy(old_q)
    with torch.no_grad():
        reference.lm_head.weight.copy_(head)  # tied: the embedding moves with it
    assert torch.equal(reference.model.embed_tokens.weight, head)
    prompt = random_prompts(1, old_q.config.vocab_size, seed=8)[0]
    assert_matches_hf(reference, prompt, engine.generate([prompt], greedy(6))[0].outputs[0])


# ---- rejection leaves everything unchanged ------------------------------------------------------------
def _bad_updates(new):
    good = [(n, p.detach().clone()) for n, p in new.named_parameters()]
    last = good[-1][0]
    shape = good[0][1]
    return {
        "unknown name": (good + [("model.layers.9.mlp.up_proj.weight", shape)], "model.layers.9.mlp.up_proj.weight"),
        "wrong shape": (good + [(last, torch.zeros(3, 3))], last),
        "nan": (good[:-1] + [(last, torch.full_like(good[-1][1], float("nan")))], last),
        "inf": (good[:-1] + [(last, torch.full_like(good[-1][1], float("inf")))], last),
        "int dtype": (good[:-1] + [(last, torch.zeros_like(good[-1][1], dtype=torch.int64))], last),
        "not a pair": (good + [("model.norm.weight",)], "item"),
    }


class _Reiterable:
    """Iterable but not an iterator: push_weights validates it in one pass and copies in a second."""

    def __init__(self, items):
        self.items = items

    def __iter__(self):
        return iter(self.items)


@pytest.mark.parametrize("case", ["unknown name", "wrong shape", "nan", "inf", "int dtype", "not a pair"])
@pytest.mark.parametrize("form", ["list", "generator", "reiterable"])
def test_every_rejection_leaves_engine_unchanged(old, new, update, case, form):
    engine = make_engine(old, block_size=8)
    prompt = random_prompts(1, old.config.vocab_size, seed=9)[0]
    before = engine.generate([prompt], greedy(6))[0].outputs[0]
    snap = _snapshot(engine)
    items, named = _bad_updates(new)[case]
    source = {"list": items, "generator": (x for x in items), "reiterable": _Reiterable(items)}[form]
    with pytest.raises((ValueError, TypeError, KeyError)) as info:
        update(engine, source)
    assert named in str(info.value)
    assert engine.policy_version == 0 and _same_weights(engine, snap)
    after = engine.generate([prompt], greedy(6))[0].outputs[0]
    assert after.token_ids == before.token_ids and after.logprobs == before.logprobs
    assert after.policy_versions == [0] * 6


def test_error_inside_the_iterator_rolls_back(old, new):
    engine = make_engine(old, block_size=8)
    snap = _snapshot(engine)

    def failing():
        yield from ((n, p.detach()) for n, p in list(new.named_parameters())[:5])
        raise RuntimeError("trainer-side gather failed")

    with pytest.raises(RuntimeError, match="gather failed"):
        push_weights(engine, failing())
    assert engine.policy_version == 0 and _same_weights(engine, snap)


def test_update_weights_refuses_non_iterables(old):
    engine = make_engine(old, block_size=8)
    with pytest.raises(TypeError, match="mapping or an iterable"):
        engine.update_weights(42)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="mapping or an iterable"):
        push_weights(engine, 42)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="version"):
        push_weights(engine, [], version="3")  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [2**63, -1, True, 1.5, 4])
def test_version_rule_refuses_out_of_range_and_going_back(old, new, bad):
    """Engine.update_weights owns the version: an int (not bool) in [current, 2**63), else ValueError naming
    the value and the range, nothing copied (4 is lower than the current 5)."""
    engine = make_engine(old, block_size=8)
    assert engine.update_weights(new.named_parameters(), version=5) == 5
    snap = _snapshot(engine)
    with pytest.raises(ValueError, match=re.escape("in [5, 2**63)") + ".*" + re.escape(f"got {bad!r}")):
        push_weights(engine, old, version=bad)
    assert engine.policy_version == 5 and _same_weights(engine, snap)
    assert engine.update_weights(old, version=5) == 5 and engine.update_weights(old) == 6  # equal: fine; None: +1


# ---- prefix cache -------------------------------------------------------------------------------------
def test_prefix_cache_entries_from_old_weights_are_dropped(old, new, update):
    engine = make_engine(old, block_size=4)
    prompt = random_prompts(1, old.config.vocab_size, lo=30, hi=31, seed=10)[0]
    first = engine.generate([prompt], greedy(4))[0].outputs[0]
    assert_matches_hf(old, prompt, first)
    assert engine.block_manager.num_cached_blocks > 0
    update(engine, new.named_parameters())
    assert engine.block_manager.num_cached_blocks == 0
    again = engine.generate([prompt], greedy(4))[0].outputs[0]
    assert_matches_hf(new, prompt, again)
    assert engine.get_stats().num_prompt_tokens >= 0  # the stats still read after a reset


# ---- in-flight updates --------------------------------------------------------------------------------
def _assert_split_matches(old, new, prompt, completion, temperature):
    """Tokens tagged 0 are the old model's (teacher-forced), tokens tagged 1 the new model's."""
    versions = completion.policy_versions
    switch = versions.index(1) if 1 in versions else len(versions)
    assert versions == [0] * switch + [1] * (len(versions) - switch), versions
    toks, got = completion.token_ids, torch.tensor(completion.logprobs)
    for model, positions in ((old, range(0, switch)), (new, range(switch, len(toks)))):
        if positions:
            ref = hf_logprobs(model, prompt, toks, temperature)
            idx = torch.tensor(list(positions))
            want = ref[idx, torch.tensor(toks)[idx]]
            assert torch.allclose(got[idx], want, atol=1e-4), (got[idx] - want).abs().max()
    return switch


@pytest.mark.parametrize("async_mode", [False, True])
def test_update_between_steps_switches_running_sequences(old, new, async_mode):
    engine = make_engine(old, block_size=4, async_mode=async_mode, max_num_batched_tokens=64)
    prompts = random_prompts(3, old.config.vocab_size, lo=6, hi=20, seed=11)
    params = [greedy(12), greedy(12, n=2), sampled(12)]
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    done = {}
    for _ in range(4):
        done.update({o.request_id: o for o in engine.step()})
    assert push_weights(engine, new.named_parameters()) == 1
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step()})
    switches = []
    for rid, prompt, sp in zip(ids, prompts, params):
        for c in done[rid].outputs:
            assert len(c.token_ids) == 12
            switches.append(_assert_split_matches(old, new, prompt, c, sp.temperature or 1.0))
    assert all(0 < s < 12 for s in switches), switches


def sampled(max_tokens):
    from rollout import SamplingParams

    return SamplingParams(temperature=0.8, max_tokens=max_tokens, ignore_eos=True, seed=3)


def test_update_from_another_thread_lands_at_a_step_boundary(old, new):
    engine = make_engine(old, block_size=4)
    prompts = random_prompts(4, old.config.vocab_size, lo=5, hi=15, seed=12)
    ids = [engine.add_request(p, greedy(40)) for p in prompts]
    started, pushed = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def trainer():
        try:
            started.wait(timeout=30)
            push_weights(engine, HFWeights(new))
        except BaseException as e:  # surfaced in the main thread
            errors.append(e)
        finally:
            pushed.set()

    thread = threading.Thread(target=trainer)
    thread.start()
    done, steps = {}, 0
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step()})
        steps += 1
        if steps == 3:
            started.set()
        if started.is_set() and not pushed.is_set():
            time.sleep(0.002)  # let the trainer thread take the lock between steps
    thread.join(timeout=30)
    assert not errors, errors
    assert engine.policy_version == 1
    switches = [_assert_split_matches(old, new, p, done[r].outputs[0], 1.0) for r, p in zip(ids, prompts)]
    assert all(0 < s < 40 for s in switches), switches


def test_bench_weight_push_runs_on_cpu(old, new):
    engine = make_engine(old, block_size=8)
    result = bench_weight_push(engine, new, repeats=1)
    assert result["bytes"] == sum(p.numel() * 4 for p in new.parameters())
    assert all(result[f"{k}_s"] > 0 for k in ("device", "pinned_host", "device_iterator"))
    assert engine.policy_version == 3


@pytest.fixture(scope="module")
def three(old, new):
    return [old, new, make_tiny_hf_model("llama", seed=2)]


@pytest.mark.parametrize("seed", range(4))
def test_random_in_flight_updates_under_preemption_and_sharing(three, seed):
    """Two pushes at random steps over a crowd with n > 1, shared prefixes, preemption, chunked prefill and
    (for some seeds) async mode: every token equals its version's model, teacher-forced."""
    import random

    from rollout import SamplingParams

    models = three
    rng = random.Random(seed)
    engine = make_engine(models[0], block_size=4, num_blocks=rng.choice([40, 80]),
                         max_num_batched_tokens=rng.choice([16, 64]), async_mode=seed % 2 == 1)
    prompts = random_prompts(5, 256, lo=3, hi=30, seed=seed)
    prompts += [prompts[0][: rng.randint(1, len(prompts[0]))] + p for p in prompts[:2]]
    requests = {}
    for p in prompts:
        sp = SamplingParams(n=rng.choice([1, 2, 4]), max_tokens=rng.randint(4, 16), seed=rng.randint(0, 99),
                            ignore_eos=True)
        requests[engine.add_request(p, sp)] = p
    done, version = {}, 0
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step()})
        if version < 2 and rng.random() < 0.2:
            version += 1
            push_weights(engine, models[version].named_parameters())
            requests[engine.add_request(prompts[0], SamplingParams(n=2, max_tokens=5, ignore_eos=True))] = prompts[0]
    print(f"seed {seed}: {version} pushes, {engine.get_stats().num_preemptions} preemptions")
    for rid, p in requests.items():
        for c in done[rid].outputs:
            assert c.policy_versions == sorted(c.policy_versions)
            for v in set(c.policy_versions):
                idx = torch.tensor([i for i, x in enumerate(c.policy_versions) if x == v])
                ref = hf_logprobs(models[v], p, c.token_ids)[idx, torch.tensor(c.token_ids)[idx]]
                assert torch.allclose(torch.tensor(c.logprobs)[idx], ref, atol=1e-4)
