"""The SQL tab: one read-only SELECT over the store (``workbench.data.sqlsafe``)."""
from __future__ import annotations

from functools import partial

import gradio as gr

from workbench.apps.shared import SQL, AppContext, Page, empty_table
from workbench.data.sqlsafe import UI_MAX_CELL_CHARS, UI_MAX_RESULT_BYTES, SqlError, run_readonly
from workbench.views.markup import md_plain

DEFAULT_SQL = "SELECT run_id, status, n_tokens, prompt FROM runs ORDER BY created_at DESC"


def sql(app: AppContext, text: str):
    """The rows (at most 1000, 1 MB, text cells of 2000 characters) and a message that says what was cut; a refused
    or failing query says why, as text."""
    try:
        r = run_readonly(app.store, text, max_cell_chars=UI_MAX_CELL_CHARS, max_result_bytes=UI_MAX_RESULT_BYTES)
    except SqlError as e:  # DuckDB's message quotes the data (a token's text, say): text only
        return empty_table(["rows"]), f"⚠️ {md_plain(e)}"
    note = " (cut at the row limit)" if r.truncated else ""
    if r.note:
        note += f"  \n⚠️ {md_plain(r.note)}"
    return r.frame, f"{r.frame.height} rows in {r.elapsed_ms:.0f} ms{note}"


def build(session: Page) -> None:
    with gr.Tab("SQL", id="sql"):
        gr.Markdown("Read-only SQL over the store: one SELECT over the workbench tables; no writes, no file or "
                    "network access; 1000 rows, 1 MB and 5 s at most, text cells cut at 2000 characters.")
        text = gr.Code(value=DEFAULT_SQL, language="sql", label="Query", interactive=True, elem_id="sql-text")
        btn = gr.Button("Run query", elem_id="sql-run")
        msg = gr.Markdown(latex_delimiters=[], elem_classes=["wb-message"], elem_id="sql-msg")
        out = gr.Dataframe(interactive=False, label="Rows", wrap=True, elem_id="sql-rows", datatype="str",
                           value=[["(run a query)"]], headers=["rows"])
    btn.click(partial(sql, session.app), text, [out, msg], api_name="sql", **SQL)
