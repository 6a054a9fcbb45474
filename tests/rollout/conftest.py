"""The rollout tests' settings: one torch thread. Their SGLang servers are the session's (``tests/sglang_servers.py``);
the tests that hang, kill or shut one down are marked ``destroys_server`` and run last (tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Tiny models run far faster on one thread than on two contended ones (the servers use one too)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
