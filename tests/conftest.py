"""Suite-wide settings, and the fixtures several test files share."""

from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    """Tiny matmuls on a shared 2-core box: OpenMP threads spinning against each other cost ~10x."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


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
