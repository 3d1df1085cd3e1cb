"""The drop-in weight paths on two GPUs (skipped otherwise): the server (GPU 1) receives pushes in the
protocols of other stacks from a trainer in this process (GPU 0), then serves exactly what a fresh engine
with the pushed weights generates.

- vLLM / TRL 1.16: the trainer side of vLLM's ``trainer_init`` (a TCPStore holding the pickled NCCL id under
  ``broadcast_from/0/0``, ``ncclCommInitRank`` rank 0, a one-element all-reduce) and of
  ``packed_nccl_broadcast_producer`` (tensors' bytes concatenated, a chunk closing past the buffer size),
  written out here with ctypes NCCL; with vLLM and TRL installed, TRL's own ``VLLMClient`` does it too.
- slime / SGLang: ``init_weights_update_group`` + ``update_weights_from_distributed``, the trainer's group
  made by SGLang's ``init_custom_process_group`` convention, one NCCL broadcast per tensor.
"""

from __future__ import annotations

import ctypes
import datetime
import json
import socket
import threading
import urllib.request

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                reason="needs two GPUs (NCCL between the trainer and the server)")

from rollout import Engine, SamplingParams  # noqa: E402
from tests.gpu.test_serve_gpu import PROMPT, _Server, hf_model  # noqa: E402
from tests.serve_helpers import vllm_unique_id_pickle  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def _post(url: str, body: dict, timeout: float = 300) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def _in_thread(fn, *args) -> tuple[threading.Thread, dict]:
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault("r", fn(*args)))
    t.start()
    return t, out


def _served(url: str) -> list[int]:
    code, body = _post(url + "/generate", {"input_ids": PROMPT, "sampling_params": {
        "max_new_tokens": 16, "temperature": 0, "ignore_eos": True}})
    assert code == 200, body
    return body["output_ids"]


def _want(model) -> list[int]:
    engine = Engine.from_pretrained(model, dtype="bfloat16", device="cuda:0", max_model_len=1024, num_blocks=256,
                                    gpu_memory_utilization=0.3)
    return engine.generate([PROMPT], GREEDY)[0].outputs[0].token_ids


@pytest.fixture(scope="module")
def server():
    s = _Server(1)
    yield s
    s.stop()


def test_vllm_handshake_and_packed_push(server):
    from rollout.weights.layout import specs_of
    from rollout.weights.vllm_nccl import NcclUniqueId, _Nccl, packed_chunks

    torch.cuda.set_device(0)
    model = hf_model(1, "cuda:0")
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    nccl = _Nccl()
    uid = NcclUniqueId()
    nccl.check(nccl.lib.ncclGetUniqueId(ctypes.byref(uid)))
    store = torch.distributed.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False,
                                       timeout=datetime.timedelta(seconds=120))
    store.set("broadcast_from/0/0", vllm_unique_id_pickle(bytes(uid.internal)))
    init, got = _in_thread(_post, server.url + "/init_weight_transfer_engine", {"init_info": {
        "master_address": "127.0.0.1", "master_port": store.port, "rank_offset": 1, "world_size": 2,
        "packed": True, "packed_buffer_size_bytes": 1 << 20}})
    comm = ctypes.c_void_p()
    nccl.check(nccl.lib.ncclCommInitRank(ctypes.byref(comm), 2, uid, 0))
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    warm = torch.zeros(1, device="cuda:0")
    nccl.check(nccl.lib.ncclAllReduce(warm.data_ptr(), warm.data_ptr(), 1, 7, 0, comm, stream))
    torch.cuda.synchronize()
    init.join(120)
    assert got["r"][0] == 200, got
    specs = specs_of(named)
    push, got = _in_thread(_post, server.url + "/update_weights", {"update_info": {
        "names": [s.name for s in specs], "dtype_names": [s.dtype for s in specs],
        "shapes": [list(s.shape) for s in specs], "version": 5}})
    tensors = dict(named)
    for chunk in packed_chunks(specs, 1 << 20):  # vLLM's producer: one uint8 broadcast per chunk
        buf = torch.cat([tensors[s.name].contiguous().view(torch.uint8).view(-1) for s in chunk])
        nccl.check(nccl.lib.ncclBroadcast(buf.data_ptr(), buf.data_ptr(), buf.numel(), 1, 0, comm, stream))
    torch.cuda.synchronize()
    push.join(300)
    assert got["r"][0] == 200 and got["r"][1]["policy_version"] == 5, got
    assert _served(server.url) == _want(model)
    nccl.lib.ncclCommAbort(comm)


def test_trls_own_vllm_client(server, monkeypatch):
    pytest.importorskip("vllm")
    vc = pytest.importorskip("trl.generation.vllm_client")
    monkeypatch.setattr(vc, "get_ip", lambda: "127.0.0.1")  # the server allows loopback and the caller's own address
    torch.cuda.set_device(0)
    model = hf_model(2, "cuda:0")
    client = vc.VLLMClient(base_url=server.url, connection_timeout=30)
    client.init_communicator(device="cuda:0")
    client.update_model_params(model)
    assert _served(server.url) == _want(model)
    client.close_communicator()


def test_slime_nccl_push(server):
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import PrefixStore, rendezvous

    from rollout.weights.torch_group import _new_group

    torch.cuda.set_device(0)
    model = hf_model(3, "cuda:0")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    name = "slime-pp_0"
    init, got = _in_thread(_post, server.url + "/init_weights_update_group", {
        "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2, "group_name": name,
        "backend": "nccl"})
    t = datetime.timedelta(seconds=120)
    store, _, _ = next(rendezvous(f"tcp://127.0.0.1:{port}", 0, 2, timeout=t))
    group = _new_group(2, 0, "nccl", PrefixStore(name, store), name, t)
    init.join(120)
    assert got["r"][0] == 200, got
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    push, got = _in_thread(_post, server.url + "/update_weights_from_distributed", {
        "names": [n for n, _ in named], "dtypes": [str(p.dtype).replace("torch.", "") for _, p in named],
        "shapes": [list(p.shape) for _, p in named], "group_name": name, "flush_cache": False,
        "weight_version": "9"})
    for _, p in named:
        dist.broadcast(p, 0, group=group)
    push.join(300)
    assert got["r"][0] == 200 and got["r"][1]["policy_version"] == 9, got
    assert _served(server.url) == _want(model)
    dist.destroy_process_group(group)
