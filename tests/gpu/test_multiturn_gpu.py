"""Multi-turn conversations on the GPU (issue 22; skipped without CUDA): the environment loop through the CUDA
runner's async path (carry-over, late stops, graphs) gives the sync path's tokens, logprobs that match HF float32
teacher forcing over the whole conversation, and no re-prefill."""

import random
import time

import pytest
import torch

from rollout import Engine, SamplingParams
from rollout.envs import EnvLimits, EnvLoop, EnvSpec

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


class Replies:
    """A step environment replying 8-24 token ids after a 0-20 ms sleep, three model turns."""

    def reset(self, **row):
        self.rng, self.turn = random.Random(row["seed"]), 0
        return None

    def step(self, text):
        self.turn += 1
        if self.turn >= 3:
            return None
        time.sleep(self.rng.uniform(0, 0.02))
        return " ".join(str(self.rng.randrange(10, 4000)) for _ in range(self.rng.randint(8, 24)))


class Ids:
    def prompt(self, prompt, reset_text):
        return "", list(prompt)

    def reply(self, messages, last):
        return [int(t) for t in messages[0]["content"].split()]

    def decode(self, ids):
        return ""


def _hf():
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                      num_key_value_heads=2, vocab_size=4096, max_position_embeddings=4096)
    with torch.device("cuda"):
        return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def _run(hf, async_mode, n=48):
    eng = Engine.from_pretrained(hf, dtype="float32", max_model_len=1024, num_blocks=2048, max_num_seqs=32,
                                 async_mode=async_mode)
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(8, 120, (n,), generator=g).tolist()
    prompts = [torch.randint(10, 4000, (k,), generator=g).tolist() for k in lens]
    loop = EnvLoop(eng, EnvSpec(Replies), None, EnvLimits(max_turns=3, max_turn_tokens=40), renderer=Ids())
    try:
        eps = loop.run([{"seed": i} for i in range(n)], prompts, [SamplingParams(temperature=0, max_tokens=40,
                                                                                 ignore_eos=True)] * n)
    finally:
        loop.close()
    return eps, eng.get_stats()


def test_async_env_loop_equals_sync_and_hf_without_reprefill():
    hf = _hf()
    runs = {mode: _run(hf, mode) for mode in (True, False)}
    (a, sa), (s, _) = runs[True], runs[False]
    assert [ep.completion_ids for ep in a] == [ep.completion_ids for ep in s]
    given = sum(len(ep.prompt_ids) + ep.env_mask.count(0) for ep in a)
    assert sa.num_prefill_tokens == given
    _assert_hf_logprobs(hf, a[:8])


def test_replies_as_decode_rows_replay_graphs_with_the_same_tokens():
    """engine.turn_rows_max_tokens: replies run as one-token rows of decode steps (graph replays through the
    async path, carry-over from a reply's last row), with the prefill path's tokens and HF's logprobs."""
    hf = _hf()
    runs = {}
    for rows in (0, 32):
        eng = Engine.from_pretrained(hf, dtype="float32", max_model_len=1024, num_blocks=2048, max_num_seqs=32,
                                     async_mode=True, turn_rows_max_tokens=rows)
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(10, 4000, (k,), generator=g).tolist()
                   for k in torch.randint(8, 120, (48,), generator=g).tolist()]
        loop = EnvLoop(eng, EnvSpec(Replies), None, EnvLimits(max_turns=3, max_turn_tokens=40), renderer=Ids())
        eng.runner.clock.record_steps = True
        n0 = len(eng.runner.clock.records)
        try:
            eps = loop.run([{"seed": i} for i in range(48)], prompts,
                           [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)] * 48)
        finally:
            loop.close()
        recs = eng.runner.clock.records[n0:]
        runs[rows] = eps, sum(not r.decode for r in recs), sum(bool(r.graph_b) for r in recs)
    (off, off_mixed, _), (on, on_mixed, on_graphs) = runs[0], runs[32]
    assert [ep.completion_ids for ep in on] == [ep.completion_ids for ep in off]
    assert [ep.env_mask for ep in on] == [ep.env_mask for ep in off]
    assert on_mixed < off_mixed and on_graphs > 0, (on_mixed, off_mixed, on_graphs)
    _assert_hf_logprobs(hf, on[:8])


def _assert_hf_logprobs(hf, episodes):
    """Three turns each, and every model token's logprob is HF float32's teacher-forced one over the whole
    conversation (environment tokens included as context)."""
    with torch.no_grad():
        for ep in episodes:
            assert ep.num_turns == 3 and ep.error is None
            ids = torch.tensor([ep.prompt_ids + ep.completion_ids], device="cuda")
            lp = torch.log_softmax(hf(ids).logits[0, len(ep.prompt_ids) - 1 : -1].float(), -1).cpu()
            want = lp[torch.arange(len(ep.completion_ids)), torch.tensor(ep.completion_ids)]
            model = torch.tensor(ep.env_mask, dtype=torch.bool)
            assert torch.allclose(torch.tensor(ep.logprobs)[model], want[model], atol=1e-3)
