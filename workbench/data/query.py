"""The query layer: every read of the store goes through here and comes back as a polars frame.

The Gradio app, the notebook API and the reports all call these functions, so they show the same
numbers. No front end writes SQL of its own.
"""
from __future__ import annotations

import bisect
import json
import operator
import re
import threading

import polars as pl

from workbench.data.schema import columns
from workbench.data.signals import TABLES as SIGNAL_TABLES
from workbench.data.store import FINAL_STATUSES, Store
from workbench.data.summary import ModelSummary


def as_position(value, what: str = "pos") -> int:
    """``value`` as a plain int (a Python, NumPy or torch integer: what ``run.tokens()["pos"]`` hands out), or a
    ValueError naming ``what`` (a bool, a float or a string is no position)."""
    if isinstance(value, bool):
        raise ValueError(f"{what} must be an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{what} must be an integer, got {value!r}") from None


class RunNotFound(KeyError):
    """No run with that id in the database."""

    def __str__(self) -> str:
        return str(self.args[0])


# -- a finished run's rowid range per signal table ------------------------------------------------
# Rows are appended run by run, so a run's rows of a signal table sit in one narrow range of DuckDB rowids.
# Run ids are random, so the row groups' min/max of run_id prune nothing and ``WHERE run_id = ?`` reads every
# row group (24M attention rows for 1M tokens: ~100-300 ms a query); ``rowid BETWEEN lo AND hi`` prunes to the
# run's few row groups. The ranges come from one scan per table per process (later only the rows appended
# since), are kept for runs that had finished before that scan (their rows no longer change), and are checked
# on every use: the range must hold the run's row count and the rows just outside it must be another run's,
# else (rows deleted, rowids moved by a vacuum, the file made anew) the plain filter is used and the table
# rescanned. Running runs always use the plain filter.

class _Ranges:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        self.ranges: dict[str, tuple[int, int, int]] = {}  # run_id -> (first rowid, last rowid, rows)
        self.seen: set[str] = set()  # runs with rows in the scanned part (ranged or not)
        self.seen_max, self.rows_seen = -1, 0  # rowids 0..seen_max scanned: rows_seen rows


_RANGES: dict[tuple[str, str], _Ranges] = {}
_RANGES_LOCK = threading.Lock()
_FINAL_SQL = "(" + ", ".join(f"'{s}'" for s in FINAL_STATUSES) + ")"


def _scan_ranges(store: Store, table: str, st: _Ranges) -> None:
    """Add the ranges of the rows appended since the last scan (all rows if the scanned part changed)."""
    final = {r[0] for r in store.execute(f"SELECT run_id FROM runs WHERE status IN {_FINAL_SQL}")}
    if st.seen_max >= 0 and store.execute(f"SELECT count(*) FROM {table} WHERE rowid <= {st.seen_max}")[0][0] \
            != st.rows_seen:
        st.reset()  # rows deleted (or moved) in the scanned part
    for rid, lo, hi, n in store.execute(f"SELECT run_id, min(rowid), max(rowid), count(*) FROM {table} "
                                        f"WHERE rowid > {st.seen_max} GROUP BY run_id"):
        st.rows_seen += n
        st.seen_max = max(st.seen_max, hi)
        if rid in st.seen:  # rows on both sides of an earlier scan: it was being written then
            st.ranges.pop(rid, None)
        elif rid in final:
            st.ranges[rid] = (lo, hi, n)
        st.seen.add(rid)
    for rid in final - st.seen:
        st.ranges.setdefault(rid, (0, -1, 0))  # finished with no rows in this table


def _rows(store: Store, table: str, run_id: str, alias: str = "") -> str:
    """SQL to put before ``run_id = ?``: ``rowid BETWEEN lo AND hi AND `` for a finished run's rows of a
    signal table (``alias``: the table's alias in the query), else nothing."""
    if table not in SIGNAL_TABLES or getattr(store, "read_only", False):  # read-only shard stores: views, no rowid
        return ""
    with _RANGES_LOCK:
        st = _RANGES.setdefault((str(store.path), table), _Ranges())
    with st.lock:
        r = st.ranges.get(run_id)
        if r is None:
            status = store.execute("SELECT status FROM runs WHERE run_id = ?", [run_id])
            if not status or status[0][0] not in FINAL_STATUSES:
                return ""
            if run_id in st.seen:  # seen while it was still running: rescan everything
                st.reset()
            _scan_ranges(store, table, st)
            r = st.ranges.get(run_id)
            if r is None:
                return ""
        lo, hi, n = r
        if n:  # the range must hold the run's rows and its neighbours none (a file made anew at the same path)
            inside, beside = store.execute(
                f"SELECT count(*) FILTER (WHERE rowid BETWEEN {lo} AND {hi}), count(*) FILTER (WHERE rowid IN "
                f"({lo - 1}, {hi + 1})) FROM {table} WHERE rowid BETWEEN {lo - 1} AND {hi + 1} AND run_id = ?",
                [run_id])[0]
            if inside != n or beside:
                st.reset()  # stale: the next use rescans
                return ""
    col = f"{alias}.rowid" if alias else "rowid"
    return f"{col} BETWEEN {int(lo)} AND {int(hi)} AND "


def runs(store: Store) -> pl.DataFrame:
    """All runs, newest first, with their length and anomaly count."""
    return store.sql("""
        SELECT r.run_id, r.created_at, r.status, r.model, r.dtype, r.prompt, r.seed, r.parent_run_id,
               r.n_prompt_tokens, coalesce(t.n, r.n_tokens, 0) AS n_tokens, coalesce(a.n, 0) AS n_anomalies, r.error
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


def _select(name: str, cols: list[str] | None) -> str:
    """The SELECT list of a signal table read: every column but run_id, or ``cols`` (checked against the schema)."""
    if cols is None:
        return "* EXCLUDE (run_id)"
    bad = [c for c in cols if c not in columns(name)]
    if bad:
        raise ValueError(f"{name} has no column(s) {bad}")
    return ", ".join(dict.fromkeys(cols))


def table(store: Store, name: str, run_id: str, order: str, cols: list[str] | None = None) -> pl.DataFrame:
    """All rows of one run from a signal table, ordered: every column but run_id, or ``cols``
    (names from the schema, never user text)."""
    return store.sql(f"SELECT {_select(name, cols)} FROM {name} WHERE {_rows(store, name, run_id)}run_id = ? "
                     f"ORDER BY {order}", [run_id])


def table_pair(store: Store, name: str, a: str, b: str, order: str, cols: list[str]) -> tuple[pl.DataFrame, pl.DataFrame]:
    """``table`` for two runs in one round trip (each run's rows pruned to its own rowid range): (a's, b's)."""
    what = _select(name, cols)
    both = store.sql(f"SELECT * FROM (SELECT 0 AS _side, {what} FROM {name} WHERE {_rows(store, name, a)}run_id = ? "
                     f"UNION ALL SELECT 1 AS _side, {what} FROM {name} WHERE {_rows(store, name, b)}run_id = ?) "
                     f"ORDER BY _side, {order}", [a, b])
    return (both.filter(pl.col("_side") == 0).drop("_side"), both.filter(pl.col("_side") == 1).drop("_side"))


def signal(store: Store, name: str, run_id: str) -> pl.DataFrame:
    """All rows of one run from a registry signal table, in the table's order."""
    if name not in SIGNAL_TABLES:
        raise ValueError(f"no signal table {name!r}; signal tables: {', '.join(SIGNAL_TABLES)}")
    return table(store, name, run_id, SIGNAL_TABLES[name].order)


def tokens(store: Store, run_id: str) -> pl.DataFrame:
    return signal(store, "tokens", run_id)


def attention(store: Store, run_id: str) -> pl.DataFrame:
    return signal(store, "attention", run_id)


def routing(store: Store, run_id: str) -> pl.DataFrame:
    return signal(store, "routing", run_id)


def kv(store: Store, run_id: str) -> pl.DataFrame:
    return signal(store, "kv", run_id)


def kv_tokens(store: Store, run_id: str) -> pl.DataFrame:
    return signal(store, "kv_tokens", run_id)


def steps(store: Store, run_id: str) -> pl.DataFrame:
    return signal(store, "steps", run_id)


def model_summary(info: dict) -> ModelSummary:
    """A run's neutral model summary (from ``runs.summary``; rebuilt from ``ModelArgs`` for runs recorded
    before summaries were stored)."""
    if info.get("summary"):
        return ModelSummary.from_dict(json.loads(info["summary"]))
    c = json.loads(info.get("config") or "{}")
    n_layers, dense = int(c.get("n_layers", 0)), int(c.get("n_dense_layers", 0))
    moe = list(range(dense, n_layers)) if c.get("n_routed_experts") else []
    return ModelSummary(family="deepseek_v3", backend="native", n_layers=n_layers, n_heads=int(c.get("n_heads", 0)),
                        n_kv_heads=1, vocab_size=int(c.get("vocab_size", 0)), max_seq_len=int(c.get("max_seq_len", 0)),
                        moe_layers=moe, n_routed_experts=int(c.get("n_routed_experts", 0)) if moe else 0,
                        n_shared_experts=int(c.get("n_shared_experts", 0)) if moe else 0,
                        top_k=int(c.get("n_activated_experts", 0)) if moe else 0, selection_bias=bool(moe))


def profile(store: Store, sha: str) -> pl.DataFrame:
    """A model's baseline profile rows (workbench/baseline.py), empty when it has none."""
    return store.sql("SELECT * EXCLUDE (checkpoint_sha256) FROM profiles WHERE checkpoint_sha256 = ? "
                     "ORDER BY signal, layer, head, expert, bucket", [sha])


def activation_profile(store: Store, sha: str) -> pl.DataFrame:
    """A model's activation profile rows (workbench/analysis/activations.py), empty when it has none."""
    return store.sql("SELECT * EXCLUDE (checkpoint_sha256, created_at, source) FROM activation_profiles "
                     "WHERE checkpoint_sha256 = ? ORDER BY kind, layer, head, expert, signal", [sha])


def profile_stamp(store: Store, sha: str, table: str = "profiles") -> tuple:
    """What changes when a model's profile (``profiles``, or ``activation_profiles``) is replaced: its row count,
    newest created_at and source (what the analyses' read-once caches of a profile compare)."""
    if table not in ("profiles", "activation_profiles"):
        raise ValueError(f"not a profile table: {table!r}")
    return tuple(store.execute(f"SELECT count(*), max(created_at), any_value(source) FROM {table} "
                               "WHERE checkpoint_sha256 = ?", [sha])[0])


def run_summary(store: Store, run_id: str) -> ModelSummary:
    return model_summary(run_row(store, run_id))


def no_routing_reason(store: Store, run_id: str) -> str:
    """Why a run has (or may have) no routing rows, in words for a figure or a header."""
    s = run_summary(store, run_id)
    if s.unrouted_layers:
        return (f"routing not recorded: {s.family} has MoE blocks in layers {s.unrouted_layers} that no adapter "
                "recognises")
    if not s.moe_layers:
        return f"no routing: {s.family} is a dense model (no MoE layers)"
    return "no routing rows recorded for this run (the routing probe was off)"


def policy_results(store: Store, run_id: str) -> pl.DataFrame:
    """A run's stored KV-cache what-if rows (``workbench.analysis.kv_policies``), least memory kept first."""
    return store.sql("""SELECT * EXCLUDE (run_id) FROM policy_results WHERE run_id = ?
                        ORDER BY bytes_kept / greatest(bytes_full, 1), delta_nll, policy""", [run_id])


def anomalies(store: Store, run_id: str) -> pl.DataFrame:
    return store.sql("""SELECT * EXCLUDE (run_id) FROM anomalies WHERE run_id = ?
                        ORDER BY CASE severity WHEN 'critical' THEN 0 WHEN 'warning' THEN 1 ELSE 2 END,
                                 score DESC, anomaly_id""", [run_id])


def detected(store: Store, run_id: str) -> bool:
    """Whether the run's anomalies were detected (and stored, possibly as no rows at all)."""
    return store.sql("SELECT detection IS NOT NULL AS d FROM runs WHERE run_id = ?", [run_id])["d"].to_list() == [True]


def attributions(store: Store, run_id: str, target_pos: int | None = None) -> pl.DataFrame:
    if target_pos is None:
        return table(store, "attributions", run_id, "target_pos, rank")
    return store.sql("SELECT * EXCLUDE (run_id) FROM attributions WHERE run_id = ? AND target_pos = ? "
                     "ORDER BY rank", [run_id, target_pos])


def token_heads(store: Store, run_id: str, pos: int) -> pl.DataFrame:
    """Entropy per layer x head at one query position."""
    return store.sql("SELECT layer, head, entropy, norm_entropy, max_weight, sink_weight FROM attention "
                     f"WHERE {_rows(store, 'attention', run_id)}run_id = ? AND pos = ? ORDER BY layer, head",
                     [run_id, pos])


def token_routing(store: Store, run_id: str, pos: int) -> pl.DataFrame:
    return store.sql("SELECT layer, slot, expert, weight, score, margin FROM routing "
                     f"WHERE {_rows(store, 'routing', run_id)}run_id = ? AND pos = ? ORDER BY layer, slot",
                     [run_id, pos])


def head_entropy(store: Store, run_id: str) -> pl.DataFrame:
    """Mean entropy per layer x head over the run's query positions (pos 0 excluded)."""
    return store.sql("SELECT layer, head, avg(entropy) AS entropy, avg(norm_entropy) AS norm_entropy, "
                     f"avg(sink_weight) AS sink_weight FROM attention WHERE {_rows(store, 'attention', run_id)}"
                     "run_id = ? AND pos > 0 "
                     "GROUP BY layer, head ORDER BY layer, head", [run_id])


def expert_load(store: Store, run_id: str) -> pl.DataFrame:
    """Share of routed slots per expert per MoE layer (sums to 1 per layer)."""
    return store.sql(f"""SELECT layer, expert, count(*) AS slots,
                               count(*) / sum(count(*)) OVER (PARTITION BY layer) AS share
                        FROM routing WHERE {_rows(store, 'routing', run_id)}run_id = ?
                        GROUP BY layer, expert ORDER BY layer, expert""", [run_id])


def coactivation(store: Store, run_id: str, layer: int) -> pl.DataFrame:
    """How often each pair of experts is chosen for the same token in a layer (a, b, count)."""
    return store.sql(f"""SELECT a.expert AS a, b.expert AS b, count(*) AS count
                        FROM routing a JOIN routing b
                          ON a.run_id = b.run_id AND a.pos = b.pos AND a.layer = b.layer AND a.slot <> b.slot
                        WHERE {_rows(store, 'routing', run_id, 'a')}{_rows(store, 'routing', run_id, 'b')}
                              a.run_id = ? AND a.layer = ? GROUP BY a.expert, b.expert ORDER BY a, b""",
                     [run_id, layer])


def load_along_run(store: Store, run_id: str, layer: int, window: int = 16) -> pl.DataFrame:
    """Per expert, its share of slots in consecutive windows of positions."""
    # the window is computed once in a subquery: a parameter repeated in GROUP BY would not match the SELECT
    return store.sql(f"""SELECT window_start, expert, count(*) AS slots,
                               count(*) / sum(count(*)) OVER (PARTITION BY window_start) AS share
                        FROM (SELECT pos // $w * $w AS window_start, expert FROM routing
                              WHERE {_rows(store, 'routing', run_id)}run_id = $run AND layer = $layer)
                        GROUP BY window_start, expert ORDER BY window_start, expert""",
                     {"w": window, "run": run_id, "layer": layer})


# -- one step of a run (replay) -------------------------------------------------------------------

def last_step(store: Store, run_id: str) -> int | None:
    """The last step any signal table recorded for a run (None: no step)."""
    w = {t: _rows(store, t, run_id) for t in ("tokens", "steps", "kv")}
    return store.sql(f"""SELECT max(s) AS s FROM (
                          SELECT max(step) AS s FROM tokens WHERE {w['tokens']}run_id = $r
                          UNION ALL SELECT max(step) FROM steps WHERE {w['steps']}run_id = $r
                          UNION ALL SELECT max(step) FROM kv WHERE {w['kv']}run_id = $r)""", {"r": run_id})["s"][0]


def step_signals(store: Store, run_id: str, step: int, produced: int, newest: int) -> dict[str, pl.DataFrame]:
    """What a run's store holds for one step: tokens up to ``produced``, the heads and routing of the
    ``newest`` fed position, the KV state and timing of ``step``."""
    r = {"r": run_id}
    w = {t: _rows(store, t, run_id) for t in ("tokens", "attention", "routing", "kv", "kv_tokens", "steps")}
    return {
        "tokens": store.sql(f"SELECT * EXCLUDE (run_id) FROM tokens WHERE {w['tokens']}run_id = $r "
                            "AND pos <= $produced ORDER BY pos", r | {"produced": produced}),
        "heads": store.sql("SELECT layer, head, entropy, norm_entropy, max_weight, sink_weight FROM attention "
                           f"WHERE {w['attention']}run_id = $r AND pos = $pos ORDER BY layer, head",
                           r | {"pos": newest}),
        "routing": store.sql("SELECT layer, slot, expert, weight, score, margin FROM routing "
                             f"WHERE {w['routing']}run_id = $r AND pos = $pos ORDER BY layer, slot",
                             r | {"pos": newest}),
        "kv": store.sql(f"SELECT layer, cached_tokens, bytes FROM kv WHERE {w['kv']}run_id = $r AND step = $t "
                        "ORDER BY layer", r | {"t": step}),
        "kv_tokens": store.sql("SELECT layer, pos, latent_norm, rope_norm, attn_received FROM kv_tokens "
                               f"WHERE {w['kv_tokens']}run_id = $r AND step = $t ORDER BY layer, pos", r | {"t": step}),
        "timing": store.sql(f"SELECT kind, wall_ms FROM steps WHERE {w['steps']}run_id = $r AND step = $t",
                            r | {"t": step}),
    }


# -- two runs side by side (diff) -----------------------------------------------------------------

def head_shift(store: Store, a: str, b: str) -> pl.DataFrame:
    """Per layer x head: mean entropy in run a and b over the positions both have (pos 0 excluded: it
    attends to itself only)."""
    return store.sql(f"""
        SELECT x.layer, x.head, avg(x.entropy) AS entropy_a, avg(y.entropy) AS entropy_b,
               avg(y.entropy - x.entropy) AS d_entropy, max(abs(y.entropy - x.entropy)) AS max_abs_d_entropy,
               count(*) AS positions
        FROM attention x JOIN attention y ON x.pos = y.pos AND x.layer = y.layer AND x.head = y.head
        WHERE {_rows(store, 'attention', a, 'x')}{_rows(store, 'attention', b, 'y')}x.run_id = ? AND y.run_id = ?
              AND x.pos > 0
        GROUP BY x.layer, x.head ORDER BY x.layer, x.head""", [a, b])


def routing_agreement(store: Store, a: str, b: str) -> pl.DataFrame:
    """Per MoE layer: how many routed slots changed expert between run a and b, and how many chose an
    expert outside b's set for that token."""
    return store.sql(f"""
        SELECT x.layer, count(DISTINCT x.pos) AS positions, count(*) AS slots,
               count(*) FILTER (WHERE x.expert <> y.expert) AS changed_slots,
               count(*) FILTER (WHERE x.expert <> y.expert) / count(*) AS changed_share,
               count(*) FILTER (WHERE NOT EXISTS (
                   SELECT 1 FROM routing z WHERE {_rows(store, 'routing', b, 'z')}z.run_id = y.run_id
                                             AND z.pos = x.pos AND z.layer = x.layer
                                             AND z.expert = x.expert)) / count(*) AS set_changed_share
        FROM routing x JOIN routing y ON x.pos = y.pos AND x.layer = y.layer AND x.slot = y.slot
        WHERE {_rows(store, 'routing', a, 'x')}{_rows(store, 'routing', b, 'y')}x.run_id = ? AND y.run_id = ?
        GROUP BY x.layer ORDER BY x.layer""", [a, b])


# -- batches (prompt sets: workbench.record_many) -------------------------------------------------------
# A batch's views read its ``complete`` runs (a failed prompt's partial rows, or a failed try before a
# successful rerun, would count twice).
_BATCH_RUNS = "SELECT run_id FROM runs WHERE batch_id = $b AND status = 'complete'"


def batches(store: Store) -> pl.DataFrame:
    """Every batch: batch_id, runs, complete, failed, started, finished (newest first)."""
    return store.sql("""SELECT batch_id, count(*) AS runs, count(*) FILTER (WHERE status = 'complete') AS complete,
                               count(*) FILTER (WHERE status = 'failed') AS failed, min(created_at) AS started,
                               max(finished_at) AS finished
                        FROM runs WHERE batch_id IS NOT NULL GROUP BY batch_id ORDER BY started DESC, batch_id""")


def batch_runs(store: Store, batch_id: str) -> pl.DataFrame:
    """The runs of a batch, every status, in the order they were recorded."""
    return store.sql("""SELECT run_id, batch_item, status, prompt, n_prompt_tokens, n_tokens, error, created_at
                        FROM runs WHERE batch_id = ? ORDER BY created_at, run_id""", [batch_id])


def batch_expert_load(store: Store, batch_id: str) -> pl.DataFrame:
    """Routed slots per layer x expert summed over the batch's complete runs, their share of the layer's
    slots (sums to 1 per layer) and the runs that used the expert."""
    return store.sql(f"""SELECT layer, expert, count(*) AS slots,
                                count(*) / sum(count(*)) OVER (PARTITION BY layer) AS share,
                                count(DISTINCT run_id) AS runs
                         FROM routing WHERE run_id IN ({_BATCH_RUNS})
                         GROUP BY layer, expert ORDER BY layer, expert""", {"b": batch_id})


def batch_head_entropy(store: Store, batch_id: str) -> pl.DataFrame:
    """Each complete run's mean entropy per layer x head (pos 0 excluded): one value per run and head, the
    distribution of a head's entropy over the batch."""
    return store.sql(f"""SELECT run_id, layer, head, avg(entropy) AS entropy, avg(norm_entropy) AS norm_entropy
                         FROM attention WHERE run_id IN ({_BATCH_RUNS}) AND pos > 0
                         GROUP BY run_id, layer, head ORDER BY layer, head, run_id""", {"b": batch_id})


def batch_head_entropy_summary(store: Store, batch_id: str) -> pl.DataFrame:
    """Per layer x head, the spread of the runs' mean normalised entropy: runs, mean, std, min, p10, median,
    p90, max."""
    return store.sql(f"""SELECT layer, head, count(*) AS runs, avg(norm_entropy) AS mean, stddev_samp(norm_entropy) AS std,
                                min(norm_entropy) AS min, quantile_cont(norm_entropy, 0.1) AS p10,
                                median(norm_entropy) AS median, quantile_cont(norm_entropy, 0.9) AS p90,
                                max(norm_entropy) AS max
                         FROM (SELECT run_id, layer, head, avg(norm_entropy) AS norm_entropy FROM attention
                               WHERE run_id IN ({_BATCH_RUNS}) AND pos > 0 GROUP BY run_id, layer, head)
                         GROUP BY layer, head ORDER BY layer, head""", {"b": batch_id})


def batch_low_confidence(store: Store, batch_id: str, n: int = 20) -> pl.DataFrame:
    """The ``n`` least confident generated tokens over the batch's complete runs: run_id, batch_item, pos,
    text, confidence, prob, rank."""
    return store.sql(f"""SELECT t.run_id, r.batch_item, t.pos, t.text, t.confidence, t.prob, t.rank
                         FROM tokens t JOIN runs r USING (run_id)
                         WHERE t.run_id IN ({_BATCH_RUNS}) AND NOT t.is_prompt AND t.confidence IS NOT NULL
                         ORDER BY t.confidence, t.run_id, t.pos LIMIT $n""", {"b": batch_id, "n": int(n)})


# -- text search across runs ----------------------------------------------------------------------------

SEARCH_SCHEMA = {"run_id": pl.String, "pos": pl.Int64, "end_pos": pl.Int64, "offset": pl.Int64,
                 "match": pl.String, "context": pl.String}


def search(store: Store, text: str, *, batch_id: str | None = None, run_ids: list[str] | None = None,
           ignore_case: bool = False, context: int = 40, limit: int = 200) -> pl.DataFrame:
    """Where runs' decoded text contains ``text``: the run's token texts concatenated in position order (as
    ``Run.text``), so a match may span several BPE pieces. One row per match: run_id, pos (the token the match
    starts in), end_pos (the token it ends in), offset (its character offset in the run's text), match, and
    context (up to ``context`` characters either side). Newest runs first, at most ``limit`` rows."""

    if not isinstance(text, str) or not text:
        raise ValueError("search: give some text to look for")
    where, params = ["TRUE"], {"q": text}
    if batch_id is not None:
        where.append("run_id IN (SELECT run_id FROM runs WHERE batch_id = $b)")
        params["b"] = batch_id
    if run_ids is not None:
        where.append("list_contains($ids, run_id)")
        params["ids"] = list(run_ids)
    hay = "string_agg(coalesce(text, ''), '' ORDER BY pos)"
    cond = f"contains(lower({hay}), lower($q))" if ignore_case else f"contains({hay}, $q)"
    found = store.sql(f"""SELECT t.run_id, t.texts, t.positions FROM (
                              SELECT run_id, list(coalesce(text, '') ORDER BY pos) AS texts,
                                     list(pos ORDER BY pos) AS positions
                              FROM tokens WHERE {' AND '.join(where)} GROUP BY run_id HAVING {cond}) t
                          JOIN runs r USING (run_id) ORDER BY r.created_at DESC, t.run_id""", params)
    pattern = re.compile(re.escape(text), re.IGNORECASE if ignore_case else 0)
    rows: list[dict] = []
    for run_id, texts, positions in found.iter_rows():
        starts, n = [], 0
        for t in texts:
            starts.append(n)
            n += len(t)
        whole = "".join(texts)
        for m in pattern.finditer(whole):
            first = bisect.bisect_right(starts, m.start()) - 1
            last = bisect.bisect_right(starts, m.end() - 1) - 1
            rows.append({"run_id": run_id, "pos": positions[first], "end_pos": positions[last], "offset": m.start(),
                         "match": m.group(0),
                         "context": whole[max(0, m.start() - context):m.end() + context]})
            if len(rows) >= limit:
                return pl.DataFrame(rows, schema=SEARCH_SCHEMA)
    return pl.DataFrame(rows, schema=SEARCH_SCHEMA)
