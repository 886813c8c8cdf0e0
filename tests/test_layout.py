"""The rooms hold (docs/architecture.md): reading needs no torch, imports sit at the top of modules, no module
below the facade imports the root package, and every room is where the architecture page says."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import workbench
from helpers import tiny_model
from workbench.data.store import Store

ROOT = Path(__file__).resolve().parent.parent
ROOMS = ("data", "capture", "analysis", "views")


def _python(code: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=300)


def test_the_data_room_imports_no_torch(tmp_path):
    got = _python("import sys, workbench.data.store, workbench.data.query, workbench.data.export, "
                  "workbench.data.sqlsafe, workbench.data.schema\n"
                  "assert 'torch' not in sys.modules, 'torch'\nprint('ok')", tmp_path)
    assert got.returncode == 0 and got.stdout.strip() == "ok", got.stderr


def test_reading_a_stored_run_and_its_report_need_no_torch(tmp_path):
    db = tmp_path / "w.duckdb"
    run = workbench.record([5, 6, 7, 8], model=tiny_model(), max_new_tokens=4, db=Store(db))
    want = run.tokens()["token_id"].to_list()
    run.store.close()
    code = (f"import sys, workbench\n"
            f"run = workbench.open({str(db)!r}).run({run.run_id!r})\n"
            f"ids = run.tokens()['token_id'].to_list()\n"
            f"run.attention(); run.routing(); run.anomalies(); run.findings()\n"
            f"html = run.report({str(tmp_path / 'r.html')!r})\n"
            f"assert 'torch' not in sys.modules, 'torch was imported'\n"
            f"print(ids)")
    got = _python(code, tmp_path)
    assert got.returncode == 0, got.stderr
    assert got.stdout.strip() == str(want)
    assert (tmp_path / "r.html").stat().st_size > 1000


def _modules() -> list[Path]:
    return sorted(p for folder in (ROOT / "workbench", ROOT / "apps") for p in folder.rglob("*.py"))


def test_imports_sit_at_the_top_of_modules():
    """A function-level import is allowed only with its reason on its line (`# lazy: ...`, `# optional: ...`)."""
    bad = []
    for path in _modules():
        src = path.read_text()
        lines = src.splitlines()
        tree = ast.parse(src)
        top = {id(n) for n in tree.body}
        guarded = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and any(k in ast.unparse(node.test) for k in ("TYPE_CHECKING", "__package__", "__name__"))
                   for n in ast.walk(node)}
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in top | guarded:
                line = lines[node.lineno - 1]
                if "# lazy:" not in line and "# optional:" not in line:
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: {line.strip()}")
    assert not bad, "function-level imports without a reason:\n" + "\n".join(bad)


def test_no_room_imports_the_root_package():
    """import-linter reads `import workbench.model` as an import of the root package and is told to ignore those
    (pyproject.toml); so no module of a room may import the root package for anything else."""
    bad = []
    for room in ROOMS:
        for path in sorted((ROOT / "workbench" / room).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module == "workbench" and node.level == 0:
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno}")
                if isinstance(node, ast.Import) and any(a.name == "workbench" for a in node.names):
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not bad, bad


def test_every_room_named_on_the_architecture_page_exists():
    page = (ROOT / "docs" / "architecture.md").read_text()
    for room in ROOMS:
        assert (ROOT / "workbench" / room / "__init__.py").exists()
        assert f"workbench/{room}/" in page
    assert (ROOT / "apps" / "tabs").is_dir() and "apps/tabs/" in page
    assert "docs/architecture.md" in (ROOT / "README.md").read_text()
