"""workbench ui: serve the Gradio workbench (localhost by default, analytics off)."""
from __future__ import annotations

import sys

from workbench.apps.app import launch
from workbench.data.store import TraceStore


def main(args) -> int:

    if args.port is not None and not 0 < args.port < 65536:
        raise ValueError(f"--port must be 1..65535, got {args.port}")
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.auth:
        print(f"workbench ui: warning: serving on {args.host} without --auth; anyone who can reach it can "
              "record runs and read the database", file=sys.stderr)
    db = args.db
    if getattr(args, "traces", None):
        db = TraceStore(args.traces)
    launch(db, args.host, args.port, args.auth)
    return 0
