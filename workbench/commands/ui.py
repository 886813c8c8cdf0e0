"""workbench ui: serve the Gradio workbench (localhost by default, analytics off)."""
from __future__ import annotations

import errno
import socket
import sys
from pathlib import Path

from workbench.apps.app import launch
from workbench.apps.tabs.record import set_checkpoint_roots
from workbench.data.store import TraceStore, default_db


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


def check_db(db: str | None, create: bool) -> None:
    """ValueError (one line) for a ``--db`` that does not exist, unless ``create`` or it is the default database
    (``$WORKBENCH_DB`` or data/workbench.duckdb, which a first ``workbench ui`` makes): the UI can record, so it
    would otherwise make a new database, and its folders, at a typo. Nothing is created here."""
    if not db:
        return
    path = Path(db).expanduser()
    if path.exists() or create or path.resolve() == default_db().expanduser().resolve():
        return
    raise ValueError(f"no database at {path} (nothing was created); give --db an existing file or shard folder, "
                     "or add --create to make a new one")


def checkpoint_roots(roots: list[str] | None) -> list[Path]:
    """The ``--checkpoint-root`` folders, resolved; ValueError (one line) for one that is not a folder."""
    out = []
    for root in roots or []:
        path = Path(root).expanduser().resolve()
        if not path.is_dir():
            raise ValueError(f"--checkpoint-root {root}: no such folder")
        out.append(path)
    return out


def main(args) -> int:
    check_port(args.host, args.port)
    check_db(args.db if not getattr(args, "traces", None) else None, getattr(args, "create", False))
    roots = checkpoint_roots(getattr(args, "checkpoint_root", None))
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.auth:
        print(f"workbench ui: warning: serving on {args.host} without --auth; anyone who can reach it can "
              "record runs and read the database", file=sys.stderr)
    set_checkpoint_roots(roots)  # the Record tab loads checkpoints from these (and the bundled demo) only
    db = args.db
    if getattr(args, "traces", None):
        db = TraceStore(args.traces)
    launch(db, args.host, args.port, args.auth)
    return 0
