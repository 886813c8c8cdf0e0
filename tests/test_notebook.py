"""examples/quickstart.ipynb runs clean, headless (nbclient, the venv's python3 kernel), on a tmp database."""
from __future__ import annotations

from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "examples" / "quickstart.ipynb"


def test_quickstart_notebook_runs_clean(tmp_path, monkeypatch):
    db = tmp_path / "nb.duckdb"
    # the kernel inherits the environment: a tmp database, few tokens
    monkeypatch.setenv("WORKBENCH_DB", str(db))
    monkeypatch.setenv("QUICKSTART_MAX_NEW_TOKENS", "8")
    monkeypatch.setenv("GRADIO_ANALYTICS_ENABLED", "False")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    # "python" in the kernelspec is replaced by this interpreter (the venv's) when the kernel starts
    client = NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}})
    client.execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert errors == []
    # every figure cell produced a plotly figure with data; the run landed in the tmp database
    plotly = [o for c in nb.cells if c.cell_type == "code" and "fig_" in c.source for o in c.outputs
              if "application/vnd.plotly.v1+json" in o.get("data", {})]
    assert len(plotly) == sum("fig_" in c.source for c in nb.cells if c.cell_type == "code")
    assert any(o["data"]["application/vnd.plotly.v1+json"]["data"] for o in plotly)
    import workbench
    runs = workbench.open(db).runs()
    assert runs.height == 1 and runs["status"][0] == "complete"
