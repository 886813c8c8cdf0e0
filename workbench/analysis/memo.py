"""Values made once per object: a profile frame's prepared forms (``anomalies.Baseline.of``, the rows
``activations.evidence`` reads), which their loaders hand out again while the stored profile is unchanged."""
from __future__ import annotations

from typing import Any, Callable


def by_object(cache: dict, obj: Any, make: Callable[[Any], Any], size: int = 8) -> Any:
    """``make(obj)``, made once per object and kept for the last ``size`` objects; each entry holds its object, so
    an id is never another object's."""
    hit = cache.get(id(obj))
    if hit is None or hit[0] is not obj:
        if len(cache) >= size:
            cache.pop(next(iter(cache)))
        hit = cache[id(obj)] = (obj, make(obj))
    return hit[1]
