"""`rollout.weights_from=DIR` (issue 10, item 5): the job loads a trainer's snapshots between rounds."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from rollout.job.snapshots import COMPLETE, SnapshotWatcher
from tests.job_fakes import FakeEngine
from tests.test_rollout_script import cache_dir, rows, run_composed  # noqa: F401 (cache_dir: a fixture)


def write_snapshot(model, root: Path, step: int, complete: bool = True) -> Path:
    """What trainer_hooks.save_snapshot does: save_pretrained into a temp dir, rename, COMPLETE last."""
    tmp = root / f".tmp-step_{step}"
    model.save_pretrained(tmp, safe_serialization=True)
    final = root / f"step_{step}"
    os.replace(tmp, final)
    if complete:
        (final / COMPLETE).write_text("")
    return final


def perturbed(base: Path, seed: int):
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5 * torch.randn(p.shape, generator=g))
    return model


@torch.no_grad()
def teacher_forced(model, prompt_ids: list[int], completion: list[int]) -> list[float]:
    ids = torch.tensor([prompt_ids + completion])
    logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(completion)[:, None])[:, 0].tolist()


def test_three_rounds_carry_the_version_of_the_weights_that_made_them(
    cache_dir: Path, tmp_path: Path, monkeypatch  # noqa: F811
) -> None:
    from rollout.assets import materialize_default_model
    from rollout.job.rounds import RoundDriver

    base = materialize_default_model(cache_dir)
    snaps = tmp_path / "snapshots"
    snaps.mkdir()
    models = {5: perturbed(base, 1), 9: perturbed(base, 2)}
    run_round = RoundDriver.run_round

    def trainer_between_rounds(self):
        result = run_round(self)
        if result.round == 0:
            write_snapshot(models[5], snaps, 5)
        if result.round == 1:
            write_snapshot(models[5], snaps, 7, complete=False)  # still being written: ignored
            write_snapshot(models[9], snaps, 9)
        return result

    monkeypatch.setattr(RoundDriver, "run_round", trainer_between_rounds)
    out = run_composed(tmp_path / "o", cache_dir, f"rollout.weights_from={snaps}", "rollout.rounds=3",
                       "data.num_prompts=2", "sampling.n=2")
    table = rows(out)
    by_round = {r: [t for t in table if t["round"] == r] for r in range(3)}
    assert {v for t in by_round[0] for v in t["policy_versions"]} == {0}
    assert {v for t in by_round[1] for v in t["policy_versions"]} == {5}
    assert {v for t in by_round[2] for v in t["policy_versions"]} == {9}
    assert [t["policy_version"] for t in by_round[2]] == [9] * 4
    row = by_round[2][0]  # made by step_9's weights: its logprobs are that model's, not the base's
    want = teacher_forced(models[9], row["prompt_ids"], row["completion_ids"])
    assert max(abs(a - b) for a, b in zip(row["logprobs"], want)) < 1e-4
    base_lp = teacher_forced(AutoModelForCausalLM.from_pretrained(base), row["prompt_ids"], row["completion_ids"])
    assert max(abs(a - b) for a, b in zip(row["logprobs"], base_lp)) > 1e-2


def test_watcher_picks_the_newest_complete_snapshot_once(tmp_path: Path) -> None:
    tensors = {"w": torch.zeros(2)}

    class Model:  # just enough of save_pretrained for the layout
        def save_pretrained(self, path, safe_serialization=True):
            from safetensors.torch import save_file

            Path(path).mkdir(parents=True)
            save_file(tensors, str(Path(path) / "model.safetensors"))
            (Path(path) / "config.json").write_text("{}")

    class Actor:
        def __init__(self):
            self.engine = FakeEngine()

        def update_weights(self, named, version=None):
            assert [n for n, _ in named] == ["w"]
            return self.engine.update_weights({}, version=version)

    watcher, actor = SnapshotWatcher(tmp_path / "not-yet"), Actor()
    assert watcher.load_newest(actor) is None  # the trainer has not created the directory yet
    root = tmp_path / "not-yet"
    root.mkdir()
    for step, complete in ((3, True), (12, True), (20, False)):
        write_snapshot(Model(), root, step, complete)
    (root / "step_x").mkdir()
    assert watcher.load_newest(actor) == 12 and actor.engine.policy_version == 12  # 3 is skipped over
    assert watcher.load_newest(actor) is None  # nothing newer
    (root / "step_20" / COMPLETE).write_text("")
    assert watcher.load_newest(actor) == 20
    with pytest.raises(ValueError, match="rollout.weights_from=.* is not a directory"):
        SnapshotWatcher(root / "step_20" / COMPLETE)


def test_refused_snapshot_names_itself_and_keeps_the_old_weights(tmp_path: Path) -> None:
    from rollout import Engine
    from rollout.assets import materialize_default_model
    from rollout.job.rounds import RoundDriver

    base = materialize_default_model(tmp_path / "cache")
    engine = Engine.from_pretrained(str(base), dtype="float32", device="cpu")
    before = {n: p.clone() for n, p in engine.model.named_parameters()}
    model = AutoModelForCausalLM.from_pretrained(base)
    with torch.no_grad():
        model.model.norm.weight = torch.nn.Parameter(torch.ones(3))  # the wrong shape
    write_snapshot(model, tmp_path, 4)
    actor = RoundDriver(engine, None, engine_params(), 1)
    with pytest.raises(ValueError, match=r"snapshot '.*step_4' was refused: .*norm"):
        SnapshotWatcher(tmp_path).load_newest(actor)
    assert engine.policy_version == 0
    assert all(torch.equal(p, before[n]) for n, p in engine.model.named_parameters())


def engine_params():
    from rollout.sampling_params import SamplingParams

    return SamplingParams(max_tokens=2)


def test_snapshot_steps_out_of_range_or_going_back_are_refused(tmp_path: Path) -> None:
    """Versions are ints in [0, 2**63) that never decrease: refused naming the value before a round runs."""
    huge = tmp_path / "huge"
    (huge / f"step_{2**63}").mkdir(parents=True)
    (huge / f"step_{2**63}" / COMPLETE).write_text("")
    with pytest.raises(ValueError, match=rf"has step {2**63}; policy versions must be ints in \[0, 2\*\*63\)"):
        SnapshotWatcher(huge).newest()
    back = tmp_path / "back"
    (back / "step_3").mkdir(parents=True)
    (back / "step_3" / COMPLETE).write_text("")
    assert SnapshotWatcher(back, floor=3).newest()[0] == 3  # a resume reloads the weights it had
    with pytest.raises(ValueError, match="reach policy_version 5, but the newest complete snapshot is step_3"):
        SnapshotWatcher(back, floor=5).newest()
    with pytest.raises(ValueError, match="reach policy_version 5, but the newest complete snapshot is none"):
        SnapshotWatcher(tmp_path / "empty", floor=5).newest()


def test_resume_refuses_snapshots_older_than_the_rounds_written(
    cache_dir: Path, tmp_path: Path, monkeypatch  # noqa: F811
) -> None:
    from rollout.assets import materialize_default_model
    from rollout.job.rounds import RoundDriver

    base = materialize_default_model(cache_dir)
    snaps = tmp_path / "snapshots"
    snaps.mkdir()
    write_snapshot(perturbed(base, 1), snaps, 5)
    args = (f"rollout.weights_from={snaps}", "data.num_prompts=2", "sampling.n=2")
    out = run_composed(tmp_path / "o", cache_dir, *args, "rollout.rounds=1")
    assert {t["policy_version"] for t in rows(out)} == {5}
    os.rename(snaps / "step_5", snaps / "step_2")  # the trainer's directory now holds an older step only
    monkeypatch.setattr(RoundDriver, "run_round", lambda self: pytest.fail("generation started"))
    with pytest.raises(ValueError, match="reach policy_version 5, but the newest complete snapshot is step_2"):
        run_composed(out, cache_dir, *args, "rollout.rounds=2", "rollout.resume=true")


def test_snapshots_stream_one_tensor_at_a_time(tmp_path: Path, monkeypatch) -> None:
    """The job's reader is the server's (``CheckpointWeights``): each tensor is read from the file and checked
    by the engine before the next is read, on both passes; never the whole model listed in host memory."""
    import rollout.models.loader as loader
    from rollout.weights.disk import CheckpointWeights
    from tests.engine_helpers import make_engine
    from tests.tiny_models import make_tiny_hf_model, save_tiny_checkpoint

    old, new = make_tiny_hf_model("llama", seed=0), make_tiny_hf_model("llama", seed=1)
    save_tiny_checkpoint(new, tmp_path / "step_3", shards=2)
    (tmp_path / "step_3" / COMPLETE).write_text("")
    engine = make_engine(old, max_model_len=64)
    log: list[str] = []
    real_open, real_validate = loader.safe_open, engine.weights.mapper.validate

    class CountingFile:
        def __init__(self, f) -> None:
            self.f = f

        def keys(self):
            return self.f.keys()

        def get_tensor(self, name):
            log.append("read")
            return self.f.get_tensor(name)

    class CountingOpen:
        def __init__(self, *args, **kwargs) -> None:
            self.ctx = real_open(*args, **kwargs)

        def __enter__(self):
            return CountingFile(self.ctx.__enter__())

        def __exit__(self, *exc):
            return self.ctx.__exit__(*exc)

    def validate(name, tensor):
        log.append("check")
        return real_validate(name, tensor)

    monkeypatch.setattr(loader, "safe_open", CountingOpen)
    monkeypatch.setattr(engine.weights.mapper, "validate", validate)
    assert SnapshotWatcher(tmp_path).load_newest(engine) == 3 and engine.policy_version == 3
    n = len(list(new.state_dict()))
    first_pass = log[: 2 * n]
    assert first_pass == ["read", "check"] * n, log[:12]  # before: n reads, then n checks (a list)
    assert log.count("read") == 2 * n  # the copy pass reads again, lazily, instead of holding a list
    assert isinstance(CheckpointWeights(tmp_path / "step_3").__iter__(), type(x for x in ()))
    for name, t in new.state_dict().items():
        assert torch.equal(engine.weights.mapper.resolve(name).dst(), t)
