"""Shared helpers for engine tests: build engines on tiny HF models and check against the oracle."""

from __future__ import annotations

import torch

from rollout import Engine, SamplingParams


def make_engine(hf_model, **options) -> Engine:
    options.setdefault("max_model_len", 256)
    return Engine.from_pretrained(hf_model, dtype="float32", device="cpu", **options)


def random_prompts(n: int, vocab: int, lo: int = 3, hi: int = 40, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(0, vocab, (k,), generator=g).tolist() for k in lens]


@torch.no_grad()
def hf_logprobs(hf_model, prompt: list[int], output: list[int], temperature: float = 1.0) -> torch.Tensor:
    """Teacher-forced log softmax(logits / T) at each output position: [len(output), V] float32."""
    ids = torch.tensor([prompt + output])
    logits = hf_model(ids).logits[0, len(prompt) - 1 : len(prompt) + len(output) - 1].float()
    return torch.log_softmax(logits / temperature, dim=-1)


def assert_matches_hf(hf_model, prompt, completion, temperature: float = 0.0, atol: float = 1e-4) -> None:
    """Every logprob equals the oracle's; for greedy, every token is an argmax of the oracle's logits."""
    toks = completion.token_ids
    assert len(completion.logprobs) == len(toks) and len(completion.policy_versions) == len(toks)
    if not toks:
        return
    ref = hf_logprobs(hf_model, prompt, toks, temperature if temperature > 0 else 1.0)
    got = torch.tensor(completion.logprobs)
    want = ref[torch.arange(len(toks)), torch.tensor(toks)]
    assert torch.allclose(got, want, atol=atol), (got - want).abs().max()
    if temperature == 0:
        assert bool((want >= ref.max(-1).values - atol).all()), "a greedy token is not an argmax"


def greedy(max_tokens: int = 8, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)
