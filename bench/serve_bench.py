"""Issue 10's bars on the two-H200 machine, in one command: one JSON line per measurement.

    bash ../shared/device/wheels.sh serve        # here, once (fastapi, uvicorn, pydantic... into .whl/)
    # on nvidia-h200-x2 (carry .whl):
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
      && PYTHONPATH=$PWD:/tmp/site python3 bench/serve_bench.py --out $OUT/serve_h200x2.jsonl

1. ``inproc``: W1-short (llama3-8b shape, bf16, 32 x 128-token prompts, 1024 new tokens, greedy) through
   ``scripts/bench.py``'s ``run_ours`` on cuda:1: the in-process reference tok/s.
2. ``server``: the same engine (same options, same graph warm-up) on cuda:1 behind ``rollout.serve``;
   the driver (no GPU) sends the same 32 prompts as 32 concurrent HTTP requests. Bar: >= 0.9 of (1).
3. ``trainer``: llama3-8b (bf16, 16 GB) on cuda:0 pushes to that server over NCCL with ``RolloutClient``:
   one push while 32 requests run, paused in ``keep`` mode and resumed under the new version (their
   per-token versions are checked), then timed pause + push + resume cycles. Bar: <= 0.15 s end to end.

``--one-gpu`` (one H200): (1) and (2) on GPU 0 one after the other, plus (2) streamed (SSE, every token as
a delta), no trainer.

``--stream-cost --cpu-sim-ms 18`` (no GPU): the streaming cost on the CPU, each step padded by 18 ms of
GIL-free sleep. Its records add the server's own side per engine step: ``*_host_ms`` (the stepping thread's
wall and CPU outside the sleep, in ``step()``, between steps and in ``_dispatch``: wall minus CPU is time
spent waiting for the GIL or a core) and ``*_thread_cpu_ms`` (every server thread's CPU: MainThread is the
event loop). ``--server-cpus 0`` keeps the driver's 256 SSE reader threads off the server's core;
``SERVE_BENCH_PROFILE=prefix`` writes cProfiles of the event loop and the stream thread.

Processes use explicit device indices, not CUDA_VISIBLE_DEVICES, so NCCL sees both GPUs (P2P over NVLink).
NVLink multicast stays off (NCCL_NVLS_ENABLE=0 and friends are set for every child).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
WORKLOAD = "W1-short"


def _bench():
    """scripts/bench.py (presets, prompts, run_ours), loaded by path: scripts/ also holds rollout.py."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("rollout_bench", ROOT / "scripts" / "bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _workload(args: argparse.Namespace, b) -> dict:
    """W1-short, or (``--stream-cost``) 256 prompts of 128 tokens streaming ``--stream-tokens`` each (qwen2.5-1.5b)."""
    if args.stream_cost:
        return dict(preset="qwen2.5-1.5b", prompts=256, prompt_len=128, new=args.stream_tokens)
    return b.WORKLOADS[WORKLOAD]


def _engine_options(w: dict, max_num_seqs: int) -> dict:
    """What run_ours builds its engine with, so the server's engine is the same."""
    max_len = w["prompt_len"] + w["new"] + 16
    blocks = int(w["prompts"] * -(-(w["prompt_len"] + w["new"]) // 16) * 1.1) + 64
    return dict(dtype="bfloat16", max_model_len=max_len, num_blocks=blocks, max_num_seqs=max_num_seqs,
                async_mode=True)


def role_inproc(args: argparse.Namespace) -> None:
    import torch

    torch.cuda.set_device(args.device)
    b = _bench()
    w = b.WORKLOADS[WORKLOAD]
    hf = b.build_hf(w["preset"])
    ns = argparse.Namespace(max_num_seqs=args.max_num_seqs, sampling=None, kv_cache_dtype="auto", weight_push=False,
                            logprob_check=0, push_mid_run=False)
    rec = b.run_ours(WORKLOAD, w, hf, "async", b.copy_bandwidth_tbps(), ns)
    print("RESULT " + json.dumps({**rec, "role": "inproc"}), flush=True)


def _cpu_sim_engine(args: argparse.Namespace, w: dict):
    """The embedded model on the CPU, each step padded by ``--cpu-sim-ms`` of sleep (the GIL released, as
    while a CUDA step runs): what the server costs an engine that mostly waits on its device."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    import rollout.layers.attention as attention
    from rollout import Engine
    from rollout.assets import materialize_default_model

    attention.reference_attention = lambda q, *a, **k: q * 0  # the device's work is the sleep below

    torch_model = Qwen2ForCausalLM(Qwen2Config(vocab_size=786, hidden_size=64, intermediate_size=128,
                                               num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2))
    tokenizer = AutoTokenizer.from_pretrained(materialize_default_model())
    engine = Engine.from_pretrained(torch_model, dtype="float32", device="cpu", tokenizer=tokenizer,
                                    max_model_len=w["prompt_len"] + w["new"] + 16, max_num_seqs=w["prompts"])
    step, pad, host = engine.step, args.cpu_sim_ms / 1e3, _HostTime()

    def padded_step():
        host.enter()
        out = step()
        host.leave()
        time.sleep(pad)
        host.resume()
        return out

    engine.step = padded_step
    engine.bench_host = host
    return engine


class _HostTime:
    """The stepping thread's host time per step, outside the padded sleep (the GPU's share): wall and CPU
    inside ``step()`` and between steps (``_dispatch``, the loop), the part streaming can slow down.
    Wall minus CPU is time the thread was runnable but waited (the GIL, or the other cores)."""

    def __init__(self) -> None:
        self.steps = 0
        self.step_wall = self.step_cpu = self.between_wall = self.between_cpu = 0.0
        self.dispatch_wall = self.dispatch_cpu = 0.0
        self._mark: tuple[float, float] | None = None

    def _now(self) -> tuple[float, float]:
        return time.perf_counter(), time.thread_time()

    def enter(self) -> None:
        now = self._now()
        if self._mark is not None and now[0] - self._mark[0] < 1.0:  # idle gaps (no work) are not host time
            self.between_wall += now[0] - self._mark[0]
            self.between_cpu += now[1] - self._mark[1]
        self._mark = now

    def leave(self) -> None:
        now = self._now()
        self.step_wall += now[0] - self._mark[0]
        self.step_cpu += now[1] - self._mark[1]
        self.steps += 1

    def resume(self) -> None:
        self._mark = self._now()

    def timed(self, fn):
        """``fn`` (the loop's ``_dispatch``), its wall and CPU added to ``dispatch_*`` (part of ``between``)."""

        def run(*a, **k):
            t0, c0 = self._now()
            try:
                return fn(*a, **k)
            finally:
                t1, c1 = self._now()
                self.dispatch_wall += t1 - t0
                self.dispatch_cpu += c1 - c0

        return run

    def snapshot(self) -> dict:
        return dict(steps=self.steps, step_wall=self.step_wall, step_cpu=self.step_cpu,
                    between_wall=self.between_wall, between_cpu=self.between_cpu,
                    dispatch_wall=self.dispatch_wall, dispatch_cpu=self.dispatch_cpu)


def _profiled(run, prefix: str) -> None:
    """``SERVE_BENCH_PROFILE=prefix``: cProfile the event loop (``prefix``.loop) and the stream thread
    (``prefix``.streams), each dumped as the server shuts down: where the per-chunk time goes."""
    import cProfile

    from rollout.engine.async_engine import AsyncEngine

    deliver = AsyncEngine._deliver_streams

    def profiled_deliver(self) -> None:
        prof = cProfile.Profile()
        try:
            prof.runcall(deliver, self)
        finally:
            prof.dump_stats(prefix + ".streams")

    AsyncEngine._deliver_streams = profiled_deliver
    # uvicorn raises the SIGTERM again once shut down: exit through ``finally`` so the profile is written
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    prof = cProfile.Profile()
    try:
        prof.runcall(run)
    finally:
        prof.dump_stats(prefix + ".loop")


def _thread_cpu() -> dict[str, float]:
    """CPU seconds of every live thread of this process, by name (the asyncio loop runs in MainThread)."""
    out: dict[str, float] = {"process": time.process_time()}
    for t in threading.enumerate():
        try:
            out[t.name] = time.clock_gettime(time.pthread_getcpuclockid(t.ident))
        except (OSError, TypeError):
            pass
    return out


def _monitor(engine, path: str) -> None:
    """Write the server's per-thread CPU and host time to ``path`` every 0.1 s (the driver samples it)."""
    from rollout.engine.async_engine import AsyncEngine

    dispatch = AsyncEngine._dispatch
    AsyncEngine._dispatch = lambda self, outs: engine.bench_host.timed(dispatch)(self, outs)

    def run() -> None:
        while True:
            snap = {"threads": _thread_cpu(), "host": engine.bench_host.snapshot(), "t": time.perf_counter()}
            tmp = path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(snap, f)
            os.replace(tmp, path)
            time.sleep(0.1)

    threading.Thread(target=run, name="bench-monitor", daemon=True).start()


def role_server(args: argparse.Namespace) -> None:
    import torch

    from rollout import Engine, SamplingParams
    from rollout.serve.app import serve
    from rollout.serve.config import ServeConfig, ServerConfig
    from rollout.settings.schema import SamplingConfig

    if args.server_cpus:
        os.sched_setaffinity(0, _cpus(args.server_cpus))
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    server = dict(port=0, stream_interval_s=args.stream_interval) if args.stream_interval is not None else dict(port=0)
    if args.cpu_sim_ms is not None:
        w = _workload(args, _bench())
        config = ServeConfig(sampling=SamplingConfig(n=1, max_tokens=16), server=ServerConfig(**server))
        engine = _cpu_sim_engine(args, w)
        if os.environ.get("SERVE_BENCH_MONITOR"):
            _monitor(engine, os.environ["SERVE_BENCH_MONITOR"])
        if os.environ.get("SERVE_BENCH_PROFILE"):
            return _profiled(lambda: serve(engine, config, "sim"), os.environ["SERVE_BENCH_PROFILE"])
        return serve(engine, config, "sim")
    torch.cuda.set_device(args.device)
    b = _bench()
    w = _workload(args, b)
    hf = b.build_hf(w["preset"])
    engine = Engine.from_pretrained(hf, **_engine_options(w, args.max_num_seqs))
    del hf
    torch.cuda.empty_cache()
    warm = [[1] * 8] * min(w["prompts"], args.max_num_seqs)  # the same graph warm-up as run_ours
    engine.generate(warm, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    for size in sorted(engine.runner.graph_sizes, reverse=True):
        if size <= len(warm):
            engine.generate(warm[:size], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    config = ServeConfig(sampling=SamplingConfig(n=1, max_tokens=16), server=ServerConfig(**server, torch_threads=None))
    serve(engine, config, w["preset"])


def role_trainer(args: argparse.Namespace) -> None:
    import torch

    from rollout import SamplingParams
    from trainer_hooks.client import RolloutClient

    torch.cuda.set_device(args.device)
    b = _bench()
    w = b.WORKLOADS[WORKLOAD]
    model = b.build_hf(w["preset"])
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    client = RolloutClient(args.url)
    t0 = time.perf_counter()
    client.init_weight_transfer(f"cuda:{args.device}")
    init_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    client.push_weights(model)  # first push: allocates the server's staging buffer, warms NCCL
    first_s = time.perf_counter() - t0
    # A push while 32 requests run: paused in keep mode, resumed under the new version.
    prompts, _ = b.make_prompts(w, model.config.vocab_size)
    outs: list = []
    load = threading.Thread(target=lambda: outs.extend(client.generate(
        prompts, SamplingParams(temperature=0, max_tokens=256, ignore_eos=True))))
    load.start()
    time.sleep(1.0)
    t0 = time.perf_counter()
    client.pause("keep")
    version = client.push_weights(model)
    client.resume()
    under_load_s = time.perf_counter() - t0
    load.join()
    versions = [c.policy_versions for o in outs for c in o.outputs]
    resumed_ok = all(v[-1] == version and v == sorted(v) for v in versions) and any(v[0] < version for v in versions)
    cycles = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        client.pause("keep")
        client.push_weights(model)
        client.resume()
        cycles.append(time.perf_counter() - t0)
    server_s = _metric(client, "rollout_weight_update_last_seconds")
    rec = dict(workload="serve_weight_push", role="trainer", preset=w["preset"], bytes=nbytes,
               init_s=round(init_s, 4), first_push_s=round(first_s, 4), under_load_s=round(under_load_s, 4),
               resumed_under_new_version=resumed_ok,
               requests_during_push=len(versions), cycles_s=[round(c, 4) for c in cycles],
               best_s=round(min(cycles), 4), gbps=round(nbytes / min(cycles) / 1e9, 1),
               server_receive_apply_s=server_s, bar_s=0.15, meets_bar=min(cycles) <= 0.15,
               device=torch.cuda.get_device_name())
    print("RESULT " + json.dumps(rec), flush=True)
    client.close()


def _metric(client, name: str) -> float | None:
    import urllib.request

    with urllib.request.urlopen(client.base_url + "/metrics", timeout=30) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    return None


# ---- the driver ----------------------------------------------------------------------------------------------
def _child(role: str, device: int, *extra: str, args: argparse.Namespace | None = None) -> subprocess.Popen:
    env = dict(os.environ, **SAFE_ENV, PYTHONUNBUFFERED="1")
    if args is not None and args.stream_cost:
        extra = (*extra, "--stream-cost", "--stream-tokens", str(args.stream_tokens))
    if args is not None and args.cpu_sim_ms is not None:
        extra = (*extra, "--cpu-sim-ms", str(args.cpu_sim_ms))
        env["SERVE_BENCH_MONITOR"] = args.monitor_path
    if args is not None and args.server_cpus:
        extra = (*extra, "--server-cpus", args.server_cpus)
    for flag in ("stream_interval", "switch_interval"):
        if args is not None and getattr(args, flag) is not None:
            extra = (*extra, "--" + flag.replace("_", "-"), str(getattr(args, flag)))
    return subprocess.Popen([sys.executable, __file__, role, "--device", str(device), *extra], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _result(proc: subprocess.Popen, timeout: float) -> dict:
    out, _ = proc.communicate(timeout=timeout)
    for line in out.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"no result (exit {proc.returncode}):\n{out[-4000:]}")


def _start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    proc = _child("server", args.engine_gpu, "--max-num-seqs", str(args.max_num_seqs), args=args)
    deadline = time.monotonic() + 400
    for line in proc.stdout:  # type: ignore[union-attr]
        print("  server: " + line.rstrip(), flush=True)
        if "rollout server: serving" in line:
            url = line.split(" on ")[1].split()[0]
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()  # type: ignore[union-attr]
            return proc, url
        if time.monotonic() > deadline:
            break
    proc.kill()
    raise RuntimeError("the server did not start")


def _stream_all(url: str, model: str, prompts: list, p) -> int:
    """Every prompt as one streamed completion (SSE), all at once; the token-id deltas received."""
    import http.client
    from concurrent.futures import ThreadPoolExecutor
    from urllib.parse import urlparse

    u = urlparse(url)

    def one(prompt) -> int:
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
        body = {"model": model, "prompt": list(prompt), "max_tokens": p.max_tokens, "temperature": p.temperature,
                "ignore_eos": True, "stream": True, "return_token_ids": True, "seed": p.seed}
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp, got = conn.getresponse(), 0
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                got += sum(len(c.get("token_ids") or []) for c in chunk.get("choices", []))
        conn.close()
        return got

    with ThreadPoolExecutor(len(prompts)) as pool:
        return sum(pool.map(one, prompts))


def _stop(server: subprocess.Popen, records: list[dict], out: str | None) -> None:
    """Stop the server child, then append the records to ``out``."""
    server.terminate()
    try:
        server.wait(30)
    except subprocess.TimeoutExpired:
        server.kill()
    if out:
        with open(out, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)


def _cpus(spec: str) -> set[int]:
    """``--server-cpus``: "0" or "0,2" or "0-3"."""
    out: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def _read_monitor(args: argparse.Namespace) -> dict | None:
    """The CPU sim server's last per-thread CPU / host time snapshot (None off the CPU sim)."""
    if args.cpu_sim_ms is None:
        return None
    time.sleep(0.25)  # a snapshot taken after the run's last step
    with open(args.monitor_path) as f:
        return json.load(f)


def _server_side(a: dict | None, b: dict | None) -> dict:
    """Per engine step between two monitor snapshots: the stepping thread's host time outside the padded sleep
    (wall and CPU, in ``step()`` and between steps) and every server thread's CPU, in ms."""
    if a is None or b is None:
        return {}
    steps = max(b["host"]["steps"] - a["host"]["steps"], 1)
    per = {k: round((b["host"][k] - a["host"][k]) / steps * 1e3, 3) for k in a["host"] if k != "steps"}
    per["host_wall"] = round(per["step_wall"] + per["between_wall"], 3)
    per["host_cpu"] = round(per["step_cpu"] + per["between_cpu"], 3)
    cpu = {name: round((b["threads"][name] - a["threads"].get(name, 0.0)) / steps * 1e3, 3)
           for name in b["threads"]}
    return {"host_ms": per, "thread_cpu_ms": {k: v for k, v in cpu.items() if v >= 0.01}}


def _steps(url: str) -> tuple[float, float | None]:
    """The server's engine steps and GPU compute seconds so far (None on the CPU) from ``/metrics``."""
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        values = dict(line.split()[:2] for line in r.read().decode().splitlines()
                      if line.startswith(("rollout_engine_steps_total ", "rollout_gpu_compute_seconds_total ")))
    if "rollout_engine_steps_total" not in values:
        raise RuntimeError("no rollout_engine_steps_total in /metrics")
    gpu = values.get("rollout_gpu_compute_seconds_total")
    return float(values["rollout_engine_steps_total"]), None if gpu is None else float(gpu)


def stream_cost(args: argparse.Namespace) -> None:
    """What streaming costs the engine: the same 256 sequences plain and streamed (SSE deltas), wall per engine
    step in each (sampled as RL does: temperature 1, seeded). Bar: streamed < 1.02x plain. On a GPU also each
    run's busy fraction (GPU compute / wall, from ``/metrics``): ``stream_cost_bound`` = 1 / the streamed run's
    busy - 1 bounds the cost from that run alone (``--modes stream``), ``cost_vs_busy`` compares the busy
    fractions of both (machine speed cancels out when the halves ran on different machines). Each of
    ``--variants`` (``stream_interval_s[/switch_interval_s]``) streams through a server of its own; the plain run
    is measured on the first."""
    from rollout import SamplingParams
    from trainer_hooks.client import RolloutClient

    b = _bench()
    w = _workload(args, b)
    vocab = 700 if args.cpu_sim_ms is not None else b.PRESETS[w["preset"]][1]["vocab_size"]
    prompts, _ = b.make_prompts(w, vocab)
    p = SamplingParams(temperature=1.0, seed=0, max_tokens=w["new"], ignore_eos=True)
    records, plain = [], None
    for variant in (args.variants or "default").split(","):
        interval, _, switch = variant.partition("/")
        args.stream_interval = None if interval in ("", "default") else float(interval)
        args.switch_interval = float(switch) if switch else None
        server, url = _start_server(args)
        try:
            client = RolloutClient(url, max_concurrency=w["prompts"])
            # warm-up on every server (allocator, graphs at every batch size), so neither timed run goes first cold
            client.generate(prompts, SamplingParams(temperature=1.0, seed=1, max_tokens=min(512, w["new"]),
                                                    ignore_eos=True))
            runs = {}
            modes = [m for m in ("plain", "stream") if m in args.modes and (m == "stream" or plain is None)]
            for mode in modes:
                m0 = _read_monitor(args)
                (s0, g0), t0 = _steps(url), time.perf_counter()
                tokens = (sum(len(c.token_ids) for o in client.generate(prompts, p) for c in o.outputs)
                          if mode == "plain" else _stream_all(url, client.model, prompts, p))
                wall, (s1, g1) = time.perf_counter() - t0, _steps(url)
                steps = s1 - s0
                runs[mode] = dict(wall_s=round(wall, 3), tokens=tokens, steps=int(steps),
                                  step_ms=round(wall / max(steps, 1) * 1e3, 4), tok_s=round(tokens / wall, 1),
                                  **_server_side(m0, _read_monitor(args)))
                if g0 is not None and g1 is not None:  # the same steps' GPU work is the same in both modes, so
                    # wall / compute - 1 is what the host (streaming included) added, from one run alone
                    runs[mode].update(gpu_busy=round((g1 - g0) / wall, 4),
                                      compute_step_ms=round((g1 - g0) / max(steps, 1) * 1e3, 4))
            plain = runs.get("plain", plain)
            if plain is not None:
                runs["plain"] = plain
            cost = runs["stream"]["step_ms"] / plain["step_ms"] - 1 if "stream" in runs and plain else None
            # The streamed run alone bounds streaming's cost: its steps' wall over their GPU work - 1 (every host
            # stall, streaming's included). Both runs: the same ratio relative to plain's, which machines of
            # different speed (runs in different calls) do not skew as the plain step ratio does.
            busy = {m: r.get("gpu_busy") for m, r in runs.items()}
            host_cost = round(1 / busy["stream"] - 1, 4) if busy.get("stream") else None
            busy_cost = (round(busy["plain"] / busy["stream"] - 1, 4)
                         if busy.get("stream") and busy.get("plain") else None)
            rec = dict(workload="stream_cost", preset=w["preset"], sequences=w["prompts"], new_tokens=w["new"],
                       sampling="t1", stream_interval_s=args.stream_interval, switch_interval_s=args.switch_interval,
                       **{f"{m}_{k}": v for m, r in runs.items() for k, v in r.items()},
                       cost=None if cost is None else round(cost, 4), stream_cost_bound=host_cost,
                       cost_vs_busy=busy_cost, bar=0.02,
                       meets_bar=None if cost is None else cost < 0.02, commit=os.environ.get("COMMIT"))
            records.append(rec)
            print(json.dumps(rec), flush=True)
        finally:
            _stop(server, [], None)
    if args.out:
        with open(args.out, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)


def drive(args: argparse.Namespace) -> None:
    if args.stream_cost:
        return stream_cost(args)
    b = _bench()
    w = b.WORKLOADS[WORKLOAD]
    records = []
    inproc = _result(_child("inproc", args.engine_gpu, "--max-num-seqs", str(args.max_num_seqs)), 600)
    records.append(inproc)
    print(json.dumps(inproc), flush=True)
    server, url = _start_server(args)
    try:
        from rollout import SamplingParams
        from trainer_hooks.client import RolloutClient

        client = RolloutClient(url, max_concurrency=w["prompts"])
        prompts, params = b.make_prompts(w, b.PRESETS[w["preset"]][1]["vocab_size"])
        client.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        t0 = time.perf_counter()
        outs = client.generate(prompts, params)
        wall = time.perf_counter() - t0
        tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
        http = dict(workload=WORKLOAD, role="http", requests=len(prompts), concurrency=len(prompts),
                    wall_s=round(wall, 3), generated_tokens=tokens, tok_s=round(tokens / wall, 1),
                    inproc_tok_s=inproc["tok_s"], ratio=round(tokens / wall / inproc["tok_s"], 4), bar=0.9,
                    meets_bar=tokens / wall >= 0.9 * inproc["tok_s"], commit=inproc.get("commit"))
        records.append(http)
        print(json.dumps(http), flush=True)
        t0 = time.perf_counter()
        streamed = _stream_all(url, client.model, prompts, params[0] if isinstance(params, list) else params)
        wall = time.perf_counter() - t0
        stream = dict(workload=WORKLOAD, role="http_stream", requests=len(prompts), wall_s=round(wall, 3),
                      streamed_tokens=streamed, tok_s=round(streamed / wall, 1), inproc_tok_s=inproc["tok_s"],
                      ratio=round(streamed / wall / inproc["tok_s"], 4), commit=inproc.get("commit"))
        records.append(stream)
        print(json.dumps(stream), flush=True)
        if not args.one_gpu:  # the trainer needs a second GPU (NCCL push; nvidia-h200-x2)
            trainer = _result(_child("trainer", 0, "--url", url, "--repeats", str(args.repeats)), 600)
            records.append(trainer)
            print(json.dumps(trainer), flush=True)
    finally:
        _stop(server, records, args.out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("role", nargs="?", default="drive", choices=["drive", "inproc", "server", "trainer"])
    p.add_argument("--device", type=int, default=0)
    p.add_argument("--url", default=None)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--out", default=None)
    p.add_argument("--stream-cost", action="store_true",
                   help="one GPU: 256 sequences plain vs streamed, engine wall per step (bar: < 2%% more)")
    p.add_argument("--stream-tokens", type=int, default=16384, help="new tokens per sequence in --stream-cost")
    p.add_argument("--variants", default=None,
                   help="--stream-cost: comma-separated server variants, each stream_interval_s[/switch_interval_s]")
    p.add_argument("--modes", default="plain,stream",
                   help="--stream-cost: plain, stream or both (at 16K tokens each takes minutes: one call each)")
    p.add_argument("--stream-interval", type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument("--switch-interval", type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument("--cpu-sim-ms", type=float, default=None,
                   help="--stream-cost on the CPU: the embedded model, each step padded by this much device-like wait")
    p.add_argument("--server-cpus", default=None,
                   help="pin the server process to these cores (e.g. 0), the driver's client to the others")
    p.add_argument("--one-gpu", action="store_true",
                   help="engine and server on GPU 0, no trainer (the NCCL push needs a second GPU)")
    args = p.parse_args()
    args.engine_gpu = 0 if args.one_gpu or args.stream_cost else 1
    args.monitor_path = os.path.join(tempfile.gettempdir(), f"serve_bench_monitor_{os.getpid()}.json")
    if args.server_cpus and args.role == "drive":  # the client's threads stay off the server's cores
        os.sched_setaffinity(0, (os.sched_getaffinity(0) - _cpus(args.server_cpus)) or os.sched_getaffinity(0))
    os.environ.update(SAFE_ENV)
    {"drive": drive, "inproc": role_inproc, "server": role_server, "trainer": role_trainer}[args.role](args)


if __name__ == "__main__":
    main()
