"""Small builders the test files share (imported as ``helpers``: pytest puts tests/ on sys.path)."""
from __future__ import annotations

import dataclasses
import socket

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
