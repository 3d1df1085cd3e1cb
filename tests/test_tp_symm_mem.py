"""tp_all_reduce="symm_mem" on the CPU: the option is validated (and refused before any worker starts where it
cannot run), the buffer is sized for the largest decode all-reduce, the symmetric-or-NCCL decision, and that
TPGroup dispatches to the chosen path with "nccl" calling exactly what it did before. The CUDA kernel itself is
tests/gpu/test_tp_symm_mem_gpu.py's to check; here a stand-in op plays two ranks holding the same tensor."""

from __future__ import annotations

import pytest
import torch

import rollout.distributed.group as group_mod
from rollout import Engine
from rollout.config import EngineConfig
from rollout.distributed import TPGroup
from rollout.distributed import symm_mem as sm
from rollout.distributed.symm_mem import SymmMemAllReduce, SymmMemSpec, fits_symm_mem, symm_mem_spec
from rollout.engine.tp import runner as tp_runner
from tests.tiny_models import make_tiny_hf_model

BF16, F32, F16 = torch.bfloat16, torch.float32, torch.float16


def test_config_validates_tp_all_reduce():
    assert EngineConfig().tp_all_reduce == "nccl"
    assert EngineConfig(tensor_parallel_size=2, tp_all_reduce="symm_mem").tp_all_reduce == "symm_mem"
    with pytest.raises(ValueError, match=r"tp_all_reduce must be one of \('nccl', 'symm_mem'\), got 'gloo'"):
        EngineConfig(tensor_parallel_size=2, tp_all_reduce="gloo")
    with pytest.raises(ValueError, match=r"tp_all_reduce='symm_mem' needs tensor_parallel_size > 1"):
        EngineConfig(tp_all_reduce="symm_mem")


class _Stop(Exception):
    pass


class _NoWorkers:
    """Stands in for TPWorkers: records the spec and stops the start there."""

    specs: list = []

    def __init__(self, spec) -> None:
        _NoWorkers.specs.append(spec)
        raise _Stop("stop before spawning")


def test_symm_mem_is_refused_before_any_worker_starts(monkeypatch):
    monkeypatch.setattr(tp_runner, "TPWorkers", _NoWorkers)
    _NoWorkers.specs = []
    hf = make_tiny_hf_model("llama")
    with pytest.raises(ValueError, match=r"tp_all_reduce='symm_mem' needs CUDA devices, got device 'cpu'"):
        Engine.from_pretrained(hf, dtype="float32", device="cpu", tensor_parallel_size=2, tp_all_reduce="symm_mem")
    cuda = EngineConfig(tensor_parallel_size=2, tp_all_reduce="symm_mem")
    monkeypatch.setattr(torch, "__version__", "2.10.1+cu128")
    with pytest.raises(ValueError, match=r"needs torch >= 2.11, found 2.10.1\+cu128"):
        sm.check_symm_mem_start(cuda, torch.device("cuda", 0))
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    sm.check_symm_mem_start(cuda, torch.device("cuda", 0))  # a fresh process on CUDA: accepted
    monkeypatch.setattr(sm, "_rendezvoused_in_process", ["rollout_tp_symm_mem_x"])
    with pytest.raises(RuntimeError, match="already started a symmetric-memory group .* fresh process"):
        sm.check_symm_mem_start(cuda, torch.device("cuda", 0))
    assert _NoWorkers.specs == []
    # "nccl" (the default) hands the workers no symmetric buffer: they build the group exactly as before
    with pytest.raises(_Stop):
        tp_runner.start_tensor_parallel(hf, "float32", torch.device("cpu"), EngineConfig(tensor_parallel_size=2))
    assert _NoWorkers.specs[0].symm_mem is None


def test_buffer_holds_the_largest_decode_all_reduce():
    nccl = EngineConfig(tensor_parallel_size=2)
    assert symm_mem_spec(nccl, 4096, BF16) is None
    c = EngineConfig(tensor_parallel_size=2, tp_all_reduce="symm_mem", max_graph_batch_size=256, max_num_seqs=32)
    assert symm_mem_spec(c, 4096, BF16) == SymmMemSpec(32 * 4096, BF16)
    c = EngineConfig(tensor_parallel_size=2, tp_all_reduce="symm_mem", max_graph_batch_size=64, max_num_seqs=256)
    assert symm_mem_spec(c, 8192, F32) == SymmMemSpec(64 * 8192, F32)
    with pytest.raises(ValueError, match=r"supports models in bfloat16, float32, got float16; use tp_all_reduce"):
        symm_mem_spec(c, 4096, F16)


@pytest.mark.parametrize("case, expected", [
    (dict(numel=32 * 4096), True),  # a decode step's all-reduce at the largest graph batch
    (dict(numel=1 * 4096), True),
    (dict(numel=2), True),  # 4 bytes: the kernel's smallest vector
    (dict(numel=32 * 4096 + 2), False),  # one element over the buffer: NCCL
    (dict(numel=512 * 4096), False),  # a prefill chunk
    (dict(numel=0), False),
    (dict(numel=3), False),  # 6 bytes: not 4-byte aligned
    (dict(dtype=F16), False),  # no one-shot kernel for float16
    (dict(dtype=F32), False),  # another dtype than the buffer's
    (dict(contiguous=False), False),
    (dict(byte_offset=8), False),  # a view whose start is not 16-byte aligned
    (dict(byte_offset=4096), True),
])
def test_symmetric_or_nccl_decision(case, expected):
    args = dict(numel=4096, dtype=BF16, contiguous=True, byte_offset=0, capacity=32 * 4096, buffer_dtype=BF16)
    assert fits_symm_mem(**{**args, **case}) is expected


class _FakeSymm:
    def __init__(self, fits: bool) -> None:
        self._fits, self.calls = fits, []

    def fits(self, x):
        return self._fits

    def all_reduce(self, x):
        self.calls.append(x)
        return x


@pytest.fixture
def nccl_calls(monkeypatch):
    calls = []
    monkeypatch.setattr(group_mod.dist, "all_reduce", lambda x, group=None: calls.append((x, group)))
    return calls


def test_tp_group_dispatches_to_the_chosen_path(nccl_calls):
    pg, x = object(), torch.ones(4, 8)
    plain = TPGroup(0, 2, pg)  # tp_all_reduce="nccl": the call it always made
    assert plain.symm is None
    assert plain.all_reduce(x) is x and nccl_calls == [(x, pg)]
    nccl_calls.clear()
    fits = TPGroup(1, 2, pg, symm=_FakeSymm(True))
    assert fits.all_reduce(x) is x
    assert fits.symm.calls == [x] and nccl_calls == []
    too_big = TPGroup(1, 2, pg, symm=_FakeSymm(False))
    assert too_big.all_reduce(x) is x
    assert too_big.symm.calls == [] and nccl_calls == [(x, pg)]
    nccl_calls.clear()
    with fits.local():  # the KV sizing's dummy steps: no collective at all
        fits.all_reduce(x)
    assert fits.symm.calls == [x] and nccl_calls == []


def test_all_reduce_copies_through_the_buffer_into_x(nccl_calls):
    """The op gets (this rank's buffer, cut to x's size; x flat; "sum"; the group's name; x flat as the output);
    the stand-in sums two ranks holding the same x."""
    seen = []

    def two_ranks(buf, local, op, name, out):
        seen.append((buf.data_ptr(), buf.numel(), local.data_ptr(), op, name, out.data_ptr()))
        buf.copy_(local)
        out.copy_(buf + buf)
        return out

    buffer = torch.zeros(4 * 16, dtype=BF16)
    symm = SymmMemAllReduce(buffer, "rollout_tp_symm_mem_test", two_ranks)
    tp = TPGroup(0, 2, object(), symm=symm)
    x = torch.arange(3 * 16, dtype=BF16).view(3, 16)
    assert tp.all_reduce(x) is x
    assert torch.equal(x, 2 * torch.arange(3 * 16, dtype=BF16).view(3, 16))
    assert seen == [(buffer.data_ptr(), 48, x.data_ptr(), "sum", "rollout_tp_symm_mem_test", x.data_ptr())]
    assert nccl_calls == []
    big = torch.ones(5, 16, dtype=BF16)  # more than the buffer holds: NCCL
    tp.all_reduce(big)
    assert len(seen) == 1 and nccl_calls == [(big, tp.group)]
    assert not symm.fits(torch.ones(2, 16, dtype=F32)) and not symm.fits(torch.ones(4, 16, dtype=BF16).t())
    assert not symm.fits(torch.ones(3, 16, dtype=BF16)[:, 1:15])  # not contiguous


def test_every_rank_agrees_on_the_group_name():
    store = torch.distributed.HashStore()
    name = sm._agree_on_name(store, 0)
    assert name.startswith("rollout_tp_symm_mem_") and sm._agree_on_name(store, 1) == name
    assert sm._agree_on_name(torch.distributed.HashStore(), 0) != name
