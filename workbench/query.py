"""The query layer: every read of the store goes through here and comes back as a polars frame.

The Gradio app, the notebook API and the reports all call these functions, so they show the same
numbers. No front end writes SQL of its own.
"""
from __future__ import annotations

import polars as pl

from .store import Store


class RunNotFound(KeyError):
    """No run with that id in the database."""

    def __str__(self) -> str:
        return str(self.args[0])


def runs(store: Store) -> pl.DataFrame:
    """All runs, newest first, with their length and anomaly count."""
    return store.sql("""
        SELECT r.run_id, r.created_at, r.status, r.model, r.dtype, r.prompt, r.seed, r.parent_run_id,
               r.n_prompt_tokens, coalesce(t.n, 0) AS n_tokens, coalesce(a.n, 0) AS n_anomalies, r.error
        FROM runs r
        LEFT JOIN (SELECT run_id, count(*) AS n FROM tokens GROUP BY run_id) t USING (run_id)
        LEFT JOIN (SELECT run_id, count(*) AS n FROM anomalies GROUP BY run_id) a USING (run_id)
        ORDER BY r.created_at DESC, r.run_id""")


def run_row(store: Store, run_id: str) -> dict:
    """The run's ``runs`` row as a dict; ``RunNotFound`` with a clear message if absent."""
    df = store.sql("SELECT * FROM runs WHERE run_id = ?", [run_id])
    if df.height == 0:
        known = store.sql("SELECT run_id FROM runs ORDER BY created_at DESC LIMIT 5")["run_id"].to_list()
        hint = f"; recent runs: {', '.join(known)}" if known else "; the database has no runs yet"
        raise RunNotFound(f"no run {run_id!r} in {store.path}{hint}")
    return df.row(0, named=True)


def table(store: Store, name: str, run_id: str, order: str) -> pl.DataFrame:
    """All rows of one run from a signal table, ordered."""
    return store.sql(f"SELECT * EXCLUDE (run_id) FROM {name} WHERE run_id = ? ORDER BY {order}", [run_id])


def tokens(store: Store, run_id: str) -> pl.DataFrame:
    return table(store, "tokens", run_id, "pos")


def attention(store: Store, run_id: str) -> pl.DataFrame:
    return table(store, "attention", run_id, "pos, layer, head")


def routing(store: Store, run_id: str) -> pl.DataFrame:
    return table(store, "routing", run_id, "pos, layer, slot")


def kv(store: Store, run_id: str) -> pl.DataFrame:
    return table(store, "kv", run_id, "step, layer")


def kv_tokens(store: Store, run_id: str) -> pl.DataFrame:
    return table(store, "kv_tokens", run_id, "step, layer, pos")


def steps(store: Store, run_id: str) -> pl.DataFrame:
    return table(store, "steps", run_id, "step")


def anomalies(store: Store, run_id: str) -> pl.DataFrame:
    return store.sql("""SELECT * EXCLUDE (run_id) FROM anomalies WHERE run_id = ?
                        ORDER BY CASE severity WHEN 'critical' THEN 0 WHEN 'warning' THEN 1 ELSE 2 END,
                                 score DESC, anomaly_id""", [run_id])


def attributions(store: Store, run_id: str, target_pos: int | None = None) -> pl.DataFrame:
    if target_pos is None:
        return table(store, "attributions", run_id, "target_pos, rank")
    return store.sql("SELECT * EXCLUDE (run_id) FROM attributions WHERE run_id = ? AND target_pos = ? "
                     "ORDER BY rank", [run_id, target_pos])


def token_heads(store: Store, run_id: str, pos: int) -> pl.DataFrame:
    """Entropy per layer x head at one query position."""
    return store.sql("SELECT layer, head, entropy, norm_entropy, max_weight, sink_weight FROM attention "
                     "WHERE run_id = ? AND pos = ? ORDER BY layer, head", [run_id, pos])


def token_routing(store: Store, run_id: str, pos: int) -> pl.DataFrame:
    return store.sql("SELECT layer, slot, expert, weight, score, margin FROM routing "
                     "WHERE run_id = ? AND pos = ? ORDER BY layer, slot", [run_id, pos])


def head_entropy(store: Store, run_id: str) -> pl.DataFrame:
    """Mean entropy per layer x head over the run's query positions (pos 0 excluded)."""
    return store.sql("SELECT layer, head, avg(entropy) AS entropy, avg(norm_entropy) AS norm_entropy, "
                     "avg(sink_weight) AS sink_weight FROM attention WHERE run_id = ? AND pos > 0 "
                     "GROUP BY layer, head ORDER BY layer, head", [run_id])


def expert_load(store: Store, run_id: str) -> pl.DataFrame:
    """Share of routed slots per expert per MoE layer (sums to 1 per layer)."""
    return store.sql("""SELECT layer, expert, count(*) AS slots,
                               count(*) / sum(count(*)) OVER (PARTITION BY layer) AS share
                        FROM routing WHERE run_id = ? GROUP BY layer, expert ORDER BY layer, expert""", [run_id])


def coactivation(store: Store, run_id: str, layer: int) -> pl.DataFrame:
    """How often each pair of experts is chosen for the same token in a layer (a, b, count)."""
    return store.sql("""SELECT a.expert AS a, b.expert AS b, count(*) AS count
                        FROM routing a JOIN routing b
                          ON a.run_id = b.run_id AND a.pos = b.pos AND a.layer = b.layer AND a.slot <> b.slot
                        WHERE a.run_id = ? AND a.layer = ? GROUP BY a.expert, b.expert ORDER BY a, b""",
                     [run_id, layer])


def load_along_run(store: Store, run_id: str, layer: int, window: int = 16) -> pl.DataFrame:
    """Per expert, its share of slots in consecutive windows of positions."""
    # the window is computed once in a subquery: a parameter repeated in GROUP BY would not match the SELECT
    return store.sql("""SELECT window_start, expert, count(*) AS slots,
                               count(*) / sum(count(*)) OVER (PARTITION BY window_start) AS share
                        FROM (SELECT pos // $w * $w AS window_start, expert FROM routing
                              WHERE run_id = $run AND layer = $layer)
                        GROUP BY window_start, expert ORDER BY window_start, expert""",
                     {"w": window, "run": run_id, "layer": layer})
