"""The main job end to end: through a subprocess (as `make run` runs it) and through Hydra's compose API."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from rollout.assets import materialize_default_model
from rollout.job import main as script
from rollout.job.trajectory_writer import read_trajectories
from tests.script_helpers import ROOT, compose

SCRIPT = ROOT / "scripts" / "rollout.py"
TINY = ["sampling.max_tokens=3", "logger.progress=false"]


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """One default-model checkpoint for the whole session (subprocesses find it through ROLLOUT_CACHE)."""
    path = tmp_path_factory.mktemp("rollout-cache")
    materialize_default_model(path)
    return path


def run_composed(output_dir: Path, cache_dir: Path, *overrides: str, wandb: str = "disabled") -> Path:
    cfg = compose("config", f"output_dir={output_dir}", f"model.cache_dir={cache_dir}", f"logger.wandb.mode={wandb}",
                  *TINY, *overrides)
    return script.run(cfg)


def run_crashing_in_round(crash_round: int, output_dir: Path, cache_dir: Path, *overrides: str) -> None:
    """A composed run whose actor dies at the start of round ``crash_round``, as a killed job would."""
    from rollout.job.rounds import RoundDriver

    run_round = RoundDriver.run_round

    def crashing(self):
        if self.round == crash_round:
            raise RuntimeError("simulated crash")
        return run_round(self)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(RoundDriver, "run_round", crashing)
        with pytest.raises(RuntimeError, match="simulated crash"):
            run_composed(output_dir, cache_dir, *overrides)


def run_subprocess(cache_dir: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    # PYTHONPATH pinned to this checkout: a relative one (PYTHONPATH=.) would resolve against cwd.
    env = dict(os.environ, ROLLOUT_CACHE=str(cache_dir), WANDB_SILENT="true", HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    env.pop("WANDB_MODE", None)
    flags = [a for a in args if a.startswith("--")]  # Hydra's flags must precede the overrides
    overrides = [a for a in args if not a.startswith("--")]
    return subprocess.run(
        [sys.executable, str(SCRIPT), *flags, *TINY, *overrides],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def rows(output_dir: Path) -> list[dict]:
    return read_trajectories(output_dir).to_pylist()


def test_compose_overrides_change_row_count(cache_dir: Path, tmp_path: Path) -> None:
    out = run_composed(tmp_path / "o", cache_dir, "sampling.n=3", "data.num_prompts=5", "rollout.rounds=2")
    table = rows(out)
    assert len(table) == 30
    assert sorted({r["group_id"] for r in table}) == list(range(10))
    assert all(len(r["completion_ids"]) == len(r["logprobs"]) <= 3 for r in table)
    assert not (out / "wandb").exists()  # disabled: wandb is not even imported


def test_resume_after_crash_has_no_duplicates_or_gaps(cache_dir: Path, tmp_path: Path) -> None:
    out, args = tmp_path / "o", ("sampling.n=2", "data.num_prompts=3", "rollout.rounds=3", "sampling.seed=1")
    run_crashing_in_round(2, out, cache_dir, *args)
    assert {r["round"] for r in rows(out)} == {0, 1}
    with pytest.raises(ValueError, match="already holds a run; set rollout.resume=true"):
        run_composed(out, cache_dir, *args)
    with pytest.raises(ValueError, match=r"cannot resume .* sampling.n: saved 2, now 3"):
        run_composed(out, cache_dir, *args, "rollout.resume=true", "sampling.n=3")
    run_composed(out, cache_dir, *args, "rollout.resume=true")
    table = rows(out)
    keys = [(r["group_id"], r["sample_index"]) for r in table]
    assert sorted(keys) == [(g, i) for g in range(9) for i in range(2)]  # each once, none missing
    assert [r["round"] for r in table] == [0] * 6 + [1] * 6 + [2] * 6
    assert [json.loads(x)["round"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2]


@pytest.mark.parametrize(
    ("override", "error", "needle"),
    [
        ("model.path={tmp}/missing", FileNotFoundError, "model.path '.*missing' does not exist"),
        ("model.path={tmp}", ValueError, "is not a supported checkpoint: no config.json"),
        (
            "data.prompt_field=question",
            ValueError,
            r"data.prompt_field='question' .* fields are \['prompt', 'answer'\]",
        ),
        ("output_dir={tmp}/file/out", ValueError, "output_dir=.* is not writable"),
        (
            "model.path={tmp}/gpt2",
            ValueError,
            r"cannot load the model .* unsupported architecture \['GPT2LMHeadModel'\]",
        ),
        (
            "data.path={tmp}/file",
            ValueError,
            r"data.path=.* unsupported suffix; allowed: \['.json', '.jsonl'",
        ),
    ],
)
def test_bad_inputs_fail_before_generation(cache_dir, tmp_path, monkeypatch, override, error, needle) -> None:
    from rollout.job.rounds import RoundDriver

    (tmp_path / "file").write_text("x")
    gpt2 = tmp_path / "gpt2"  # a checkpoint of an architecture the engine does not implement
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(
        json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    )
    save_file({"wte.weight": torch.zeros(2, 2)}, str(gpt2 / "model.safetensors"))
    monkeypatch.setattr(RoundDriver, "run_round", lambda self: pytest.fail("generation started"))
    with pytest.raises(error, match=needle):
        run_composed(tmp_path / "o", cache_dir, override.format(tmp=tmp_path))


def test_subprocess_bad_input_prints_one_error_line(cache_dir: Path, tmp_path: Path) -> None:
    proc = run_subprocess(cache_dir, tmp_path, f"model.path={tmp_path}/nope", "logger.wandb.mode=disabled")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("error: model.path")
    assert "Traceback" not in proc.stderr


def test_subprocess_multirun_layout_and_wandb_offline(cache_dir: Path, tmp_path: Path) -> None:
    """The script as `make run` runs it, swept over 2 values: each job writes every artefact to its own
    output_dir (the default, Hydra's job dir), and W&B offline leaves a .wandb file there."""
    proc = run_subprocess(
        cache_dir,
        tmp_path,
        "--multirun",
        "sampling.n=1,2",
        "data.num_prompts=2",
        f"hydra.sweep.dir={tmp_path}/sweep",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for job, n in ((0, 1), (1, 2)):
        out = tmp_path / "sweep" / str(job)
        assert f"to {out / 'trajectories'} (wandb run: {out / 'wandb'}" in proc.stdout
        assert "round 1: " in (out / "rollout.log").read_text()  # logging reaches Hydra's log file
        table = rows(out)
        assert len(table) == 2 * 2 * n  # default rounds=2
        assert {
            "prompt_ids",
            "completion_ids",
            "logprobs",
            "finish_reason",
            "policy_version",
            "policy_versions",
            "min_policy_version",
            "max_policy_version",
            "group_id",
            "round",
            "prompt",
            "completion",
            "reward",
        } <= set(table[0])
        metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        assert [m["round"] for m in metrics] == [0, 1]
        for key in (
            "generated_tokens_per_s",
            "prompt_tokens_per_s",
            "round_time_s",
            "kv_cache_usage_mean",
            "kv_cache_usage_peak",
            "mean_batch_size",
            "num_preemptions",
            "completion_len_mean",
            "completion_len_max",
            "finish_stop",
            "finish_length",
            "reward_mean",
            "reward_std",
            "policy_version",
            "tail_batch_size",
            "staleness_hist",
            "dropped_groups",
            "carried_over_tokens",
        ):
            assert key in metrics[0], key
        assert json.loads((out / "config.json").read_text())["sampling"]["n"] == n
        assert list((out / "wandb").glob("offline-run-*/run-*.wandb")), list(out.rglob("*"))


# ---- issue 8: a refused run leaves no trace; one job per output_dir; resumes repeat exactly -------------
def _jsonl(path: Path, prompts: list) -> Path:
    path.write_text("".join(json.dumps({"prompt": p, "answer": "1"}) + "\n" for p in prompts))
    return path


def test_refused_run_leaves_output_dir_reusable(cache_dir: Path, tmp_path: Path, monkeypatch) -> None:
    """Each refusal comes before config.json is written, so the corrected rerun simply starts."""
    from rollout.job.rounds import RoundDriver

    late_long = _jsonl(tmp_path / "long.jsonl", [[5, 6, 7]] * 20 + [[7] * 2404] + [[5, 6]] * 3)
    late_null = _jsonl(tmp_path / "null.jsonl", [[5, 6, 7]] * 20 + [None] + [[5, 6]] * 3)
    out = tmp_path / "o"
    refusals = [
        ("sampling.max_tokens=100000", "exceeds max_model_len"),
        ("engine.num_blocks=1", "cannot fit the KV cache"),
        ("engine.max_model_len=8", "max_model_len is 8"),
        (f"data.path={late_long}", r"long.jsonl', row 20: prompt has 2404 tokens"),
        (f"data.path={late_null}", r"null.jsonl', row 20: field 'prompt' is null"),
    ]
    with monkeypatch.context() as m:
        m.setattr(RoundDriver, "run_round", lambda self: pytest.fail("generation started"))
        for override, needle in refusals:
            with pytest.raises(ValueError, match=needle):
                run_composed(out, cache_dir, "rollout.reward=null", override)
            assert not [p.name for p in out.iterdir() if not p.name.startswith(".")], override
    run_composed(out, cache_dir, "rollout.rounds=1", "data.num_prompts=2")  # no "already holds a run"
    assert len(rows(out)) == 2 * 4


def test_second_job_on_a_locked_output_dir_is_refused(cache_dir: Path, tmp_path: Path) -> None:
    from rollout.job.output_dir import OutputDirLock

    out = tmp_path / "o"
    out.mkdir()
    with OutputDirLock(out):  # another job holding it (flock conflicts across open files, same process too)
        with pytest.raises(ValueError, match=rf"is in use by another job \(pid {os.getpid()}\)"):
            run_composed(out, cache_dir)
    assert not (out / "config.json").exists()


def test_two_jobs_started_together_one_runs_one_is_refused(cache_dir: Path, tmp_path: Path) -> None:
    """Two processes on one output_dir at the same moment: exactly one writes; the other exits 2."""
    env = dict(os.environ, ROLLOUT_CACHE=str(cache_dir), WANDB_SILENT="true", HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    out = tmp_path / "shared"
    cmd = [sys.executable, str(SCRIPT), *TINY, f"output_dir={out}", "rollout.rounds=1", "data.num_prompts=2",
           "logger.wandb.mode=disabled", f"hydra.run.dir={tmp_path}/h"]
    procs = [subprocess.Popen([*cmd, f"sampling.n={n}"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for n in (1, 2)]
    results = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
    codes = sorted(code for code, _ in results)
    assert codes == [0, 2], results
    refused = next(err for code, err in results if code == 2)
    assert "Traceback" not in refused and "not writable" not in refused
    assert re.search(r"error: output_dir=.* (is in use by another job \(pid \d+\)|already holds a run)", refused)
    n = json.loads((out / "config.json").read_text())["sampling"]["n"]
    assert len(rows(out)) == 2 * n  # the rows and the config are the same job's


def test_unseeded_resume_repeats_the_uninterrupted_run(cache_dir: Path, tmp_path: Path) -> None:
    """sampling.seed=null: the job seed drawn at the first start is kept in config.json, and every
    request's seed derives from it, the round and the group; a resume after round 1 repeats round 2."""
    args = ("sampling.n=2", "data.num_prompts=3", "rollout.rounds=3", "sampling.max_tokens=4")
    full = run_composed(tmp_path / "full", cache_dir, *args)
    saved = json.loads((full / "config.json").read_text())
    assert saved["sampling"]["seed"] is None and isinstance(saved["job_seed"], int)
    crashed = tmp_path / "crashed"  # what a crash during round 2 leaves: config, rounds 0-1, their metrics
    (crashed / "trajectories").mkdir(parents=True)
    for name in ("config.json", "trajectories/round_00000.parquet", "trajectories/round_00001.parquet"):
        shutil.copyfile(full / name, crashed / name)
    run_composed(crashed, cache_dir, *args, "rollout.resume=true")
    assert rows(crashed) == rows(full)
    other = run_composed(tmp_path / "other", cache_dir, *args)  # a new run draws a new job seed
    assert [r["completion_ids"] for r in rows(other)] != [r["completion_ids"] for r in rows(full)]


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("model.device=tpu", "model.device='tpu' is invalid: must be null"),
        ("engine.async_mode=maybe", "engine.async_mode='maybe' is invalid: must be true, false or null"),
        ("data.path={tmp}/empty.jsonl", "empty.jsonl' is an empty file"),
        ("data.path={tmp}/negative.jsonl", "negative.jsonl', row 1: token id -2 is negative"),
    ],
)
def test_user_errors_are_value_errors(cache_dir: Path, tmp_path: Path, override: str, needle: str) -> None:
    """main() turns these into `error: ...` and exit code 2 (never a traceback)."""
    (tmp_path / "empty.jsonl").write_text("")
    _jsonl(tmp_path / "negative.jsonl", [[1, 2], [1, -2, 3]])
    with pytest.raises(ValueError, match=needle):
        run_composed(tmp_path / "o", cache_dir, override.format(tmp=tmp_path))


def test_subprocess_data_error_exits_2_and_lands_in_rollout_log(cache_dir: Path, tmp_path: Path) -> None:
    data = _jsonl(tmp_path / "negative.jsonl", [[1, -2, 3]])
    proc = run_subprocess(
        cache_dir, tmp_path, f"data.path={data}", "logger.wandb.mode=disabled", f"hydra.run.dir={tmp_path}/run"
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("error: data.path=")
    log = (tmp_path / "run" / "rollout.log").read_text()
    assert "row 0: token id -2 is negative" in log
    assert not (tmp_path / "run" / "config.json").exists()


# ---- issue 14: partial rollouts through the job ----------------------------------------------------------
def test_partial_mode_crash_and_resume_writes_every_group_once(cache_dir: Path, tmp_path: Path) -> None:
    from collections import Counter

    from rollout.job.trajectory_writer import TrajectoryWriter

    out = tmp_path / "o"
    args = ("rollout.mode=partial", "rollout.max_inflight_groups=3", "data.num_prompts=2", "sampling.n=2",
            "rollout.rounds=4", "rollout.reward=null")
    run_crashing_in_round(2, out, cache_dir, *args)
    probe = TrajectoryWriter(out, with_reward=False)
    assert probe.resume() == 2 and probe.state["inflight_groups"]  # carried over when it crashed
    carried = set(probe.state["inflight_groups"])
    run_composed(out, cache_dir, *args, "rollout.resume=true")
    table = rows(out)
    per_group = Counter(r["group_id"] for r in table)
    assert set(per_group.values()) == {2} and [r["round"] for r in table] == [x for x in range(4) for _ in range(4)]
    final = TrajectoryWriter(out, with_reward=False)
    final.resume()
    pending = set(final.state["inflight_groups"])
    assert carried <= set(per_group) | pending and not pending & set(per_group)
    assert set(per_group) | pending == set(range(final.state["next_group"]))
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["round"] for m in metrics] == [0, 1, 2, 3]
    assert all(m["carried_over_groups"] >= 1 and "tail_batch_size" in m for m in metrics)


def test_wandb_gets_histograms_not_dicts(tmp_path: Path) -> None:
    from rollout.rl.wandb_logger import WandbLogger
    from rollout.settings.schema import WandbConfig

    logged = []
    logger = WandbLogger(WandbConfig(mode="disabled"), tmp_path, {})
    logger.run = type("Run", (), {"log": lambda self, row: logged.append(row)})()
    logger.wandb_module = type("W", (), {"Histogram": staticmethod(lambda values: ("hist", values))})
    logger.log_round({"round": 3, "staleness_hist": {"0": 2}, "dropped_groups": 1, "gpu_busy_frac": None},
                     {"staleness": [0, 0, 1], "completion_len": []})
    assert logged == [{"round": 3, "round/dropped_groups": 1, "round/staleness_hist": ("hist", [0, 0, 1])}]


@pytest.mark.parametrize("inflight", [3, 5])
def test_partial_mode_resume_repeats_the_uninterrupted_run(cache_dir: Path, tmp_path: Path, inflight: int) -> None:
    """Stopped after round 2 and resumed to round 4, partial mode writes what an uninterrupted 4-round run
    writes, row for row: the groups in flight at the stop are regenerated with their own seeds."""
    args = ("rollout.mode=partial", f"rollout.max_inflight_groups={inflight}", "data.num_prompts=2", "sampling.n=2",
            "rollout.rounds=4", "rollout.reward=null", "sampling.seed=7", "sampling.max_tokens=6")
    full = run_composed(tmp_path / "full", cache_dir, *args)
    stopped = tmp_path / "stopped"
    run_crashing_in_round(2, stopped, cache_dir, *args)
    run_composed(stopped, cache_dir, *args, "rollout.resume=true")
    assert rows(stopped) == rows(full)


@pytest.mark.parametrize("wandb", ["disabled", "offline"])
def test_a_failing_first_round_leaves_output_dir_as_it_was(cache_dir: Path, tmp_path: Path, wandb: str) -> None:
    """No config.json (nor W&B run) before the first round is written: the rerun starts, fresh or resumed."""
    out = tmp_path / "o"
    args = ("rollout.rounds=1", "data.num_prompts=2", f"logger.wandb.mode={wandb}")
    run_crashing_in_round(0, out, cache_dir, *args)
    assert not [p.name for p in out.iterdir() if not p.name.startswith(".")]
    run_crashing_in_round(0, out, cache_dir, *args, "rollout.resume=true")
    assert not [p.name for p in out.iterdir() if not p.name.startswith(".")]
    run_composed(out, cache_dir, *args)
    assert len(rows(out)) == 2 * 4 and (out / "config.json").is_file()


def test_disk_full_is_a_user_error_and_the_rerun_starts(cache_dir: Path, tmp_path: Path, monkeypatch) -> None:
    """main() prints `error: ...` and exits 2 for a ValueError: a full disk is one, naming the file."""
    import errno

    import pyarrow.parquet as pq

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    out = tmp_path / "o"
    with monkeypatch.context() as m:
        m.setattr(pq, "write_table", full)
        with pytest.raises(ValueError, match=r"cannot write .*round_00000.parquet: no space left on device"):
            run_composed(out, cache_dir, "rollout.rounds=1", "data.num_prompts=2")
    run_composed(out, cache_dir, "rollout.rounds=1", "data.num_prompts=2")
    assert len(rows(out)) == 2 * 4
