"""The server on the GPU (skipped without CUDA / fastapi): pushes into a CUDA engine over gloo (one GPU) and
over NCCL between two GPUs, including a trainer killed mid-push (the server's receive times out, aborts the
NCCL group and keeps serving the old weights). The server is ``rollout.serve.app.serve`` in a subprocess
(no Hydra needed: the GPU machine carries only the serve wheels)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("fastapi")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from rollout import Engine, SamplingParams  # noqa: E402
from trainer_hooks.client import RolloutClient  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PROMPT = [5, 17, 300, 42, 9, 77, 1000, 3]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
SERVER = """
import sys, torch
sys.path.insert(0, {root!r})
torch.cuda.set_device({device})
from tests.gpu.test_serve_gpu import hf_model
from rollout import Engine
from rollout.serve.app import serve
from rollout.serve.config import ServeConfig, ServerConfig
engine = Engine.from_pretrained(hf_model(0), dtype="bfloat16", max_model_len=1024, num_blocks=1024,
                                gpu_memory_utilization=0.5)
serve(engine, ServeConfig(server=ServerConfig(port=0, torch_threads=None)), "tiny")
"""


def hf_model(seed: int, device: str = "cuda"):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                      num_key_value_heads=2, vocab_size=4096, max_position_embeddings=4096, initializer_range=0.05)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()


class _Server:
    def __init__(self, device: int) -> None:
        env = dict(os.environ, PYTHONPATH=f"{ROOT}:{os.environ.get('PYTHONPATH', '')}", NCCL_NVLS_ENABLE="0")
        self.proc = subprocess.Popen([sys.executable, "-c", SERVER.format(root=str(ROOT), device=device)], env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        for line in self.proc.stdout:
            self.lines.append(line)
            if "rollout server: serving" in line:
                self.url = line.split(" on ")[1].split()[0]
                break
        else:
            raise RuntimeError("server did not start:\n" + "".join(self.lines))
        threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True).start()

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def _reference(model, device: str) -> tuple[list[int], list[float]]:
    engine = Engine.from_pretrained(model, dtype="bfloat16", device=device, max_model_len=1024, num_blocks=256,
                                    gpu_memory_utilization=0.5)
    c = engine.generate([PROMPT], GREEDY)[0].outputs[0]
    return c.token_ids, c.logprobs


def _served(client) -> tuple[list[int], list[float]]:
    c = client.generate([PROMPT], GREEDY)[0].outputs[0]
    return c.token_ids, c.logprobs


def _same(a, b) -> None:
    assert a[0] == b[0] and torch.allclose(torch.tensor(a[1]), torch.tensor(b[1]), atol=2e-2)


def test_gloo_push_from_cpu_tensors_into_a_cuda_server():
    server = _Server(0)
    try:
        client = RolloutClient(server.url)
        new = hf_model(1, device="cpu")
        assert client.push_weights(new, version=3) == 3  # CPU tensors -> gloo -> CPU staging -> GPU copy
        _same(_served(client), _reference(new.to("cuda"), "cuda"))
        client.close()
    finally:
        server.stop()


KILLER = """
import os, sys, torch
sys.path.insert(0, {root!r})
torch.cuda.set_device(0)
import rollout.weights.sender as sender
import trainer_hooks.client as c
from tests.gpu.test_serve_gpu import hf_model
real = sender.send_weights
sender.send_weights = lambda g, s, t, b, on_chunk=None: real(g, s, t, b, on_chunk=lambda k: k == 2 and os._exit(3))
client = c.RolloutClient({url!r})
client.init_weight_transfer("cuda:0", timeout_s=20)
client.update_weights(list(hf_model(9).named_parameters()), bucket_bytes=1 << 20)
"""


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (NCCL between processes)")
def test_nccl_push_between_two_gpus_and_a_trainer_killed_mid_push():
    server = _Server(1)
    try:
        client = RolloutClient(server.url)
        client.init_weight_transfer("cuda:0", timeout_s=20)
        assert client.group.backend == "nccl"
        new = hf_model(2)
        t0 = time.perf_counter()
        assert client.push_weights(new, version=5) == 5
        print(f"\nNCCL push of {sum(p.numel() for p in new.parameters()) * 2 / 2**20:.0f} MiB: "
              f"{time.perf_counter() - t0:.3f}s")
        served = _served(client)
        _same(served, _reference(new, "cuda:0"))
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)  # keep carried wheels
        env = dict(os.environ, PYTHONPATH=path, NCCL_NVLS_ENABLE="0")
        child = subprocess.run([sys.executable, "-c", KILLER.format(root=str(ROOT), url=server.url)], env=env,
                               capture_output=True, text=True, timeout=300)
        assert child.returncode == 3, child.stderr[-3000:]
        deadline = time.monotonic() + 90  # the server's receive times out (20 s) and aborts the group
        while "weight push failed" not in "".join(server.lines) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert "weight push failed" in "".join(server.lines), "".join(server.lines)[-3000:]
        assert _served(client) == served and client.policy_version == 5
        newer = hf_model(3)
        assert client.push_weights(newer, version=6) == 6  # a new group, and the server takes it
        _same(_served(client), _reference(newer, "cuda:0"))
        client.close()
    finally:
        server.stop()
