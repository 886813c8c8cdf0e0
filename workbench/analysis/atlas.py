"""The expert atlas: what each routed expert does over a batch or a list of runs (torch-free).

Per MoE layer x routed expert, from the runs' ``routing`` and ``tokens`` rows:

- ``load_share``: its routed slots over the layer's routed slots (``slots``, ``runs``, ``mean_weight`` beside);
- ``top_tokens``: the token texts with the largest summed gate weight (``weight``) routed to it;
- ``key_tokens``: the texts that characterise it: summed gate weight times the share of the text's tokens in
  the layer that chose it (a frequent token every expert gets scores low, a token mostly sent here high), among
  texts routed to it at least ``KEY_MIN`` times (all of its texts when none is);
- ``contexts``: its ``TOP_CONTEXTS`` highest-weight slots, each with ``CONTEXT`` tokens either side as text
  (ties: run id, then position);
- ``top_classes`` / ``class_shares``: the histogram of its slots' token classes: Python's
  (``workbench.analysis.codeview.token_classes``) for a run whose prompt reads as Python (``compile_check`` of
  the prompt is ``ok`` or ``incomplete``, or fails only on indentation: ``reads_as_python``), else
  ``TEXT_CLASSES`` (word, number, punctuation, whitespace);
- ``co_experts`` / ``co_shares``: the experts chosen for the same token in the same layer, and the share of its
  slots they shared;
- ``label``: its key tokens and most frequent class, e.g. `` `def`, `return` (keyword 62%) `` (no language model;
  the same rows give the same label).

Experts of the model that no token chose have a row with ``slots`` 0 and the label ``never routed``.

Super experts (arXiv 2507.23279; issue 28): ``max_act`` is the largest activation inside the expert (an element of
its down projection's input, the ``expert_extremes`` signal) over the scope, among the positions where it was the
largest of the chosen experts' (what the signal keeps); ``super`` is True when it exceeds the layer's clean extreme
by an order of magnitude (``SUPER_FACTOR``). The baseline profiles (``workbench.analysis.baseline``) do not
profile this signal, so the clean extreme is the scope's own: the median over the layer's experts of their
``max_act``. Runs recorded without the signal give ``max_act`` null and ``super`` False. These two columns are
computed on every call from the signal's rows (one aggregation), not stored with the rest.

``atlas(store, run_ids=..., batch_id=...)`` computes it once per scope and stores it in the ``atlas`` table
(docs/schema.md); a later call reads it back while the scope's runs are the same (``fingerprint``). A read-only
store (a folder of Parquet shards) gets it computed and not stored.
"""
from __future__ import annotations

import hashlib
import json
from datetime import datetime, timezone

import polars as pl

from workbench.analysis.codeview import compile_check, token_classes
from workbench.data import query
from workbench.data.schema import columns
from workbench.data.store import Store

CONTEXT = 8  # tokens either side of a top context
TOP_CONTEXTS = 8
TOP_TOKENS = 10
CO_EXPERTS = 5
LABEL_TOKENS = 3
KEY_MIN = 2  # times a text must be routed to the expert to be one of its key tokens
TEXT_CLASSES = ("word", "number", "punctuation", "whitespace")
NEVER = "never routed"
SUPER_FACTOR = 10.0  # an expert is "super" when its largest activation is this many times the clean extreme
#: the columns stored in the ``atlas`` table (the table's, less scope, fingerprint and created_at)
STORED_COLUMNS = [c for c in columns("atlas") if c not in ("scope", "fingerprint", "created_at")]
#: the columns ``atlas()`` returns: the stored ones and the super-expert flag beside them
COLUMNS = STORED_COLUMNS + ["max_act", "super"]


def fingerprint(run_ids: list[str]) -> str:
    """SHA-256 of the sorted run ids: what the stored rows were computed from."""
    return hashlib.sha256("\n".join(sorted(run_ids)).encode()).hexdigest()


def runs_scope(run_ids: list[str]) -> str:
    """The scope of an atlas over a list of runs: ``runs:<12 hex>`` (the order of the list does not matter)."""
    return "runs:" + fingerprint(run_ids)[:12]


def batch_scope(batch_id: str) -> str:
    return f"batch:{batch_id}"


def batch_run_ids(store: Store, batch_id: str) -> list[str]:
    """A batch's complete runs (what the batch views read)."""
    r = query.batch_runs(store, batch_id)
    return r.filter(pl.col("status") == "complete")["run_id"].to_list()


def text_class(text: str | None) -> str | None:
    """A token's class in text that is not Python: whitespace (blank), word (has a letter), number (has a
    digit), else punctuation; None for a token with no characters."""
    if not text:
        return None
    s = text.strip()
    if not s:
        return "whitespace"
    if any(ch.isalpha() for ch in s):
        return "word"
    if any(ch.isdigit() for ch in s):
        return "number"
    return "punctuation"


def reads_as_python(prompt: str | None) -> bool:
    """A prompt that parses as Python, is Python cut off mid-statement, or fails only on its indentation (code
    whose leading whitespace was lost: "expected an indented block", "unexpected indent")."""
    if not prompt:
        return False
    chk = compile_check(prompt)
    return chk["status"] in ("ok", "incomplete") or "indent" in (chk["message"] or "")


def shown(text: str | None, most: int = 24) -> str:
    """A token's text for a label: outer spaces dropped; a blank token's characters spelled (``\\n``, ``␣``)."""
    t = text or ""
    s = t.strip()
    if not s:
        s = t.replace("\n", "\\n").replace("\t", "\\t").replace("\r", "\\r").replace(" ", "␣") or "∅"
    else:
        s = s.replace("\n", "\\n").replace("\t", "\\t").replace("\r", "\\r")
    return s if len(s) <= most else s[:most - 1] + "…"


def make_label(top_tokens: list[str], top_classes: list[str], class_shares: list[float]) -> str:
    """`` `tok1`, `tok2`, `tok3` (class 62%) ``: the first distinct texts of ``top_tokens`` (its key tokens)
    and the most frequent class; deterministic in its inputs."""
    if not top_tokens:
        return NEVER
    seen: list[str] = []
    for t in top_tokens:
        v = shown(t)
        if v not in seen:
            seen.append(v)
        if len(seen) == LABEL_TOKENS:
            break
    toks = ", ".join(f"`{v}`" for v in seen)
    if top_classes:
        return f"{toks} ({top_classes[0]} {round(100 * class_shares[0])}%)"
    return toks


# -- reading ---------------------------------------------------------------------------------------

def _read(store: Store, run_ids: list[str]) -> tuple[pl.DataFrame, pl.DataFrame, pl.DataFrame]:
    """(routing rows, tokens rows, runs rows) of the runs."""
    ids = {"ids": list(run_ids)}
    routing = store.sql("SELECT run_id, pos, layer, slot, expert, weight FROM routing "
                        "WHERE run_id IN (SELECT unnest($ids::VARCHAR[]))", ids)
    tokens = store.sql("SELECT run_id, pos, text FROM tokens WHERE run_id IN (SELECT unnest($ids::VARCHAR[])) "
                       "ORDER BY run_id, pos", ids)
    runs = store.sql("SELECT run_id, prompt, checkpoint_sha256, summary, config, model FROM runs "
                     "WHERE run_id IN (SELECT unnest($ids::VARCHAR[])) ORDER BY run_id", ids)
    return routing, tokens, runs


def _classes(tokens: pl.DataFrame, runs: pl.DataFrame) -> pl.DataFrame:
    """run_id, pos, class of every token (Python classes for a run whose prompt reads as Python)."""
    python = {r: reads_as_python(p) for r, p in zip(runs["run_id"].to_list(), runs["prompt"].to_list())}
    parts = []
    for (rid,), t in tokens.group_by("run_id", maintain_order=True):
        if python.get(rid):
            cls = token_classes(t.select("pos", "text"))["class"].to_list()
        else:
            cls = [text_class(x) for x in t["text"].to_list()]
        parts.append(pl.DataFrame({"run_id": [rid] * t.height, "pos": t["pos"].to_list(), "class": cls},
                                  schema={"run_id": pl.String, "pos": pl.Int32, "class": pl.String}))
    if not parts:
        return pl.DataFrame(schema={"run_id": pl.String, "pos": pl.Int32, "class": pl.String})
    return pl.concat(parts)


def _n_experts(runs: pl.DataFrame) -> int:
    n = 0
    for info in runs.iter_rows(named=True):
        try:
            n = max(n, int(query.model_summary(info).n_routed_experts or 0))
        except Exception:  # noqa: BLE001 - an unreadable summary: the experts routed are what there is
            pass
    return n


# -- computing -------------------------------------------------------------------------------------

def compute(store: Store, run_ids: list[str]) -> pl.DataFrame:
    """The atlas of the runs (``COLUMNS``, one row per MoE layer x expert, sorted), computed now, not stored."""
    run_ids = sorted(set(run_ids))
    routing, tokens, runs = _read(store, run_ids)
    missing = sorted(set(run_ids) - set(runs["run_id"].to_list()))
    if missing:
        raise query.RunNotFound(f"no run(s) {', '.join(map(repr, missing[:5]))} in {store.path}")
    models = {m for m in runs["checkpoint_sha256"].to_list() if m}
    if len(models) > 1:
        raise ValueError(f"an atlas describes one model's experts: these runs come from {len(models)} models "
                         "(runs.checkpoint_sha256)")
    classes = _classes(tokens, runs)
    r = (routing.with_columns(pl.col("pos").cast(pl.Int32))
         .join(tokens.with_columns(pl.col("pos").cast(pl.Int32)), on=["run_id", "pos"], how="left")
         .join(classes, on=["run_id", "pos"], how="left"))
    texts = {rid: t["text"].to_list() for (rid,), t in tokens.group_by("run_id", maintain_order=True)}
    first_pos = {rid: int(t["pos"].min()) for (rid,), t in tokens.group_by("run_id", maintain_order=True)}

    load = (r.group_by("layer", "expert")
            .agg(pl.len().cast(pl.Int64).alias("slots"), pl.col("run_id").n_unique().cast(pl.Int32).alias("runs"),
                 pl.col("weight").mean().alias("mean_weight"))
            .with_columns((pl.col("slots") / pl.col("slots").sum().over("layer")).alias("load_share")))
    toks = (r.group_by("layer", "expert", "text")
            .agg(pl.col("weight").sum().alias("w"), pl.len().alias("n"))
            .sort(["layer", "expert", "w", "n", "text"], descending=[False, False, True, True, False], nulls_last=True)
            .group_by("layer", "expert", maintain_order=True)
            .agg(pl.col("text").head(TOP_TOKENS).alias("top_tokens"),
                 pl.col("w").head(TOP_TOKENS).alias("token_weights")))
    positions = (r.select("run_id", "pos", "layer", "text").unique().group_by("layer", "text")
                 .agg(pl.len().alias("n_text")))  # the layer's tokens of each text
    ranked = (r.group_by("layer", "expert", "text").agg(pl.col("weight").sum().alias("w"), pl.len().alias("n"))
              .join(positions, on=["layer", "text"], how="left", nulls_equal=True)
              .with_columns((pl.col("w") * pl.col("n") / pl.col("n_text")).alias("score"),
                            (pl.col("n") >= pl.col("n").max().over("layer", "expert").clip(upper_bound=KEY_MIN))
                            .alias("often"))
              .filter(pl.col("often"))
              .sort(["layer", "expert", "score", "n", "text"], descending=[False, False, True, True, False],
                    nulls_last=True)
              .group_by("layer", "expert", maintain_order=True)
              .agg(pl.col("text").head(TOP_TOKENS).alias("key_tokens"),
                   pl.col("score").head(TOP_TOKENS).alias("key_scores")))
    cls = (r.filter(pl.col("class").is_not_null()).group_by("layer", "expert", "class").agg(pl.len().alias("n"))
           .join(load.select("layer", "expert", "slots"), on=["layer", "expert"])
           .with_columns((pl.col("n") / pl.col("slots")).alias("share"))
           .sort(["layer", "expert", "n", "class"], descending=[False, False, True, False])
           .group_by("layer", "expert", maintain_order=True)
           .agg(pl.col("class").alias("top_classes"), pl.col("share").alias("class_shares")))
    pair = r.select("run_id", "pos", "layer", "expert")
    co = (pair.join(pair.rename({"expert": "other"}), on=["run_id", "pos", "layer"])
          .filter(pl.col("expert") != pl.col("other"))
          .group_by("layer", "expert", "other").agg(pl.len().alias("n"))
          .join(load.select("layer", "expert", "slots"), on=["layer", "expert"])
          .with_columns((pl.col("n") / pl.col("slots")).alias("share"))
          .sort(["layer", "expert", "n", "other"], descending=[False, False, True, False])
          .group_by("layer", "expert", maintain_order=True)
          .agg(pl.col("other").head(CO_EXPERTS).cast(pl.Int32).alias("co_experts"),
               pl.col("share").head(CO_EXPERTS).alias("co_shares")))
    top = (r.sort(["layer", "expert", "weight", "run_id", "pos"], descending=[False, False, True, False, False])
           .group_by("layer", "expert", maintain_order=True).head(TOP_CONTEXTS))
    contexts: dict[tuple[int, int], list[dict]] = {}
    for row in top.iter_rows(named=True):
        t, p0 = texts.get(row["run_id"], []), first_pos.get(row["run_id"], 0)
        i = int(row["pos"]) - p0
        contexts.setdefault((row["layer"], row["expert"]), []).append({
            "run_id": row["run_id"], "pos": int(row["pos"]), "weight": float(row["weight"]), "class": row["class"],
            "before": "".join(x or "" for x in t[max(0, i - CONTEXT):max(0, i)]),
            "token": (t[i] if 0 <= i < len(t) else None) or "",
            "after": "".join(x or "" for x in t[i + 1:i + 1 + CONTEXT])})

    out = (load.join(toks, on=["layer", "expert"], how="left").join(ranked, on=["layer", "expert"], how="left")
           .join(cls, on=["layer", "expert"], how="left")
           .join(co, on=["layer", "expert"], how="left"))
    n_exp = _n_experts(runs)
    layers = sorted(set(out["layer"].to_list()))
    if n_exp and layers:  # the experts no token chose
        grid = pl.DataFrame({"layer": [lay for lay in layers for _ in range(n_exp)],
                             "expert": [e for _ in layers for e in range(n_exp)]},
                            schema={"layer": out.schema["layer"], "expert": out.schema["expert"]})
        out = grid.join(out, on=["layer", "expert"], how="left")
    out = out.with_columns(pl.col("slots").fill_null(0), pl.col("runs").fill_null(0),
                           pl.col("load_share").fill_null(0.0)).sort("layer", "expert")
    rows = []
    for row in out.iter_rows(named=True):
        tt, tc, cs = row["top_tokens"] or [], row["top_classes"] or [], row["class_shares"] or []
        kt = row["key_tokens"] or []
        rows.append({**row, "top_tokens": [x or "" for x in tt], "token_weights": row["token_weights"] or [],
                     "key_tokens": [x or "" for x in kt], "key_scores": row["key_scores"] or [],
                     "top_classes": tc, "class_shares": cs, "co_experts": row["co_experts"] or [],
                     "co_shares": row["co_shares"] or [],
                     "label": make_label(kt, tc, cs) if row["slots"] else NEVER,
                     "contexts": json.dumps(contexts.get((row["layer"], row["expert"]), []), ensure_ascii=False)})
    return pl.DataFrame(rows, schema=SCHEMA).select(STORED_COLUMNS)


SCHEMA = {"layer": pl.Int32, "expert": pl.Int32, "slots": pl.Int64, "load_share": pl.Float64, "runs": pl.Int32,
          "mean_weight": pl.Float64, "label": pl.String, "top_tokens": pl.List(pl.String),
          "token_weights": pl.List(pl.Float64), "key_tokens": pl.List(pl.String), "key_scores": pl.List(pl.Float64),
          "top_classes": pl.List(pl.String),
          "class_shares": pl.List(pl.Float64), "co_experts": pl.List(pl.Int32), "co_shares": pl.List(pl.Float64),
          "contexts": pl.String}


# -- stored ----------------------------------------------------------------------------------------

def stored(store: Store, scope: str) -> tuple[pl.DataFrame, str | None]:
    """The stored atlas of a scope (``STORED_COLUMNS``) and the fingerprint it was computed from (None: none stored)."""
    df = store.sql(f"SELECT fingerprint, {', '.join(STORED_COLUMNS)} FROM atlas WHERE scope = ? ORDER BY layer, expert",
                   [scope])
    if not df.height:
        return df.drop("fingerprint"), None
    return df.drop("fingerprint"), df["fingerprint"][0]


def scopes(store: Store) -> list[str]:
    """The scopes with a stored atlas."""
    return store.sql("SELECT DISTINCT scope FROM atlas ORDER BY scope")["scope"].to_list()


def atlas(store: Store, run_ids: list[str] | None = None, *, batch_id: str | None = None,
          recompute: bool = False) -> pl.DataFrame:
    """The atlas of a batch's complete runs (``batch_id``) or of ``run_ids``: the stored one when it was computed
    from the same runs, else computed now and stored (not on a read-only store). Columns ``COLUMNS``."""
    if (batch_id is None) == (run_ids is None):
        raise TypeError("atlas: give batch_id or run_ids (one of them)")
    if batch_id is not None:
        run_ids, scope = batch_run_ids(store, batch_id), batch_scope(batch_id)
        if not run_ids:
            raise query.RunNotFound(f"batch {batch_id!r} has no complete runs in {store.path}")
    else:
        run_ids = sorted(set(run_ids))
        if not run_ids:
            raise ValueError("atlas: no runs given")
        scope = runs_scope(run_ids)
    fp = fingerprint(run_ids)
    if not recompute:
        df, was = stored(store, scope)
        if was == fp:
            return with_super(df, super_experts(store, run_ids))
    df = compute(store, run_ids)
    if not getattr(store, "read_only", False):
        now = datetime.now(timezone.utc).replace(tzinfo=None)
        store.replace_rows("atlas", {"scope": scope}, df.with_columns(
            pl.lit(scope).alias("scope"), pl.lit(fp).alias("fingerprint"), pl.lit(now).alias("created_at")))
    return with_super(df, super_experts(store, run_ids))


def super_experts(store: Store, run_ids: list[str], factor: float = SUPER_FACTOR) -> pl.DataFrame:
    """Per MoE layer x expert that was some position's largest (``expert_extremes``): ``max_act`` (its largest
    activation over the runs), ``run_id`` and ``pos`` where, ``clean_extreme`` (the layer's median of ``max_act``
    over its experts) and ``super`` (``max_act > factor * clean_extreme``). Empty when no run has the signal."""
    schema = {"layer": pl.Int32, "expert": pl.Int32, "max_act": pl.Float64, "run_id": pl.String, "pos": pl.Int32,
              "clean_extreme": pl.Float64, "super": pl.Boolean}
    try:
        df = store.sql("SELECT run_id, pos, layer, max_act_expert AS expert, max_act FROM expert_extremes "
                       "WHERE run_id IN (SELECT unnest($ids::VARCHAR[]))", {"ids": list(run_ids)})
    except Exception:  # noqa: BLE001 - a store (Parquet shards) from before the signal: no flags
        return pl.DataFrame(schema=schema)
    df = df.filter(pl.col("max_act").is_finite())
    if not df.height:
        return pl.DataFrame(schema=schema)
    top = (df.sort(["layer", "expert", "max_act", "run_id", "pos"], descending=[False, False, True, False, False])
           .group_by("layer", "expert", maintain_order=True).first()
           .with_columns(pl.col("max_act").median().over("layer").alias("clean_extreme")))
    return (top.with_columns((pl.col("max_act") > factor * pl.col("clean_extreme")).alias("super"))
            .select([pl.col(c).cast(t) for c, t in schema.items()]))


def with_super(df: pl.DataFrame, flags: pl.DataFrame) -> pl.DataFrame:
    """The atlas rows with ``max_act`` and ``super`` (False where the expert has no ``expert_extremes`` rows)."""
    return (df.join(flags.select("layer", "expert", "max_act", "super"), on=["layer", "expert"], how="left")
            .with_columns(pl.col("super").fill_null(False)).select(COLUMNS))


def card(row: dict) -> dict:
    """One expert's card as plain values: the atlas row with its contexts parsed."""
    out = dict(row)
    out["contexts"] = json.loads(row.get("contexts") or "[]")
    return out


def cards_text(df: pl.DataFrame, width: int = 100) -> str:
    """The atlas as plain text, one card per expert (the CLI's output)."""
    lines = []
    for row in df.iter_rows(named=True):
        c = card(row)
        lines.append(f"layer {c['layer']} expert {c['expert']}: {c['load_share']:.1%} of the layer's slots "
                     f"({c['slots']} slots, {c['runs']} runs) - {c['label']}"
                     + (f" - SUPER EXPERT (largest activation {c['max_act']:.3g})" if c.get("super") else ""))
        if not c["slots"]:
            continue
        lines.append("  classes: " + ", ".join(f"{k} {v:.0%}" for k, v in zip(c["top_classes"], c["class_shares"])))
        lines.append("  key:     " + ", ".join(shown(t) for t in c["key_tokens"][:6]))
        lines.append("  tokens:  " + ", ".join(f"{shown(t)} ({w:.2f})" for t, w in zip(c["top_tokens"][:6],
                                                                                    c["token_weights"][:6])))
        if c["co_experts"]:
            lines.append("  with:    " + ", ".join(f"e{e} {s:.0%}" for e, s in zip(c["co_experts"], c["co_shares"])))
        for ctx in c["contexts"][:3]:
            line = _terminal(f"{ctx['before']}[[{ctx['token']}]]{ctx['after']}")
            lines.append(f"  {ctx['weight']:.2f}  {line[:width]}")
    return "\n".join(_terminal(x) for x in lines)  # token text is untrusted: no control character gets out


def _terminal(text: str) -> str:
    """Text safe on one terminal line: line breaks and tabs as symbols, other control characters (an escape
    sequence in a token) as ``\\xNN``."""
    text = text.replace("\n", "⏎").replace("\t", "⇥")
    return "".join(ch if ch.isprintable() or ch == " " else f"\\x{ord(ch):02x}" for ch in text)
