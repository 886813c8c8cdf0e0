"""The UI under load: does a recording slow down while 8 clients read, and how fast do they get answers?

    python benchmarks/ui_load.py [--new-tokens 64] [--clients 8] [--model demo|tiny] [--write]
        [--app FILE] [--sqlsafe FILE] [--no-sessions] [--direct-threads N] [--switch-interval S]

The app is started in this process (``build_app(store, model)`` + ``app.queue()``, as the tests do) on
a free port of 127.0.0.1. One recording of ``--new-tokens`` tokens with the bundled demo model (loaded
once and given to both the app and ``workbench.record``; ``--model tiny``: a tiny random one) is timed
alone, then again while ``--clients`` clients hammer read endpoints: each client, in a closed loop (no
pause between requests), calls ``/tokens`` (a recorded run's tokens) and ``/sql`` (``SELECT count(*)
...``) in turns (``--endpoints``) over Gradio's plain HTTP API (POST ``/gradio_api/call/<name>``, then
read its event stream), each with a session hash of its own as a browser tab has (``--no-sessions``:
none, so Gradio makes a new session for every request). The clients live in another process, as
browsers would, so their own Python work does not take this process's GIL. ``--app`` / ``--sqlsafe``
take apps/app.py / workbench/data/sqlsafe.py from another file (an older version, for before / after);
``--direct-threads`` and ``--switch-interval`` try what the recorder or the app could set (torch's
intra-op threads while the "direct" recording runs; ``sys.setswitchinterval`` of this process).
``--reps`` pairs of alone / under load alternate, so that a shared machine's drifts hit both alike;
medians are reported, and the slowdown of each pair.

The recording is timed two ways, alone and under load:

* ``ui``: through the app's Record endpoint (``/record``, the Record tab's button), from the POST to
  the last streamed update;
* ``direct``: ``workbench.record(...)`` called in this process beside the serving app (a notebook
  user recording while the UI is open);
* ``process`` (``--process``): ``workbench record`` in a process of its own writing into the app's database
  (the two processes take turns on the DuckDB file), timed from its run's ``created_at`` to ``finished_at``.

Reported: wall time of each recording, the median decode step (``steps.wall_ms``), the slowdown
ratio under load / alone, and the clients' p50 / p95 latency per endpoint (requests that started
while a recording ran). With ``--write`` the table goes into benchmarks/RESULTS.md under
"## UI under load" (that section only).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from datetime import date
from pathlib import Path

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
SQL = "SELECT count(*) AS n FROM tokens"
SECTION = "## UI under load"


# -- HTTP client (also used by the client process) ------------------------------------------------

def call(client, base: str, name: str, data: list, timeout: float = 300.0, session: str | None = None) -> list:
    """One call of a named Gradio endpoint over plain HTTP; the last data it sent (raises on error).

    ``session``: the session hash to send, as a browser tab sends its own with every request (without
    one, Gradio makes a new session, configuration of every block included, for each request)."""
    body = {"data": data} if session is None else {"data": data, "session_hash": session}
    r = client.post(f"{base}gradio_api/call/{name}", json=body, timeout=timeout)
    r.raise_for_status()
    event_id = r.json()["event_id"]
    last, event = None, None
    with client.stream("GET", f"{base}gradio_api/call/{name}/{event_id}", timeout=timeout) as s:
        for line in s.iter_lines():
            if line.startswith("event:"):
                event = line.split(":", 1)[1].strip()
            elif line.startswith("data:"):
                payload = line.split(":", 1)[1].strip()
                if event == "error":
                    raise RuntimeError(f"{name} failed: {payload}")
                if event in ("generating", "complete"):
                    last = json.loads(payload)
                if event == "complete":
                    return last
    raise RuntimeError(f"{name}: stream ended without a result")


def _calls(run_id: str, endpoints: list[str]) -> list[tuple[str, list]]:
    data = {"tokens": [run_id], "sql": [SQL]}
    return [(e, data[e]) for e in endpoints]


def _client_loop(base: str, run_id: str, endpoints: list[str], go, stop, out: list, lock: threading.Lock,
                 k: int, sessions: bool = True) -> None:
    import uuid

    import httpx

    calls = _calls(run_id, endpoints)
    session = f"ui-load-{k}-{uuid.uuid4().hex[:8]}" if sessions else None
    with httpx.Client() as c:
        i = k
        while not stop.is_set():
            if not go.wait(0.2):
                continue
            name, data = calls[i % len(calls)]
            i += 1
            t0 = time.time()
            ok = True
            try:
                call(c, base, name, data, timeout=60, session=session)
            except Exception:  # noqa: BLE001 - counted, not fatal
                ok = False
            with lock:
                out.append((name, t0, time.time() - t0, ok))


def client_process(base: str, run_id: str, endpoints: list[str], n: int, go, stop, ready, results,
                   sessions: bool = True) -> None:
    """``n`` closed-loop clients in threads of this (separate) process, calling while ``go`` is set, each
    with a session of its own (as a browser tab has; ``sessions=False``: none, a new one per request);
    results: (endpoint, start, seconds, ok) per request."""
    import httpx  # noqa: F401 - imported before saying ready

    out: list = []
    lock = threading.Lock()
    threads = [threading.Thread(target=_client_loop,
                                args=(base, run_id, endpoints, go, stop, out, lock, k, sessions), daemon=True)
               for k in range(n)]
    for t in threads:
        t.start()
    ready.set()
    for t in threads:
        t.join()
    results.put(out)


# -- the measurement ---------------------------------------------------------------------------------

def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def machine() -> str:
    import torch
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        load = "load average %.1f at start" % os.getloadavg()[0]
    except OSError:
        load = ""
    return (f"{os.cpu_count()} CPUs ({cpu}), {load}, Python {platform.python_version()}, "
            f"torch {torch.__version__} ({torch.get_num_threads()} intra-op threads by default)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--model", choices=["demo", "tiny"], default="demo")
    ap.add_argument("--warmup", type=float, default=2.0, help="seconds of load before each loaded recording")
    ap.add_argument("--reps", type=int, default=3, help="alone / under load pairs (medians are reported)")
    ap.add_argument("--endpoints", default="tokens,sql", help="what the clients call, in turns (tokens, sql)")
    ap.add_argument("--label", default="", help="what this measurement is (goes into the table)")
    ap.add_argument("--write", action="store_true", help="append the result to RESULTS.md's '## UI under load'")
    ap.add_argument("--json", default=None, help="also write the numbers to this JSON file")
    ap.add_argument("--app", default=None, help="take build_app from this file (e.g. an older apps/app.py)")
    ap.add_argument("--sqlsafe", default=None,
                    help="take workbench.data.sqlsafe (the SQL console's sandbox) from this file (e.g. an older one)")
    ap.add_argument("--no-sessions", action="store_true",
                    help="clients send no session hash (a new Gradio session per request, as before 2026-12-01)")
    ap.add_argument("--switch-interval", type=float, default=0.0,
                    help="sys.setswitchinterval for this (the app's) process, seconds (0: Python's 0.005)")
    ap.add_argument("--process", action="store_true",
                    help="also time `workbench record` in a process of its own, writing to the app's database")
    ap.add_argument("--direct-threads", type=int, default=0,
                    help="torch intra-op threads while the 'direct' recording runs (0: torch's default)")
    args = ap.parse_args(argv)

    import httpx
    from helpers import free_port

    import workbench
    from workbench.data import query

    if args.sqlsafe:
        import importlib.util
        spec = importlib.util.spec_from_file_location("workbench.data.sqlsafe", args.sqlsafe)
        mod = importlib.util.module_from_spec(spec)
        sys.modules["workbench.data.sqlsafe"] = mod
        spec.loader.exec_module(mod)
        workbench.data.sqlsafe = mod
    if args.app:
        import importlib.util
        spec = importlib.util.spec_from_file_location("workbench.apps.app", args.app)
        mod = importlib.util.module_from_spec(spec)
        sys.modules["workbench.apps.app"] = mod
        spec.loader.exec_module(mod)
    from workbench.apps.app import build_app

    if args.switch_interval > 0:  # how long a thread that wants the GIL (the recording, after a torch op) waits
        sys.setswitchinterval(args.switch_interval)
    endpoints = [e.strip() for e in args.endpoints.split(",") if e.strip()]
    if not endpoints or set(endpoints) - {"tokens", "sql"}:
        ap.error("--endpoints: a comma-separated list of tokens, sql")
    started = time.time()
    env = machine()
    if args.model == "tiny":
        from helpers import tiny_model

        from workbench.model import load_tokenizer
        model, tok, what = tiny_model(vocab_size=4096), load_tokenizer(), "tiny random model"
    else:  # loaded once: both paths then time the recording, not the checkpoint's loading
        from workbench.model import load_checkpoint, load_tokenizer
        model, tok, what = load_checkpoint(), load_tokenizer(), "bundled demo model"
    db = Path(tempfile.mkdtemp(prefix="ui-load-")) / "wb.duckdb"
    seed = workbench.record(PROMPT, model=model, tokenizer=tok, max_new_tokens=args.new_tokens, db=db)
    store = seed.store
    app = build_app(store, model=model, tokenizer=tok)
    port = free_port()
    app.queue().launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
    base = f"http://127.0.0.1:{port}/"
    http = httpx.Client()
    session = None if args.no_sessions else f"ui-load-main-{os.getpid()}"

    def record_ui() -> tuple[float, str]:
        t0 = time.perf_counter()
        out = call(http, base, "record", [PROMPT, args.new_tokens, 0.0, 1.0, 0, ""], session=session)
        return time.perf_counter() - t0, out[2]

    def record_direct() -> tuple[float, str]:
        import torch
        before = torch.get_num_threads()
        if args.direct_threads > 0:  # what recorder.py could do while recording (as the Record tab does)
            torch.set_num_threads(args.direct_threads)
        try:
            t0 = time.perf_counter()
            r = workbench.record(PROMPT, model=model, tokenizer=tok, max_new_tokens=args.new_tokens, db=store)
            return time.perf_counter() - t0, r.run_id
        finally:
            torch.set_num_threads(before)

    def record_process() -> tuple[float, str]:
        """``workbench record`` in a process of its own (a script or notebook beside a running ``workbench ui``):
        the time its run took (runs.created_at to finished_at: the model loaded, imports done), so the
        interpreter's start-up does not dilute the ratio; the two processes take turns on the DuckDB file."""
        import subprocess
        env_ = {**os.environ, "OMP_NUM_THREADS": "1", "WORKBENCH_DB": str(db)}
        out = subprocess.run([sys.executable, "-m", "workbench.cli", "record", "--prompt", PROMPT, "--db", str(db),
                              "--max-new-tokens", str(args.new_tokens), "--json"], capture_output=True, text=True,
                             env=env_, timeout=600, cwd=str(ROOT))
        if out.returncode:
            raise RuntimeError(f"workbench record failed: {out.stderr[-2000:]}")
        rid = json.loads(out.stdout.strip().splitlines()[-1])["run_id"]
        info = query.run_row(store, rid)
        return (info["finished_at"] - info["created_at"]).total_seconds(), rid

    def step_ms(rid: str) -> float:
        s = query.steps(store, rid)
        return statistics.median(s.filter(s["step"] > 0)["wall_ms"].to_list())

    paths_to_time = [("ui", record_ui), ("direct", record_direct)] + ([("process", record_process)]
                                                                     if args.process else [])
    # warm both paths (the Record tab loads its model once)
    record_ui()
    record_direct()
    # UI latency with one client, nothing else running
    lat1: dict[str, list[float]] = {"tokens": [], "sql": []}
    for i in range(20):
        name, data = _calls(seed.run_id, ["tokens", "sql"])[i % 2]
        t0 = time.perf_counter()
        call(http, base, name, data, session=session)
        lat1[name].append(time.perf_counter() - t0)

    ctx = mp.get_context("spawn")
    go, stop, ready, results = ctx.Event(), ctx.Event(), ctx.Event(), ctx.Queue()
    proc = ctx.Process(target=client_process, args=(base, seed.run_id, endpoints, args.clients, go, stop, ready,
                                                    results, not args.no_sessions), daemon=True)
    proc.start()
    if not ready.wait(120):
        raise RuntimeError("the client process did not start")
    # alone and under load in turns, so that a shared machine's drifts hit both alike
    runs: list[dict] = []
    windows: list[tuple[float, float]] = []
    for _ in range(args.reps):
        one: dict = {}
        for how, fn in paths_to_time:
            s, rid = fn()
            one[how] = {"alone": (s, step_ms(rid))}
        go.set()
        time.sleep(args.warmup)
        for how, fn in paths_to_time:
            t0 = time.time()
            s, rid = fn()
            windows.append((t0, time.time()))
            one[how]["loaded"] = (s, step_ms(rid))
        go.clear()
        time.sleep(1.0)  # the clients' requests in flight finish
        runs.append(one)
    stop.set()
    samples = results.get(timeout=120)
    proc.join(timeout=30)
    app.close()

    during = [x for x in samples if any(a <= x[1] <= b for a, b in windows)]
    lat = {name: [x[2] for x in during if x[0] == name and x[3]] for name in ("tokens", "sql")}
    failed = sum(1 for x in during if not x[3])
    med = lambda xs: statistics.median(xs)  # noqa: E731
    paths = {}
    for how, _ in paths_to_time:
        paths[how] = {
            "alone": (med([r[how]["alone"][0] for r in runs]), med([r[how]["alone"][1] for r in runs])),
            "loaded": (med([r[how]["loaded"][0] for r in runs]), med([r[how]["loaded"][1] for r in runs])),
            "ratio": med([r[how]["loaded"][0] / r[how]["alone"][0] for r in runs]),
            "ratios": [round(r[how]["loaded"][0] / r[how]["alone"][0], 2) for r in runs],
        }
    res = {
        "date": date.today().isoformat(), "machine": env, "model": what, "new_tokens": args.new_tokens,
        "clients": args.clients, "endpoints": endpoints, "label": args.label, "reps": args.reps, "paths": paths,
        "sqlsafe": args.sqlsafe or "workbench/data/sqlsafe.py", "sessions": not args.no_sessions,
        "direct_threads": args.direct_threads or None, "switch_interval": sys.getswitchinterval(),
        "runs": runs,
        "latency_one_client": {n: (pct(v, 0.5), pct(v, 0.95)) for n, v in lat1.items()},
        "latency": {n: (pct(v, 0.5), pct(v, 0.95), len(v)) for n, v in lat.items()},
        "failed": failed, "elapsed_s": time.time() - started,
    }
    print(json.dumps(res, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    if args.write:
        write(res)
    return 0


def rows(res: dict) -> str:
    """One table row per recording path."""
    def lat(name: str) -> str:
        p50, p95, n = res["latency"][name]
        return f"{p50 * 1e3:.0f} / {p95 * 1e3:.0f} ms ({n})" if n else "-"

    out = []
    for how in res["paths"]:
        p = res["paths"][how]
        a, lo = p["alone"], p["loaded"]
        out.append(f"| {res['date']} | {res['label'] or '-'} | {res['clients']} x {'+'.join(res['endpoints'])} | "
                   f"{how} | {a[0]:.2f} s ({a[1]:.1f} ms/step) | {lo[0]:.2f} s ({lo[1]:.1f} ms/step) | "
                   f"**{p['ratio']:.2f}x** ({', '.join(f'{r:.2f}' for r in p['ratios'])}) | "
                   f"{lat('tokens')} | {lat('sql')} |")
    return "\n".join(out)


HEADER = ("| date | build | clients | recording via | alone | with the clients | slowdown (per rep) | "
          "`/tokens` p50 / p95 (n) | `/sql` p50 / p95 (n) |\n|---|---|---|---|---|---|---|---|---|")


def write(res: dict) -> None:
    """Add this measurement's rows to the "## UI under load" section (created at the end if absent)."""
    path = ROOT / "benchmarks" / "RESULTS.md"
    text = path.read_text()
    one = res["latency_one_client"]
    note = (f"- {res['date']}, {res['label'] or 'this build'}: {res['machine']}; {res['model']}, "
            f"{res['new_tokens']} new tokens, {res['clients']} clients; one client alone: `/tokens` p50 "
            f"{one['tokens'][0] * 1e3:.0f} ms, `/sql` p50 {one['sql'][0] * 1e3:.0f} ms; failed requests: {res['failed']}.")
    if SECTION not in text:
        intro = (f"\n{SECTION}\n\n`benchmarks/ui_load.py`: {__doc__.split(chr(10) + chr(10), 2)[1].strip()}\n\n"
                 "Target: with 8 clients, the recording slows by at most 2x and the UI's p95 stays under 500 ms.\n\n"
                 f"{HEADER}\n{rows(res)}\n\n{note}\n")
        path.write_text(text.rstrip("\n") + "\n" + intro)
        return
    head, rest = text.split(SECTION, 1)
    nxt = rest.find("\n## ")
    body, tail = (rest, "") if nxt < 0 else (rest[:nxt], rest[nxt:])
    lines = body.rstrip("\n").split("\n")
    last_row = max(i for i, ln in enumerate(lines) if ln.startswith("| "))
    lines.insert(last_row + 1, rows(res))
    body = "\n".join(lines) + "\n" + note + "\n"
    path.write_text(head + SECTION + body + tail)


if __name__ == "__main__":
    raise SystemExit(main())
