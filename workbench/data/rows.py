"""``Rows``: one step's reductions as numpy columns, the shape every signal table is stored in.

The recorder hands ``Rows`` to the store's ``Writer``, which concatenates many steps' columns and builds
one frame per table per transaction in its own thread: building a polars frame per table per step cost
more than a small model's decode step.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class Rows:
    """One table's rows as numpy columns (2-D arrays for list columns), not yet a frame."""

    run_id: str
    cols: dict[str, np.ndarray]
    dtypes: dict[str, Any] = field(default_factory=dict)  # polars dtypes where numpy's is not enough
    nan_to_null: tuple[str, ...] = ()

    @property
    def height(self) -> int:
        return len(next(iter(self.cols.values())))
