"""Interventions on a model's computation, recorded with the run (``workbench.capture.interventions``).

    from workbench.interventions import ban_expert, scale_head
    child = workbench.record("def f(x):", model=m, interventions=[ban_expert(1, 5), "scale_head:L0H1=0"])
    child.interventions()          # the run's interventions table

Six constructors (``ban_expert``, ``boost_expert``, ``force_expert``, ``scale_head``, ``scale``, ``router_bias``)
return ``Intervention`` values; each has a ``spec`` string (``"ban:L3E5"``, the CLI's ``--intervene``) that
``parse`` reads back. Importing this module needs no torch; applying an intervention does.
"""
from __future__ import annotations

from workbench.capture.interventions import (FORMS, KINDS, Intervention, applied, ban_expert, boost_expert,
                                             force_expert, normalize, parse, router_bias, scale, scale_head)

__all__ = ["FORMS", "KINDS", "Intervention", "applied", "ban_expert", "boost_expert", "force_expert", "normalize",
           "parse", "router_bias", "scale", "scale_head"]
