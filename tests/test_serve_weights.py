"""Weights into a running server (rollout-serve in a subprocess) from a trainer in another process.

The trainer side is ``RolloutClient`` in this process (gloo on loopback), or a child process killed in the
middle of a push. After every update the server's logprobs are checked against Hugging Face's own model
with the weights that should be serving (float32, |delta| <= 1e-4).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from rollout.assets import materialize_default_model
from rollout.cli import train_grpo
from rollout.sampling_params import SamplingParams
from tests.engine_helpers import hf_logprobs
from tests.script_helpers import ROOT, compose
from tests.serve_helpers import Server, in_process_engine
from trainer_hooks.client import RequestRejected, RolloutClient
from trainer_hooks.snapshot import save_snapshot
from trainer_hooks.trl import TRLRollout

PROMPT = [5, 17, 300, 42, 9, 77]
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    cache = tmp_path_factory.mktemp("serve-cache")
    model_dir = materialize_default_model(cache)
    overrides = [f"model.cache_dir={cache}"]
    server = Server(*overrides)
    try:
        engine, _ = in_process_engine(*overrides)
        server.wait_ready()
        client = RolloutClient(server.url, timeout_s=60)
        yield SimpleNamespace(server=server, engine=engine, client=client, model_dir=model_dir,
                              tmp=tmp_path_factory.mktemp("snapshots"))
        client.close()
    finally:
        server.stop()


def _model(model_dir, seed: int):
    """The served architecture with new random weights (larger init: logits far from flat)."""
    cfg = AutoConfig.from_pretrained(model_dir)
    cfg.initializer_range = 0.1
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager").eval()


def _served(env, max_tokens: int = 6):
    """A greedy completion from the server: (token ids, logprobs, policy versions)."""
    out = env.client.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))[0]
    c = out.outputs[0]
    return c.token_ids, c.logprobs, c.policy_versions


def _assert_serves(env, hf_model) -> None:
    ids, lps, _ = _served(env)
    ref = hf_logprobs(hf_model, PROMPT, ids)[torch.arange(len(ids)), torch.tensor(ids)]
    assert torch.allclose(torch.tensor(lps), ref, atol=1e-4), (torch.tensor(lps) - ref).abs().max()


def test_client_generate_equals_engine_generate(env):
    prompts = [PROMPT, [1, 2, 3], "What is 2 + 3?"]
    params = [SamplingParams(n=2, max_tokens=5, seed=i, ignore_eos=True) for i in range(3)]
    got, want = env.client.generate(prompts, params), env.engine.generate(prompts, params)
    for g, w in zip(got, want):
        assert g.finished and g.prompt_token_ids == w.prompt_token_ids and g.prompt == w.prompt
        for a, b in zip(g.outputs, w.outputs):
            assert (a.index, a.token_ids, a.finish_reason, a.text) == (b.index, b.token_ids, b.finish_reason, b.text)
            assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)
            assert a.policy_versions == b.policy_versions == [0] * 5


# The trainer-script tests come first: they push versions from 0 (a training run's steps), and a server
# refuses a version lower than the one it serves.
def test_train_grpo_against_the_server(env, tmp_path):
    """rollout-train-grpo rollout.mode=server: GRPOTrainer generating through the server, pushing each step."""
    out = train_grpo.run(compose(
        "train_grpo", f"output_dir={tmp_path}", f"model.cache_dir={env.model_dir.parent}", "train.steps=2",
        "rollout.mode=server", f"rollout.url={env.server.url}", "sampling.n=2", "sampling.max_tokens=4",
        "data.num_prompts=2", "logger.wandb.mode=disabled",
    ))
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2] and env.client.policy_version == 1


def test_trl_rollout_takes_a_client(env, tmp_path):
    """TRLRollout(RolloutClient): weights pushed by training step, rows from the server."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(env.model_dir))
    model = _model(env.model_dir, seed=8)
    trainer = SimpleNamespace(
        model=model, processing_class=tok, state=SimpleNamespace(global_step=3),
        accelerator=SimpleNamespace(unwrap_model=lambda m: m),
        args=SimpleNamespace(temperature=1.0, top_p=1.0, top_k=0, min_p=None, max_completion_length=5,
                             generation_kwargs=None, repetition_penalty=1.0),
        eos_token_ids=[tok.eos_token_id], chat_template_kwargs={}, tools=None, chat_template=None,
    )
    rollout = TRLRollout(env.client)
    rows = rollout(["1 + 1 =", "1 + 1 =", "7 * 8 ="], trainer)
    assert env.client.policy_version == 3 and rows["policy_version"] == [3, 3, 3]
    for p, c, lps in zip(rows["prompt_ids"], rows["completion_ids"], rows["logprobs"]):
        ref = hf_logprobs(model, p, c)[torch.arange(len(c)), torch.tensor(c)]
        assert torch.allclose(torch.tensor(lps), ref, atol=1e-4)


def test_push_over_gloo_serves_the_new_weights(env):
    new = _model(env.model_dir, seed=1)
    before = env.client.policy_version
    version = env.client.push_weights(new)
    assert version == before + 1 == env.client.policy_version
    _assert_serves(env, new)
    assert _served(env)[2] == [version] * 6
    assert env.client.push_weights(dict(new.named_parameters()), version=40) == 40  # a mapping, explicit version
    _assert_serves(env, new)


def test_rejected_pushes_leave_the_old_weights_serving(env):
    current = _model(env.model_dir, seed=2)
    env.client.push_weights(current, version=50)
    before = _served(env)
    with pytest.raises(RequestRejected, match=r"shape \(10, 10\), expected"):
        env.client.push_weights({"model.embed_tokens.weight": torch.zeros(10, 10)})
    with pytest.raises(RequestRejected, match="unknown weight name 'model.nope.weight'"):
        env.client.push_weights({"model.nope.weight": torch.zeros(3)})
    bad = {n: p.detach().clone() for n, p in current.named_parameters()}
    bad["model.norm.weight"][0] = float("nan")  # only visible once the data arrived
    with pytest.raises(RequestRejected, match="finite"):
        env.client.push_weights(bad)
    unpacked = {"/init_weight_transfer": {"master_address": "127.0.0.1", "master_port": 1, "packed": False},
                "/update_weights": {"names": [], "dtype_names": [], "shapes": [], "packed": False}}
    for path, body in unpacked.items():  # refused before anything joins or waits for tensors
        status, text = env.server.post(path, json.dumps(body))
        assert status == 400 and "packed=false is not supported" in text, (path, status, text)
    assert _served(env) == before and env.client.policy_version == 50
    assert env.client.push_weights(current, version=51) == 51  # the same group takes the next push
    _assert_serves(env, current)


KILLER = """
import os, sys
sys.path.insert(0, {root!r})
from safetensors.torch import load_file
import rollout.weights.sender as sender
import trainer_hooks.client as c

real = sender.send_weights
def dying(group, specs, tensors, bucket_bytes, on_chunk=None):
    print("sending", flush=True)
    return real(group, specs, tensors, bucket_bytes, on_chunk=lambda k: k == 3 and os._exit(3))
sender.send_weights = dying
weights = {{n: t * 1.5 for n, t in load_file({weights!r}).items()}}
c.RolloutClient({url!r}).update_weights(weights, bucket_bytes=65536)
"""


def test_trainer_killed_mid_push_leaves_the_old_weights_serving(env):
    current = _model(env.model_dir, seed=3)
    env.client.push_weights(current, version=60)
    before = _served(env)
    code = KILLER.format(root=str(ROOT), weights=str(env.model_dir / "model.safetensors"), url=env.server.url)
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert child.returncode == 3 and "sending" in child.stdout, child.stderr
    deadline = time.monotonic() + 30
    while "weight push failed" not in "".join(env.server.lines) and time.monotonic() < deadline:
        time.sleep(0.1)  # the server notices the broken connection and drops the group
    assert _served(env) == before and env.client.policy_version == 60
    assert env.client.push_weights(current, version=61) == 61  # our group was replaced: the client makes a new one
    _assert_serves(env, current)


def test_update_from_disk(env):
    missing = env.tmp / "nowhere"
    with pytest.raises(RequestRejected, match="is not a readable checkpoint directory"):
        env.client.update_weights_from_disk(str(missing))
    (env.tmp / "empty").mkdir()
    with pytest.raises(RequestRejected, match="no \\*.safetensors"):
        env.client.update_weights_from_disk(str(env.tmp / "empty"))
    new = _model(env.model_dir, seed=4)
    path = save_snapshot(new, env.tmp, step=70)
    assert env.client.update_weights_from_disk(str(path)) == 70  # step_<N> becomes version N
    _assert_serves(env, new)
    wrong = _model(env.model_dir, seed=5)
    wrong.model.norm.weight.data = torch.ones(3)  # a tensor that does not fit
    bad = save_snapshot(wrong, env.tmp, step=80)
    before = _served(env)
    with pytest.raises(RequestRejected, match="model.norm.weight.*shape"):
        env.client.update_weights_from_disk(str(bad))
    assert _served(env) == before and env.client.policy_version == 70


@pytest.mark.parametrize("bad", [2**63, -1, 69])
def test_versions_out_of_range_or_going_back_are_refused(env, bad):
    """Engine.update_weights' rule through the server: 400 naming the value and the range, nothing changed,
    by broadcast (refused in the verdict, before a byte moves) and from disk."""
    current = env.client.policy_version
    assert current >= 70
    before = _served(env)
    with pytest.raises(RequestRejected, match=re.escape(f"in [{current}, 2**63)") + ".*" + f"got {bad}") as e:
        env.client.push_weights(_model(env.model_dir, seed=9), version=bad)
    assert e.value.status == 400
    with pytest.raises(RequestRejected, match=re.escape(f"in [{current}, 2**63)")) as e:
        env.client.update_weights_from_disk(str(env.tmp / "step_70"), version=bad)
    assert e.value.status == 400
    for wrong_type in (True, 1.5):  # not an int: the schema refuses it (422), as for every field
        with pytest.raises(RequestRejected, match="version") as e:
            env.client.update_weights_from_disk(str(env.tmp / "step_70"), version=wrong_type)
        assert e.value.status == 422
    assert _served(env) == before and env.client.policy_version == current


def test_pause_keep_push_resume_continues_under_the_new_version(env):
    new = _model(env.model_dir, seed=6)
    start = env.client.policy_version
    result: list = []
    long = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)
    t = threading.Thread(target=lambda: result.extend(env.client.generate([PROMPT], long)))
    t.start()
    _wait_for_tokens(env)
    assert env.client.pause("keep")["paused"]
    assert "rollout_running_seqs 1" in env.server.get("/metrics")[1]  # still there, holding its KV
    version = env.client.push_weights(new, version=start + 10)
    assert json.loads(env.server.get("/is_paused")[1]) == {"is_paused": True}
    env.client.resume()
    t.join(120)
    c = result[0].outputs[0]
    assert len(c.token_ids) == 120 and c.finish_reason == "length"
    assert c.policy_versions[0] == start and c.policy_versions[-1] == version
    assert c.policy_versions == sorted(c.policy_versions)


def test_pause_abort_ends_running_requests(env):
    result: list = []
    long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    t = threading.Thread(target=lambda: result.extend(env.client.generate([PROMPT], long)))
    t.start()
    _wait_for_tokens(env)
    assert env.client.pause("abort")["aborted"] == 1
    t.join(60)
    assert result[0].outputs[0].finish_reason == "abort" and len(result[0].outputs[0].token_ids) < 400
    env.client.resume()
    assert len(_served(env)[0]) == 6


def _wait_for_tokens(env, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = env.server.get("/metrics")[1]
        if "rollout_running_seqs 1" in text:
            return
        time.sleep(0.02)
    raise AssertionError("the request never started running")


def test_sleep_and_wake_up(env):
    before = _served(env)
    assert env.client.sleep() > 0
    assert json.loads(env.server.get("/is_sleeping")[1]) == {"is_sleeping": True}
    env.client.wake_up()
    assert _served(env) == before


def _staging_bytes(env) -> float:
    text = env.server.get("/metrics")[1]
    return float(next(x for x in text.splitlines() if x.startswith("rollout_weight_staging_bytes ")).split()[1])


def test_sleep_gives_back_the_push_staging_too(env):
    """The receiver keeps a model's worth of bytes between pushes; asleep, the server holds none of it, also after
    a push made while asleep, and wakes serving that push."""
    env.client.push_weights(_model(env.model_dir, seed=3))
    staging = _staging_bytes(env)
    assert staging > 0
    assert env.client.sleep() >= staging and _staging_bytes(env) == 0
    new = _model(env.model_dir, seed=4)
    version = env.client.push_weights(new)
    assert _staging_bytes(env) == 0
    env.client.wake_up()
    _assert_serves(env, new)
    assert _served(env)[2] == [version] * 6
