"""Small builders the test files share (imported as ``helpers``: pytest puts tests/ on sys.path)."""
from __future__ import annotations

import atexit
import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path

import pytest

from workbench.model import ModelArgs, Transformer


def tiny_model(seed: int = 1, **overrides) -> Transformer:
    """The ``tiny`` preset with random weights (std 0.1), in eval mode; ``overrides`` replace ModelArgs fields."""
    args = dataclasses.replace(ModelArgs.preset("tiny"), **overrides)
    return Transformer(args).init_weights(seed=seed, std=0.1).eval()


CHROMIUM = "/usr/bin/chromium"  # Debian's chromium (apt-get install chromium chromium-driver); never `playwright install`
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run"]
XSS = "<img src=x onerror=alert(1)>"  # a hostile string where a token's or a run's text would be shown
# the marks of a test that drives Chromium (a module's ``pytestmark``): skipped, with the reason, where Debian's
# chromium is not installed
BROWSER_MARKS = [pytest.mark.browser,
                 pytest.mark.skipif(shutil.which(CHROMIUM) is None and not Path(CHROMIUM).exists(),
                                    reason=f"Debian chromium not installed at {CHROMIUM} (apt-get install chromium)")]


def needs_chromium(test):
    """Decorator: ``BROWSER_MARKS`` on one test."""
    for mark in reversed(BROWSER_MARKS):
        test = mark(test)
    return test


@contextmanager
def served(app):
    """Launch a built Gradio app on a free 127.0.0.1 port; yield its URL; close it after."""
    port = free_port()
    app.queue().launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
    try:
        yield f"http://127.0.0.1:{port}/"
    finally:
        app.close()


@contextmanager
def chromium_page(width: int = 1400, height: int = 1600):
    """A headless Chromium page; every ``alert()`` a page would run is kept in ``window.__alerts`` instead."""
    from playwright.sync_api import sync_playwright  # lazy: only the browser tests need playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        try:
            pg = b.new_page(viewport={"width": width, "height": height})
            pg.add_init_script("window.__alerts = []; window.alert = (m) => window.__alerts.push(String(m));")
            yield pg
        finally:
            b.close()


def open_tab(pg, name: str) -> None:
    """Click the tab ``name``: in the tab row, or in Gradio's "More tabs" menu where the row has no room for it
    (at 1400 px the last tabs are there)."""
    tab = pg.get_by_role("tab", name=name)
    if tab.count() and tab.first.is_visible():
        tab.first.click()
        return
    pg.get_by_label("More tabs").click()
    pg.locator(".overflow-dropdown button", has_text=name).first.click()


def wait_text(pg, selector: str, text: str, timeout: int = 30_000) -> None:
    """Wait until the element ``selector`` shows ``text`` (its innerText contains it)."""
    pg.wait_for_function(f"() => (document.querySelector({selector!r})?.innerText || '').includes({text!r})",
                         timeout=timeout)


def fill(pg, selector: str, text: str, tries: int = 5) -> None:
    """Fill the input ``selector`` and make sure it holds ``text`` a moment later: a component Gradio has just
    mounted (a tab or panel shown by the last click) can be reset to its initial value by its first props after a
    fill (seen in CI: an Interventions layer typed as 1 was sent as 0)."""
    loc = pg.locator(selector).first
    for _ in range(tries):
        loc.fill(text)
        loc.dispatch_event("change")
        pg.wait_for_timeout(300)
        if loc.input_value() == text:
            return
    raise AssertionError(f"{selector} does not keep {text!r} (holds {loc.input_value()!r})")


def wait_plot(pg, elem_id: str, traces: int | None = None, timeout: int = 30_000) -> None:
    """Wait until the plotly plot inside ``#elem_id`` has data (``traces`` of them when given)."""
    cond = "p.data.length > 0" if traces is None else f"p.data.length === {traces}"
    pg.wait_for_function(f"() => {{ const p = document.querySelector('#{elem_id} .js-plotly-plot'); "
                         f"return p && p.data && {cond}; }}", timeout=timeout)


# The Python process that runs ``run_interpreted``'s scripts: each script execs in a fresh namespace there, and
# the result comes back as one line after MARK (torch and Triton are imported once a session, not once a script).
_INTERPRETER_MARK = "\x00run_interpreted:"
_INTERPRETER = r"""
import contextlib, io, json, sys, traceback
out = sys.stdout
sys.stdout = sys.stderr  # nothing but the result lines on the pipe
for line in sys.stdin:
    buf, err, ok = io.StringIO(), io.StringIO(), True
    try:
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(err):
            exec(compile(json.loads(line), "<run_interpreted>", "exec"), {"__name__": "__main__"})
    except BaseException:  # SystemExit included: a script ends by falling off its end
        ok = False
        err.write(traceback.format_exc())
    out.write(MARK + json.dumps({"ok": ok, "stdout": buf.getvalue(), "stderr": err.getvalue()}) + "\n")
    out.flush()
"""
_interpreter: dict = {}


def _interpreter_process() -> subprocess.Popen:
    proc = _interpreter.get("proc")
    if proc is None or proc.poll() is not None:
        log = tempfile.TemporaryFile(mode="w+")  # the process's own stderr (warnings): read back on a crash
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        proc = subprocess.Popen([sys.executable, "-c", f"MARK = {_INTERPRETER_MARK!r}\n" + _INTERPRETER],
                                env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
                                cwd=Path(__file__).resolve().parent.parent)
        _interpreter.update(proc=proc, log=log)
        atexit.register(proc.kill)
    return proc


def run_interpreted(script: str, timeout: float = 600) -> None:
    """Run ``script`` in a Python process with ``TRITON_INTERPRET=1`` (Triton kernels on the CPU), started from the
    repository root: it must end without an exception and print ``ok`` last. The process is started once and
    reused (each script in a fresh namespace), so torch and Triton are imported once for every interpreted test."""
    proc = _interpreter_process()
    proc.stdin.write(json.dumps(script) + "\n")
    proc.stdin.flush()
    lines: list[str] = []

    def read() -> None:  # up to the result line (a line written below Python's sys.stdout is passed over)
        for line in proc.stdout:
            if line.startswith(_INTERPRETER_MARK):
                lines.append(line)
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout)
    if not lines:  # timed out, or the process ended: what it wrote to stderr says why
        why = f"timed out after {timeout} s" if reader.is_alive() else f"ended its process ({proc.wait()})"
        proc.kill()
        proc.wait()
        log = _interpreter["log"]
        log.seek(0)
        pytest.fail(f"the interpreted script {why}: {log.read()[-3000:]}")
    line = lines[0]
    got = json.loads(line[len(_INTERPRETER_MARK):])
    assert got["ok"], got["stderr"][-3000:]
    assert got["stdout"].strip().endswith("ok")


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
