"""workbench ui: serve the Gradio workbench (localhost by default, analytics off)."""
from __future__ import annotations


def main(args) -> int:
    from workbench.apps.app import launch

    if args.port is not None and not 0 < args.port < 65536:
        raise ValueError(f"--port must be 1..65535, got {args.port}")
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.auth:
        import sys
        print(f"workbench ui: warning: serving on {args.host} without --auth; anyone who can reach it can "
              "record runs and read the database", file=sys.stderr)
    db = args.db
    if getattr(args, "traces", None):
        from workbench.data.store import TraceStore
        db = TraceStore(args.traces)
    launch(db, args.host, args.port, args.auth)
    return 0
