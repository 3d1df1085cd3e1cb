"""Suite-wide settings."""

import pytest
import torch


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    """Tiny matmuls on a shared 2-core box: OpenMP threads spinning against each other cost ~10x."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def ray_local():
    """One local Ray for every pool test file (its start is the slow part on a small box); skip without Ray."""
    ray = pytest.importorskip("ray", reason="the pool needs Ray (pip install ray; see requirements.lock)")
    from rollout.pool import ray_setup

    try:
        ray_setup.init("local", num_cpus=3)  # two replicas of one CPU each, and the driver
    except Exception as e:  # noqa: BLE001 - no Ray on this box is a skip, not a failure
        if ray.is_initialized():
            ray.shutdown()
        pytest.skip(f"Ray could not start here: {e!r}")
    yield ray
    ray.shutdown()
