"""Fixtures several test files share (pytest finds them here)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import source_tree


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module of many tiny forwards: on a busy 2-CPU machine torch's threads only contend
    (tiny forwards ran ~15x slower with two there). A module opts in with ``pytestmark``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def built_wheel(tmp_path_factory) -> tuple[Path, str]:
    """The wheel ``pip wheel -v`` builds from a copy of the packaged sources (``helpers.source_tree``), and pip's
    whole output (stdout + stderr): built once per session for every test about the package (it takes seconds)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = source_tree(tmp)
    got = subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "wheel", "--no-deps",
                          "--no-build-isolation", "--no-index", "-v", "-w", str(tmp / "dist"), str(src)],
                         capture_output=True, text=True, timeout=300)
    assert got.returncode == 0, got.stderr[-2000:]
    return next((tmp / "dist").glob("*.whl")), got.stdout + got.stderr
