"""Small builders the test files share (imported as ``helpers``: pytest puts tests/ on sys.path)."""
from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

from workbench.model import ModelArgs, Transformer


def tiny_model(seed: int = 1, **overrides) -> Transformer:
    """The ``tiny`` preset with random weights (std 0.1), in eval mode; ``overrides`` replace ModelArgs fields."""
    args = dataclasses.replace(ModelArgs.preset("tiny"), **overrides)
    return Transformer(args).init_weights(seed=seed, std=0.1).eval()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kill_when_ready(args: list[str], cwd: Path, pythonpath: list[Path]) -> None:
    """Run ``python ARGS`` until it prints ``ready`` on stdout, then SIGKILL it: a crash at exactly that point.
    Fails (with the child's stderr) if the child ends or prints anything else first."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(p) for p in pythonpath)}
    proc = subprocess.Popen([sys.executable, *args], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    try:
        line = proc.stdout.readline().strip()
        assert line == "ready", (line, proc.stderr.read() if proc.poll() is not None else "")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)


def source_tree(tmp_path: Path) -> Path:
    """A copy of the project's packaged sources (what a wheel is built from) under ``tmp_path/src``."""
    root = Path(__file__).resolve().parent.parent
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(root / name, src / name)
    for d in ("workbench", "model", "probes", "apps"):
        shutil.copytree(root / d, src / d, ignore=shutil.ignore_patterns("__pycache__"))
    return src
