"""The README's Python snippets run as written, in order, as a newcomer would paste them (one session)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def snippets() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)


def test_readme_has_the_snippets_a_newcomer_needs():
    text = "\n".join(snippets())
    for needle in ("load_checkpoint()", "attach(model", "workbench.record(", "run.root_cause(", "make_folder("):
        assert needle in text, needle


@pytest.mark.slow
def test_readme_python_snippets_run_in_order(tmp_path):
    pytest.importorskip("transformers")
    if not (ROOT / "data" / "demo" / "model.safetensors").exists():
        pytest.skip("the bundled demo checkpoint is not here")
    script = "\n\n".join(snippets())
    # run from the repository root, as the README's commands are, but into a database of this test
    env = {**os.environ, "WORKBENCH_DB": str(tmp_path / "readme.duckdb"), "GRADIO_ANALYTICS_ENABLED": "False"}
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    (ROOT / "report.html").unlink(missing_ok=True)
