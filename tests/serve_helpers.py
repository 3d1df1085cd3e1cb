"""Shared by the server tests: rollout-serve in a subprocess on a free loopback port, and the same engine
in-process (built by the same code from the same config) for parity checks."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request

from rollout.cli import serve
from tests.script_helpers import ROOT, compose


def in_process_engine(*overrides: str):
    """(engine, checkpoint dir) exactly as the server builds them for the same overrides."""
    return serve.build_engine(serve.load_config(compose("serve", *overrides)))


class Server:
    """``python -m rollout.cli.serve server.port=0 ...`` (``rollout-serve``); ``url`` once it printed its address."""

    def __init__(self, *overrides: str) -> None:
        """Starts the process; ``wait_ready`` blocks until it serves (build other things meanwhile)."""
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)  # carried wheels too
        env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rollout.cli.serve", "server.port=0", *overrides], cwd=ROOT, env=env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        self.lines: list[str] = []
        self.url: str | None = None

    def wait_ready(self, timeout_s: float = 240.0) -> Server:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            self.lines.append(line)
            if "rollout server: serving" in line:
                self.url = line.split(" on ")[1].split()[0]
                break
        if self.url is None:
            self.stop()
            raise RuntimeError("the server did not start:\n" + "".join(self.lines))
        self._drain()
        return self

    def _drain(self) -> None:
        import threading

        def read() -> None:
            for line in self.proc.stdout:
                self.lines.append(line)

        threading.Thread(target=read, daemon=True).start()

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=30) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def post(self, path: str, data: bytes | str, content_type: str = "application/json") -> tuple[int, str]:
        body = data.encode() if isinstance(data, str) else data
        req = urllib.request.Request(self.url + path, data=body, headers={"Content-Type": content_type})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def vllm_unique_id_pickle(raw: bytes) -> bytes:
    """What vLLM's StatelessProcessGroup.broadcast_obj stores for rank 0's NCCL id: a pickled pynccl
    ``ncclUniqueId`` (its module faked here: vLLM is not installed), holding ``raw`` (128 bytes)."""
    import ctypes
    import pickle
    import types

    name = "vllm.distributed.device_communicators.pynccl_wrapper"

    class ncclUniqueId(ctypes.Structure):  # noqa: N801 - vLLM's name, as the pickle names it
        _fields_ = [("internal", ctypes.c_byte * 128)]

    ncclUniqueId.__module__, ncclUniqueId.__qualname__ = name, "ncclUniqueId"
    parts = name.split(".")
    names = [".".join(parts[: i + 1]) for i in range(len(parts))]
    for n in names:
        sys.modules[n] = types.ModuleType(n)
    sys.modules[name].ncclUniqueId = ncclUniqueId  # type: ignore[attr-defined]
    try:
        uid = ncclUniqueId()
        ctypes.memmove(ctypes.addressof(uid), raw, 128)
        return pickle.dumps(uid)
    finally:
        for n in names:
            del sys.modules[n]
