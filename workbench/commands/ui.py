"""workbench ui: serve the Gradio workbench (localhost by default, analytics off)."""
from __future__ import annotations

import errno
import socket
import sys

from workbench.apps.app import launch
from workbench.data.store import TraceStore


def check_port(host: str, port: int | None) -> None:
    """ValueError (one line: "port P is in use ...") unless ``host:port`` can be bound now, so a busy port is
    found before the database is opened or anything recorded (Gradio's own check comes after all that, with a
    traceback). Bound as the server binds (``SO_REUSEADDR``): a port left in TIME_WAIT counts as free."""
    if port is None:
        return
    if not 0 < port < 65536:
        raise ValueError(f"--port must be 1..65535, got {port}")
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise ValueError(f"--host {host}: cannot resolve it ({e.strerror})") from None
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise ValueError(f"port {port} is in use on {host}: stop what serves there or pick another "
                                 "--port") from None
            raise ValueError(f"cannot serve on {host}:{port} ({e.strerror}); pick another --host or --port") from None


def main(args) -> int:

    check_port(args.host, args.port)
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.auth:
        print(f"workbench ui: warning: serving on {args.host} without --auth; anyone who can reach it can "
              "record runs and read the database", file=sys.stderr)
    db = args.db
    if getattr(args, "traces", None):
        db = TraceStore(args.traces)
    launch(db, args.host, args.port, args.auth)
    return 0
