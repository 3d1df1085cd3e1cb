"""The fused teacher-forced logprob kernel against its torch specification, through Triton's interpreter
(one child process with TRITON_INTERPRET=1, as tests/test_sampling_kernel.py)."""

from __future__ import annotations

import pytest
import torch

from rollout.engine.runners.prompt_logprobs import token_logprobs_torch
from tests.interpreter import child_main, child_verdicts


def check_matches_torch() -> None:
    from rollout.kernels.token_logprobs import token_logprobs

    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        logits = (torch.randn(6, 300, generator=g) * 4).to(dtype)
        logits[2, 7] = 60.0  # one token dominates
        inv = torch.tensor([1.0, 1 / 0.7, 1.0, 2.0, 1 / 1.3, 1.0])
        targets = torch.tensor([0, 299, 7, 150, 3, 64])
        lp, lse = token_logprobs(logits, inv, targets, block=64)
        ref_lp, ref_lse = token_logprobs_torch(logits, inv, targets)
        assert torch.allclose(lp, ref_lp, atol=1e-5) and torch.allclose(lse, ref_lse, atol=1e-5), (lp, ref_lp)
        want = torch.log_softmax(logits.float() * inv[:, None], -1).gather(1, targets[:, None])[:, 0]
        assert torch.allclose(lp, want, atol=1e-5)
    empty = token_logprobs(torch.zeros(0, 10), torch.zeros(0), torch.zeros(0, dtype=torch.int64))
    assert empty[0].shape == (0,)


CHECKS = {"matches_torch": check_matches_torch}


@pytest.fixture(scope="module")
def verdicts() -> dict[str, str]:
    return child_verdicts(__file__)


@pytest.mark.parametrize("name", list(CHECKS))
def test_token_logprobs_kernel(verdicts: dict[str, str], name: str) -> None:
    assert verdicts[name] == "ok", verdicts[name]


if __name__ == "__main__":
    child_main(CHECKS)
