"""Prompt logprobs (``Engine.score``) never make the host wait for the step's stream (skipped without CUDA).

A copy from pageable host memory first waits for the stream, i.e. for the whole forward just enqueued, so the
host could not prepare the next step meanwhile: scoring 256 x 4K ran at 0.78 GPU busy (issue 21's bar).
"""

from __future__ import annotations

import pytest
import torch

from rollout.engine.runners.inputs import PromptInputs
from rollout.engine.runners.prompt_logprobs import compute_prompt_logprobs, token_logprobs_torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


class Head(torch.nn.Module):
    def __init__(self, hidden: int, vocab: int) -> None:
        super().__init__()
        self.lm_head = torch.nn.Linear(hidden, vocab, bias=False, device="cuda", dtype=torch.bfloat16)
        self.vocab_size = vocab

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(h).float()


def test_prompt_logprobs_do_not_wait_for_the_stream() -> None:
    torch.manual_seed(0)
    model, n = Head(64, 1000), 300
    hidden = torch.randn(n, 64, device="cuda", dtype=torch.bfloat16)
    targets = torch.randint(0, 1000, (n - 1,)).tolist()
    pr = PromptInputs(list(range(n - 1)), targets, [1.0] * (n - 1), [0] * (n - 1), [1.0] * (n - 1),
                      [0.0] * (n - 1), [0] * (n - 1), [(0, 0, n - 1, 0)])
    compute_prompt_logprobs(model, hidden, pr, hidden.device)  # warm: kernels compiled, host cache pinned
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU work ahead on the stream, as a step's forward
    out = compute_prompt_logprobs(model, hidden, pr, hidden.device)
    assert not torch.cuda.current_stream().query(), "compute_prompt_logprobs waited for the stream"
    torch.cuda.synchronize()
    logits = model.lm_head(hidden[: n - 1])
    want, _ = token_logprobs_torch(logits, torch.ones(n - 1, device="cuda"), torch.tensor(targets, device="cuda"))
    torch.testing.assert_close(out.logprobs, want, atol=1e-4, rtol=0)
