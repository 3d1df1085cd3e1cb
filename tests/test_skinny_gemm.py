"""rollout/kernels/skinny_gemm.py (the decode-shaped GEMM timed against cuBLAS by bench/gemm_bench.py) against
``torch.nn.functional.linear``, in the Triton interpreter (a child process, as tests/test_kernels.py does)."""

from __future__ import annotations

import sys

import pytest
import torch

from tests.interpreter import child_main, child_verdicts


def _load():
    import rollout.kernels.skinny_gemm as sg

    return sg


def check_linear(m: int, n: int, k: int, bias: bool, config: tuple | None = None) -> None:
    """Both reduces (the last program's, a second kernel's) give linear's result and the same bits as each other
    and as a second call; the fused one leaves its counters at zero for the next call."""
    sg = _load()
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen) / k**0.5
    b = torch.randn(n, generator=gen) if bias else None
    cfg = sg.GemmConfig(*config) if config else sg.choose_config(m, n, k, 4)
    counters = torch.zeros(64, dtype=torch.int32)
    out = sg.skinny_linear(x, w, b, config=cfg, sms=4, counters=counters)
    ref = torch.nn.functional.linear(x, w, b)
    err = (out - ref).abs().max().item()
    assert out.shape == ref.shape and err <= 1e-4, f"max abs error {err:.3g}"
    assert not counters.any(), "the fused reduce must leave its counters at zero"
    again = sg.skinny_linear(x, w, b, config=cfg, sms=4, counters=counters)
    unfused = sg.skinny_linear(x, w, b, config=sg.GemmConfig(**{**vars(cfg), "fused": False}), sms=4)
    assert torch.equal(out, again) and torch.equal(out, unfused), "the same inputs must give the same bits"


def check_choose_config() -> None:
    sg = _load()
    c = sg.choose_config(128, 2048, 1536, 132)  # qkv at B=128 on the H200: 32 tiles, 4 slices of 384 (not 192)
    assert (c.block_m, c.block_n, c.split_k, c.num_warps) == (128, 64, 4, 8)
    assert sg.choose_config(32, 1536, 8960, 132).split_k == 16  # down_proj: 24 tiles x 16 slices of 560
    assert sg.choose_config(8, 151936, 1536, 132).split_k == 1  # the lm_head has columns enough
    assert sg.choose_config(1, 1536, 8960, 132).block_m == 16
    with pytest.raises(ValueError, match="block_n"):
        sg.GemmConfig(16, 48, 64, 1)
    with pytest.raises(ValueError, match="weight"):
        sg.skinny_linear(torch.zeros(2, 8), torch.zeros(3, 9), sms=4)
    with pytest.raises(ValueError, match="counters"):
        sg.skinny_linear(torch.zeros(2, 256), torch.zeros(64, 256), config=sg.GemmConfig(16, 16, 64, 2), sms=4,
                         counters=torch.zeros(2, dtype=torch.int32))


def check_linear_route() -> None:
    """A layer's "skinny" pick (rollout.layers.linear.linear's ``by_rows``) runs the kernel at that row count, with
    F.linear's result; other row counts, or a strided ``x``, stay on F.linear."""
    import rollout.layers.linear as lin

    sg = _load()
    calls, kernel = [], sg.skinny_linear
    sg.skinny_linear = lambda *a, **kw: calls.append(a[0].shape[0]) or kernel(*a, **kw)
    by_rows = {3: "skinny", 4: "skinny", 8: "skinny"}
    try:
        gen = torch.Generator().manual_seed(1)
        w, b = torch.randn(40, 96, generator=gen) / 10, torch.randn(40, generator=gen)
        for rows in (3, 8, 9):
            x = torch.randn(rows, 96, generator=gen)
            torch.testing.assert_close(lin.linear(x, w, b, by_rows), torch.nn.functional.linear(x, w, b),
                                       rtol=1e-4, atol=1e-4)
        strided = torch.randn(96, 4, generator=gen).t()  # [4, 96], stride 4 along K
        lin.linear(strided, w, None, by_rows)
        assert calls == [3, 8], calls
    finally:
        sg.skinny_linear = kernel


CHECKS = {
    "linear_route": check_linear_route,
    "one_split_with_bias": lambda: check_linear(5, 70, 96, True, (16, 64, 32, 1)),
    "split_k_rows_past_one_tile": lambda: check_linear(37, 130, 200, True, (16, 64, 32, 3)),
    "split_k_ragged_k_no_bias": lambda: check_linear(3, 64, 100, False, (16, 32, 32, 4)),
    "chosen_config": lambda: check_linear(20, 96, 1024, False),
    "choose_config": check_choose_config,
}


def test_gemm_bench_shapes_are_one_decode_steps_linears() -> None:
    """bench/gemm_bench.py times qwen2.5-1.5b's fused qkv (with its bias), o_proj, gate_up, down and lm_head."""
    from tests.script_helpers import load_bench

    gb = load_bench("gemm_bench")
    shapes = {name: (n, k, bias, calls) for name, n, k, bias, calls in gb.linears("qwen2.5-1.5b")}
    assert shapes == {"qkv": (2048, 1536, True, 28), "o_proj": (1536, 1536, False, 28),
                      "gate_up": (17920, 1536, False, 28), "down": (1536, 8960, False, 28),
                      "lm_head": (151936, 1536, False, 1)}
    assert gb.linears("llama3-8b")[0][1:3] == (6144, 4096)
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="CUDA"):
            gb.main(["--batches", "8"])


@pytest.fixture(scope="module")
def verdicts() -> dict[str, str]:
    return child_verdicts(__file__)


@pytest.mark.parametrize("name", list(CHECKS))
def test_skinny_gemm(verdicts: dict[str, str], name: str) -> None:
    assert verdicts[name] == "ok", verdicts[name]


if __name__ == "__main__":
    sys.path.insert(0, ".")
    child_main(CHECKS)
