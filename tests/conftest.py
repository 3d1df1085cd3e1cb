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
