"""The README's Python snippets run as written, in order, as a newcomer would paste them (one session)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def snippets() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)


def test_readme_has_the_snippets_a_newcomer_needs():
    text = "\n".join(snippets())
    for needle in ("load_checkpoint()", "attach(model", "workbench.record(", "run.root_cause(", "make_folder("):
        assert needle in text, needle


@pytest.mark.slow
def test_readme_python_snippets_run_in_order(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    if not (ROOT / "data" / "demo" / "model.safetensors").exists():
        pytest.skip("the bundled demo checkpoint is not here")
    script = "\n\n".join(snippets())
    # one session's namespace, from the repository root (as the README's commands are), but into a database of this
    # test; in this process (a fresh interpreter only added the imports' seconds: torch, transformers, workbench)
    monkeypatch.setenv("WORKBENCH_DB", str(tmp_path / "readme.duckdb"))
    monkeypatch.setenv("GRADIO_ANALYTICS_ENABLED", "False")
    monkeypatch.chdir(ROOT)
    try:
        with torch.random.fork_rng():  # the tests after this one draw from the generator as before
            exec(compile(script, "<README.md python snippets>", "exec"), {"__name__": "__main__"})
    finally:
        (ROOT / "report.html").unlink(missing_ok=True)
