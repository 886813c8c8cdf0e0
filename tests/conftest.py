"""Fixtures several test files share (pytest finds them here)."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module of many tiny forwards: on a busy 2-CPU machine torch's threads only contend
    (tiny forwards ran ~15x slower with two there). A module opts in with ``pytestmark``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
