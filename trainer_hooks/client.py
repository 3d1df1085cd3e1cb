"""The trainer's side of a rollout server (``scripts/serve.py``): generate, push weights, pause; no vLLM needed.

    client = RolloutClient("http://127.0.0.1:8000")
    outs = client.generate(prompts, SamplingParams(n=8, max_tokens=256))  # list[RequestOutput], as Engine.generate
    client.push_weights(model)   # normalised names, then a bucketed broadcast (the group is made on first use)
    client.pause("keep"); client.push_weights(model); client.resume()

``RolloutClient`` is a ``rollout.RolloutBackend`` (``generate``, ``update_weights``, ``policy_version``,
``limits``, ``sleep``...), so ``TRLRollout(client)`` and ``push_weights(client, model)`` take it as they take an
``Engine``; and a ``rollout.RequestBackend`` (``submit``: one request, answered on its own), so the environment
loop runs multi-turn conversations over it (``rollout.envs.remote_turns``). HTTP is the standard library's (one
keep-alive connection per thread). Weights travel over a ``TransferGroup`` the client hosts as rank 0: NCCL when the
tensors are on CUDA, gloo otherwise.
"""

from __future__ import annotations

import atexit
import dataclasses
import http.client
import json
import os
import socket
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any
from urllib.parse import urlparse

import torch

from rollout.api import BackendLimits
from rollout.engine.stats import EngineStats
from rollout.engine.validation import normalize_params, normalize_prompts
from rollout.outputs import CompletionOutput, RequestOutput
from rollout.sampling_params import SamplingParams
from rollout.weights.group import TransferGroup
from rollout.weights.layout import BUCKET_BYTES, TensorSpec, specs_of
from rollout.weights.names import HFWeights, named_weights
from rollout.weights.sender import WeightSender


class ServerError(RuntimeError):
    """The server answered with an error (``status``, OpenAI-shaped ``message``)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status, self.message = status, message


class RequestRejected(ServerError, ValueError):
    """A 4xx for a bad value (400/404/413/422): the request's fault, like the engine's ValueError."""


class RolloutClient:
    def __init__(self, base_url: str = "http://127.0.0.1:8000", timeout_s: float = 600.0,
                 max_concurrency: int = 64, api_key: str | None = None) -> None:
        """``api_key``: the server's ``server.api_key``, sent as a Bearer token (default ``$ROLLOUT_API_KEY``)."""
        url = urlparse(base_url if "://" in base_url else f"http://{base_url}")
        if url.scheme != "http" or not url.hostname:
            raise ValueError(f"base_url must look like http://host:port, got {base_url!r}")
        self.base_url = f"http://{url.hostname}:{url.port or 80}"
        self.host, self.port, self.timeout_s = url.hostname, url.port or 80, timeout_s
        self.max_concurrency = max_concurrency
        key = api_key or os.environ.get("ROLLOUT_API_KEY")
        self._auth = {"Authorization": f"Bearer {key}"} if key else {}
        self._local = threading.local()
        self._pool = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="rollout-client")
        self.sender = WeightSender(_Server(self), timeout_s)
        self._model_card: dict[str, Any] | None = None
        atexit.register(self.close)

    # ---- HTTP ------------------------------------------------------------------------------------------
    def _conn(self) -> http.client.HTTPConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
        return conn

    def request(self, method: str, path: str, body: Any = None) -> Any:
        """One call; the parsed JSON answer, or ServerError / RequestRejected with the server's message."""
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json", **self._auth} if data is not None else dict(self._auth)
        for attempt in (0, 1):
            conn = self._conn()
            try:
                conn.request(method, path, body=data, headers=headers)
                resp = conn.getresponse()
                raw = resp.read()
                break
            except (ConnectionError, http.client.RemoteDisconnected, http.client.CannotSendRequest):
                conn.close()
                self._local.conn = None
                if attempt:
                    raise
        text = raw.decode(errors="replace")
        try:
            payload = json.loads(text) if text else {}
        except ValueError:
            payload = text
        if resp.status >= 400:
            message = payload.get("error", {}).get("message", text) if isinstance(payload, dict) else text
            cls = RequestRejected if resp.status in (400, 404, 413, 422) else ServerError
            raise cls(resp.status, message)
        return payload

    def health(self) -> bool:
        try:
            self.request("GET", "/health")
            return True
        except (OSError, ServerError):
            return False

    @property
    def model(self) -> str:
        return self._card()["id"]

    @property
    def limits(self) -> BackendLimits:
        """The server engine's limits (asked once: they are fixed for a server's lifetime)."""
        return BackendLimits(**self._card()["limits"])

    def describe(self) -> dict[str, Any]:
        return {"base_url": self.base_url, "model": self.model, **dataclasses.asdict(self.limits)}

    def _card(self) -> dict[str, Any]:
        if self._model_card is None:
            self._model_card = self.request("GET", "/v1/models")["data"][0]
        return self._model_card

    @property
    def policy_version(self) -> int:
        return int(self.request("GET", "/policy_version")["policy_version"])

    def get_stats(self) -> EngineStats:
        """The server engine's counters (from ``GET /metrics``) in ``Engine.get_stats``'s shape, so the trainer's
        ``rollout/*`` metrics work the same against a server."""
        text = self.request("GET", "/metrics")
        values: dict[str, float] = {}
        for line in str(text).splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                try:
                    values[name.strip()] = float(value)
                except ValueError:
                    continue
        get = lambda name: values.get(f"rollout_{name}", 0.0)  # noqa: E731
        return EngineStats(
            num_running_seqs=int(get("running_seqs")), num_waiting_seqs=int(get("waiting_seqs")),
            kv_cache_usage=get("kv_cache_usage_ratio"), num_steps=int(get("engine_steps_total")),
            num_preemptions=int(get("preemptions_total")), num_generated_tokens=int(get("generation_tokens_total")),
            num_prompt_tokens=int(get("prompt_tokens_total")), num_scheduled_seqs=0,
            gpu_busy_frac=values.get("rollout_gpu_busy_ratio"), policy_version=int(get("policy_version")),
        )

    # ---- generation --------------------------------------------------------------------------------------
    def generate(self, prompts: Any, sampling_params: Any = None, use_tqdm: bool = False) -> list[RequestOutput]:
        """``Engine.generate`` over HTTP: one completions request per prompt, sent concurrently."""
        prompts = normalize_prompts(prompts)
        if not prompts:
            return []
        params = normalize_params(sampling_params, len(prompts))
        return list(self._pool.map(lambda pp: self._complete(*pp), zip(prompts, params)))

    def submit(self, prompt: Any, sampling_params: Any = None, routing_key: str | None = None
               ) -> Future[RequestOutput]:
        """One prompt's completions request, sent from the client's pool without waiting (``rollout.RequestBackend``:
        the environment loop's turns over a server); the future holds its ``RequestOutput`` or the error.
        ``routing_key`` is ignored: one server holds every conversation's prefix."""
        prompt, = normalize_prompts([prompt])
        params, = normalize_params(sampling_params, 1)
        return self._pool.submit(self._complete, prompt, params)

    def _complete(self, prompt: Any, p: SamplingParams) -> RequestOutput:
        body = {"model": self.model, "prompt": prompt if isinstance(prompt, str) else list(prompt), "n": p.n,
                "max_tokens": p.max_tokens, "min_tokens": p.min_tokens, "temperature": p.temperature,
                "top_p": p.top_p, "top_k": p.top_k, "min_p": p.min_p, "seed": p.seed, "stop": p.stop,
                "stop_token_ids": p.stop_token_ids, "ignore_eos": p.ignore_eos, "logprobs": 0,
                "logprobs_mode": p.logprobs_mode, "return_token_ids": True}
        resp = self.request("POST", "/v1/completions", body)
        outs = [CompletionOutput(c["index"] % p.n, c["token_ids"], c["logprobs"]["token_logprobs"],
                                 c["finish_reason"], c["text"], c["policy_versions"], c.get("stop_reason"))
                for c in resp["choices"]]
        details = (resp.get("usage") or {}).get("prompt_tokens_details") or {}
        return RequestOutput(resp["id"], resp["choices"][0]["prompt_token_ids"], outs,
                             prompt if isinstance(prompt, str) else None, True,
                             num_cached_tokens=int(details.get("cached_tokens", 0)))

    # ---- weights ---------------------------------------------------------------------------------------
    def init_weight_transfer(self, device: torch.device | str = "cpu", master_address: str | None = None,
                             master_port: int = 0, timeout_s: float | None = None) -> TransferGroup:
        """Host a 2-rank group (trainer = rank 0) and have the server join it: NCCL on CUDA, gloo on CPU."""
        self.sender.timeout_s = timeout_s or self.timeout_s
        return self.sender.open(device, 2, master_address or self._local_address(), master_port)

    @property
    def group(self) -> TransferGroup | None:
        return self.sender.group

    def _local_address(self) -> str:
        """The address the server can reach us at: loopback for a local server, else our outgoing interface."""
        if self.host in ("127.0.0.1", "localhost", "::1"):
            return "127.0.0.1"
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((self.host, self.port))
            return s.getsockname()[0]

    def push_weights(self, weights: Any, version: int | None = None, recompute_running: bool = True) -> int:
        """A trainer model (or ``(name, tensor)`` pairs / a mapping) into the server; returns its new version."""
        return self.update_weights(weights, version=version, recompute_running=recompute_running)

    def update_weights(self, named_tensors: Any, version: int | None = None, recompute_running: bool = True,
                       bucket_bytes: int = BUCKET_BYTES, dtype: torch.dtype | None = None) -> int:
        """``Engine.update_weights`` across processes: announce, wait for the verdict, broadcast, await the swap.

        Names are normalised as for an in-process engine (DDP, torch.compile, FSDP, PEFT). A refused push
        raises RequestRejected (ValueError) and changes nothing; a failure while sending closes the group
        (the server keeps its old weights) and the next push makes a new one.
        """
        weights = named_weights(named_tensors)
        specs = specs_of(weights, dtype)
        for attempt in (0, 1):
            if self.sender.group is None:
                self.init_weight_transfer(_device_of(weights))
            try:
                answer = self.sender.send(specs, weights, version, recompute_running, bucket_bytes)
                return int(answer.result()["policy_version"])
            except ServerError as e:
                if e.status != 409 or attempt:
                    raise
                self.close_weight_transfer()  # the server lost our group (another trainer, a failure): anew
        raise AssertionError("unreachable")

    def update_weights_from_disk(self, path: str, version: int | None = None, recompute_running: bool = True) -> int:
        body = {"path": str(path), "version": version, "recompute_running": recompute_running}
        return int(self.request("POST", "/update_weights_from_disk", body)["policy_version"])

    # ---- control ---------------------------------------------------------------------------------------
    def pause(self, mode: str = "keep") -> dict[str, Any]:
        return self.request("POST", f"/pause?mode={mode}")

    def resume(self) -> dict[str, Any]:
        return self.request("POST", "/resume")

    def sleep(self, level: int = 1) -> int:
        """``Engine.sleep`` on the server; the bytes it released."""
        return int(self.request("POST", f"/sleep?level={level}")["released_bytes"])

    def wake_up(self) -> None:
        self.request("POST", "/wake_up")

    @property
    def is_sleeping(self) -> bool:
        return bool(self.request("GET", "/is_sleeping")["is_sleeping"])

    def reset_prefix_cache(self) -> dict[str, Any]:
        return self.request("POST", "/reset_prefix_cache")

    def close_weight_transfer(self) -> None:
        self.sender.close()

    def close(self) -> None:
        self.close_weight_transfer()
        self._pool.shutdown(wait=False)


class _Server:
    """The sender's ``Receivers``: one server, reached over HTTP."""

    def __init__(self, client: RolloutClient) -> None:
        self.client = client

    def join(self, address: str, port: int, world_size: int, backend: str, timeout_s: float) -> Any:
        info = {"master_address": address, "master_port": port, "world_size": world_size, "rank_offset": 1,
                "backend": backend, "timeout_s": timeout_s}
        joined = self.client._pool.submit(self.client.request, "POST", "/init_weight_transfer", info)
        return lambda wait: joined.result() if wait or joined.done() else None

    def announce(self, specs: list[TensorSpec], push_id: int, bucket_bytes: int, version: int | None,
                 recompute_running: bool) -> Future:
        body = {"names": [s.name for s in specs], "dtype_names": [s.dtype for s in specs],
                "shapes": [list(s.shape) for s in specs], "packed": True, "bucket_bytes": bucket_bytes,
                "push_id": push_id, "version": version, "recompute_running": recompute_running}
        return self.client._pool.submit(self.client.request, "POST", "/update_weights", body)

    def alive(self, answer: Future) -> bool:
        return not answer.done()

    def refused(self, answer: Future) -> None:
        answer.result()  # the server's answer: 400 with the reason, or why no verdict came

    def broken(self, answer: Future) -> None:
        pass  # the server's receive fails fast on the closed connection; our own error says why


def _device_of(weights: Any) -> torch.device:
    """Where the trainer's tensors live: CUDA tensors go over NCCL, anything else over gloo."""
    items = weights.parameters() if isinstance(weights, HFWeights) else weights
    first = next((item[1] for item in items if isinstance(item, tuple) and len(item) == 2), None)
    return first.device if isinstance(first, torch.Tensor) and first.device.type == "cuda" else torch.device("cpu")
