"""The Ray pool's bars on the two-H200 machine (issue 11); results appended to bench/results/.

    python bench/pool_bench.py --mode throughput   # W2 (qwen2.5-1.5b, 64 prompts x n=8, long tail):
                                                   # a pool of 1 replica, then of 2, same run; bar >= 1.9x
    python bench/pool_bench.py --mode push         # a trainer actor (its own GPU) pushes every weight of
                                                   # qwen2.5-1.5b over NCCL to a replica on the other GPU;
                                                   # bar <= 0.1 s; then bf16 teacher-forced logprobs match
    python bench/pool_bench.py --mode push --colocate   # the issue's bar: 2 replicas, replica 0 co-located
                                                   # on the trainer's GPU 0 (CUDA IPC), replica 1 on GPU 1
                                                   # (NCCL), one push to both in <= 0.1 s; both then match
    python bench/pool_bench.py --mode push --colocate --preset llama3-8b   # issue 24's shape (16 GB)
    python bench/pool_bench.py --mode kill --prompts 16   # 2 replicas on W2's lengths, replica 1 killed once the
                                                   # first group is back: every group returns once, whole

Third-party imports: torch, transformers, ray (triton through the engine). The model is a public shape with random
weights (``--preset``: qwen2.5-1.5b unless the push names another; throughput and kill run the workload's own), saved
once per shape as a checkpoint every replica loads.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rollout import SamplingParams  # noqa: E402
from rollout.pool import EngineFactory  # noqa: E402
from rollout.pool.pool import RolloutPool  # noqa: E402


def _bench_module():
    """scripts/bench.py's presets and W2 prompt maker: one definition of the workloads."""
    spec = importlib.util.spec_from_file_location("rollout_bench", ROOT / "scripts" / "bench.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


def save_checkpoint(preset: str, directory: Path) -> Path:
    """The preset's config with seeded random bf16 weights, built on the CPU (the driver stays off the GPUs)."""
    if (directory / "config.json").exists():
        return directory
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    family, kw = _bench_module().PRESETS[preset]
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[family]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cls(**kw), dtype=torch.bfloat16)
    model.save_pretrained(directory)
    return directory


def warm(pool: RolloutPool, max_num_seqs: int) -> None:
    """Each replica meets every power-of-two decode batch once (graph capture stays out of the timing)."""
    sizes = [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512) if b <= max_num_seqs]
    for i, m in enumerate(pool.members):
        refs = [m.actor.run.remote(f"warm-{i}-{b}", [1] * 8, SamplingParams(n=b, max_tokens=3, ignore_eos=True))
                for b in reversed(sizes)]
        pool.ray.get(refs)


def workload(args: argparse.Namespace, ckpt: Path, prompts: int = 0) -> tuple[list, list, EngineFactory]:
    """``args.workload``'s prompts and sampling params (``args.prompts`` or ``prompts`` of them, if set) and the
    factory of replicas sized to hold every sequence at full length."""
    b = _bench_module()
    w = dict(b.WORKLOADS[args.workload])
    if args.prompts or prompts:
        w["prompts"] = args.prompts or prompts
    prompts_, params = b.make_prompts(w, 151936 if "qwen" in w["preset"] else 128256)
    n = w.get("n", 1)
    blocks = int(sum(-(-(w["prompt_len"] + p.max_tokens) // 16) * n for p in params) * 1.1) + 64
    options = dict(max_model_len=w["prompt_len"] + w["new"] + 16, num_blocks=blocks, max_num_seqs=args.max_num_seqs)
    return prompts_, params, EngineFactory(str(ckpt), dtype="bfloat16", options=options)


def throughput(args: argparse.Namespace, ckpt: Path) -> list[dict]:
    prompts, params, factory = workload(args, ckpt)
    recs = []
    for replicas in (1, 2):
        pool = RolloutPool(replicas, factory, gpus_per_replica=1)
        warm(pool, args.max_num_seqs)
        t0 = time.perf_counter()
        outs = pool.generate(prompts, params)
        wall = time.perf_counter() - t0
        tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
        stats = pool.stats()
        recs.append(dict(workload=args.workload, mode="pool", replicas=replicas, wall_s=round(wall, 3),
                         generated_tokens=tokens, tok_s=round(tokens / wall, 1),
                         groups_per_replica=pool.last_round["groups_per_replica"],
                         replica_tok_s=[round(r["tokens_per_s"], 1) for r in stats["replicas"]]))
        print(json.dumps(recs[-1]), flush=True)
        pool.shutdown()
        time.sleep(5)  # the killed actors' processes release their GPUs
    recs.append(dict(workload=args.workload, mode="pool_speedup", speedup=round(recs[1]["tok_s"] / recs[0]["tok_s"], 3),
                     bar=1.9))
    return recs


def kill_round(pool, prompts: list, params: list, kill_after: int = 1, victim_index: int = 1) -> dict:
    """One round over ``pool`` in which replica ``victim_index`` is killed once ``kill_after`` groups are back:
    every group must come back exactly once with all of its samples at their full length (``ignore_eos``); the
    pool requeues the dead replica's groups and starts a replacement. Returns the record (``ok`` says the bar)."""
    got: dict[int, object] = {}
    twice: list[int] = []
    killed_at = victim = None
    t0 = time.perf_counter()
    for i, out in pool.generate_iter(prompts, params):
        if i in got:
            twice.append(i)
        got[i] = out
        if victim is None and len(got) >= kill_after:
            victim = pool.members[victim_index].actor
            pool.ray.kill(victim, no_restart=True)
            killed_at = time.perf_counter() - t0
    wall = time.perf_counter() - t0
    wrong = sorted(i for i, o in got.items()
                   if len(o.outputs) != params[i].n or any(len(c.token_ids) != params[i].max_tokens for c in o.outputs))
    missing = sorted(set(range(len(prompts))) - set(got))
    t1 = time.perf_counter()
    pool.wait_ready()  # the replacement loaded, caught up to the pool's weights, and takes work
    ready = time.perf_counter() - t1
    r = pool.last_round
    return dict(mode="kill", replicas=len(pool.members), groups=len(prompts), returned=len(got), missing=missing,
                returned_twice=sorted(set(twice)), wrong_length=wrong, killed=victim is not None,
                killed_at_s=killed_at and round(killed_at, 3), wall_s=round(wall, 3),
                generated_tokens=sum(len(c.token_ids) for o in got.values() for c in o.outputs),
                failed_replicas=[f["replica"] for f in r["failures"]], resubmitted_groups=r["resubmitted_groups"],
                replaced=pool.members[victim_index].actor is not victim, replacement_ready_s=round(ready, 3),
                ok=bool(victim is not None and not missing and not twice and not wrong))


def kill(args: argparse.Namespace, ckpt: Path) -> list[dict]:
    prompts, params, factory = workload(args, ckpt, prompts=16)
    pool = RolloutPool(2, factory, gpus_per_replica=1)
    warm(pool, args.max_num_seqs)
    rec = dict(workload=args.workload, **kill_round(pool, prompts, params))
    print(json.dumps(rec), flush=True)
    pool.shutdown()
    return [rec]


def push(args: argparse.Namespace, ckpt: Path) -> list[dict]:
    import ray

    @ray.remote(num_gpus=1)
    class Trainer:
        """Rank 0 on its own GPU; the pool it makes holds one replica on the other GPU."""

        def run(self, ckpt: str, repeats: int, colocate: bool, preset: str) -> dict:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16).cuda().eval()
            with torch.no_grad():  # new weights, so the check below proves the push
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * 1e-3)
            replicas = 2 if colocate else 1  # co-located: replica 0 on this GPU (it is Ray's: no reservation)
            pool = RolloutPool(replicas, EngineFactory(ckpt, dtype="bfloat16", options=dict(max_model_len=1024,
                                                                                            num_blocks=256)),
                               gpus_per_replica=1, colocate_with_trainer=colocate, trainer_device="cuda:0")
            named = [(n, p.detach()) for n, p in model.named_parameters()]
            times = []
            for r in range(repeats):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                version = pool.update_weights(named, version=r + 1)
                times.append(time.perf_counter() - t0)
            prompt = list(range(100, 164))
            greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs_mode="policy")
            diffs = []
            for i, m in enumerate(pool.members):  # every replica, each asked directly
                out = ray.get(m.actor.run.remote(f"check-{i}", prompt, greedy)).outputs[0]
                with torch.no_grad():
                    ids = torch.tensor([prompt + out.token_ids], device="cuda")
                    logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
                    ref = torch.log_softmax(logits, -1)[torch.arange(len(out.token_ids)), torch.tensor(out.token_ids)]
                diffs.append(round((torch.tensor(out.logprobs) - ref.cpu()).abs().max().item(), 4))
            nbytes = sum(t.numel() * t.element_size() for _, t in named)
            last = dict(pool.transfer.last_push)
            pool.shutdown()
            return dict(mode="push_colocated" if colocate else "push", preset=preset, bytes=nbytes,
                        first_push_s=round(times[0], 4), push_s=round(min(times[1:] or times), 4), repeats=repeats,
                        bar_s=0.1, version=version, replicas=replicas, by_handle=last.get("by_handle"),
                        by_broadcast=last.get("by_broadcast"), max_abs_logprob_diff_bf16=max(diffs),
                        per_replica_logprob_diff=diffs)

    trainer = Trainer.remote()
    rec = ray.get(trainer.run.remote(str(ckpt), args.repeats, args.colocate, args.preset))
    print(json.dumps(rec), flush=True)
    return [rec]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("throughput", "push", "kill", "all"), default="all",
                   help="all: throughput, then push (kill runs only when asked)")
    p.add_argument("--workload", default="W2")
    p.add_argument("--prompts", type=int, default=0, help="override the workload's prompt count (0 = as defined)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--colocate", action="store_true", help="push: replica 0 on the trainer's GPU by CUDA IPC, "
                   "replica 1 on the other GPU by NCCL")
    p.add_argument("--preset", default="qwen2.5-1.5b", help="push: the model shape the trainer pushes (issue 24's bar: "
                   "llama3-8b, 16 GB)")
    p.add_argument("--ckpt-root", default=os.environ.get("POOL_BENCH_CKPT", "/tmp/pool_bench"),
                   help="checkpoints are saved once per shape under this folder")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / f"pool_{dt.date.today()}.jsonl"))
    args = p.parse_args()
    bench = _bench_module()
    if args.preset not in bench.PRESETS:
        p.error(f"--preset {args.preset!r}: allowed {sorted(bench.PRESETS)}")
    if args.workload not in bench.WORKLOADS:
        p.error(f"--workload {args.workload!r}: allowed {sorted(bench.WORKLOADS)}")
    import ray

    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, configure_logging=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    recs = []
    if args.mode in ("throughput", "kill", "all"):
        preset = bench.WORKLOADS[args.workload]["preset"]
        ckpt = save_checkpoint(preset, Path(args.ckpt_root) / preset)
        recs += throughput(args, ckpt) if args.mode != "kill" else kill(args, ckpt)
    if args.mode in ("push", "all"):
        recs += push(args, save_checkpoint(args.preset, Path(args.ckpt_root) / args.preset))
    stamp = dict(timestamp=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                 device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                 gpus=torch.cuda.device_count())
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "a") as f:
        for r in recs:
            f.write(json.dumps({**stamp, **r}) + "\n")
    ok = all(r.get("speedup", 9) >= 1.9 and r.get("push_s", 0) <= 0.1 and r.get("ok", True) for r in recs)
    print("bars met" if ok else "a bar was missed", flush=True)


if __name__ == "__main__":
    main()
