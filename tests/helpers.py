"""Small builders the test files share (imported as ``helpers``: pytest puts tests/ on sys.path)."""
from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import sys
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


def wait_plot(pg, elem_id: str, traces: int | None = None, timeout: int = 30_000) -> None:
    """Wait until the plotly plot inside ``#elem_id`` has data (``traces`` of them when given)."""
    cond = "p.data.length > 0" if traces is None else f"p.data.length === {traces}"
    pg.wait_for_function(f"() => {{ const p = document.querySelector('#{elem_id} .js-plotly-plot'); "
                         f"return p && p.data && {cond}; }}", timeout=timeout)


def run_interpreted(script: str) -> None:
    """Run ``python -c script`` from the repository root with ``TRITON_INTERPRET=1`` (Triton kernels on the CPU);
    it must exit 0 and print ``ok`` last."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600,
                         cwd=Path(__file__).resolve().parent.parent)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")


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
