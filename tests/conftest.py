"""Suite-wide settings, and the fixtures several test files share."""

from pathlib import Path

import pytest
import torch


def pytest_configure(config: pytest.Config) -> None:
    """Files go to the xdist workers in collection (name) order, not xdist's own most-tests-first: that order
    started test_serve_load.py (one test, ~20 s) and the other one-test files last, on one worker, while the
    other sat idle; by name the last files are short ones and the two workers finish together."""
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist's --no-loadscope-reorder
        config.option.loadscopereorder = False


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    """Tiny matmuls on a shared 2-core box: OpenMP threads spinning against each other cost ~10x."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session", autouse=True)
def no_idle_ray_workers():
    """A local Ray session (the pool's) starts no idle workers ahead of use: the raylet it spawns reads this
    from our environment. Its default starts one Python worker per CPU asked for when the first driver joins,
    which nothing here runs on (the replicas are actors, each in a process of its own); on a 2-core box their
    imports cost ~8 CPU-seconds per session, taken from the other pytest worker."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAY_prestart_worker_first_driver", "0")
        yield


@pytest.fixture(scope="module")
def tokenizer():
    """The embedded default model's tokenizer (rollout/assets)."""
    from transformers import AutoTokenizer

    from rollout.assets import assets_dir

    return AutoTokenizer.from_pretrained(assets_dir())


@pytest.fixture(scope="module")
def default_model(tmp_path_factory) -> Path:
    """The embedded default checkpoint (tiny random-init Llama), materialised in a fresh cache dir."""
    from rollout.assets import materialize_default_model

    return materialize_default_model(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    """A model cache dir holding the embedded default checkpoint: a job's ``model.cache_dir``."""
    from rollout.assets import materialize_default_model

    path = tmp_path_factory.mktemp("rollout-cache")
    materialize_default_model(path)
    return path
