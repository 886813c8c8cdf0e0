"""The signal registry: every recorded signal declared once, as data (no torch, no model).

A ``Signal`` names its probe (the name ``record(probes=...)`` takes), the tables it writes (columns with
SQL types, docs, and how replay compares them) and the adapter seams it listens to. Its probe class, the
object that reduces what the seams hand over into rows, lives in ``workbench.capture.probes`` under the
same name. The schema (``workbench.data.schema``), the recorder, replay's comparison, the query layer,
``Run``'s accessors and docs/schema.md all derive from ``REGISTRY``. Adding a signal is one entry here,
its probe class, and a test.

Step conventions: step 0 is the prefill (feeds the prompt, produces the first new token); decode step
s >= 1 feeds one token.
"""
from __future__ import annotations

from dataclasses import dataclass

# The adapter seams (workbench.capture.adapters.base documents what each hands over), declared once: a
# signal listens to some of them, interventions edit through the rest.
SEAMS = ("attn_probs", "attn_stats", "attn_row", "head_out", "route", "routed", "shared_out", "resid_post",
         "expert_in", "expert_out")


@dataclass(frozen=True)
class Column:
    """A column of a signal table. ``compare``: how replay compares two runs on it: "key" (aligns rows),
    "exact" (must be equal), "tol" (within a tolerance) or "" (not compared: timings, ids)."""

    name: str
    sql: str
    doc: str = ""
    compare: str = ""


@dataclass(frozen=True)
class Table:
    """A table of the store. ``keyed``: a ``run_id VARCHAR`` column comes first (every run's table);
    ``primary_key``: a column that is the table's primary key."""

    name: str
    columns: tuple[Column, ...]
    order: str = ""  # ORDER BY of a run's rows
    doc: str = ""
    keyed: bool = True
    primary_key: str = ""

    def ddl(self) -> str:
        """The column list of ``CREATE TABLE`` (one column a line)."""
        cols = (["run_id VARCHAR"] if self.keyed else []) + \
            [f"{c.name} {c.sql}" + (" PRIMARY KEY" if c.name == self.primary_key else "") for c in self.columns]
        return "\n" + ",\n".join(cols)

    def column_names(self) -> list[str]:
        """Every column in order, ``run_id`` included."""
        return (["run_id"] if self.keyed else []) + [c.name for c in self.columns]

    def names(self, compare: str | None = None) -> tuple[str, ...]:
        return tuple(c.name for c in self.columns if compare is None or c.compare == compare)


@dataclass(frozen=True)
class Signal:
    name: str
    tables: tuple[Table, ...]
    seams: tuple[str, ...]
    doc: str = ""


def _c(name: str, sql: str, doc: str = "", compare: str = "") -> Column:
    return Column(name, sql, doc, compare)


c = _c  # for workbench.data.schema's own tables


POS, LAYER = _c("pos", "INTEGER", "", "key"), _c("layer", "INTEGER", "", "key")

REGISTRY: tuple[Signal, ...] = (
    Signal("tokens", (Table("tokens", (
        _c("pos", "INTEGER", "", "key"),
        _c("step", "INTEGER", "step that produced (or, for the prompt, fed) this token"),
        _c("token_id", "INTEGER", "", "exact"),
        _c("text", "VARCHAR"),
        _c("is_prompt", "BOOLEAN"),
        _c("prob", "DOUBLE", "p(token) under the distribution at pos-1; NULL at pos 0", "tol"),
        _c("logprob", "DOUBLE", "", "tol"),
        _c("confidence", "DOUBLE", "max prob of that distribution", "tol"),
        _c("entropy", "DOUBLE", "nats", "tol"),
        _c("rank", "INTEGER", "1 = the argmax", "exact"),
        _c("topk_ids", "INTEGER[]"),
        _c("topk_probs", "DOUBLE[]")), "pos", "one row per token, prompt included"),),
        (), "token confidence from the step's logits"),
    Signal("kv", (
        Table("kv", (_c("step", "INTEGER", "", "key"), LAYER, _c("cached_tokens", "INTEGER", "", "exact"),
                     _c("bytes", "BIGINT", "", "exact")), "step, layer", "cache size per step x layer"),
        Table("kv_tokens", (
            _c("step", "INTEGER", "", "key"), LAYER, _c("pos", "INTEGER", "cached token", "key"),
            _c("latent_norm", "DOUBLE", "L2 norm of its cached kv latent (transformers models: of its values)", "tol"),
            _c("rope_norm", "DOUBLE", "L2 norm of its cached rope key (transformers models: of its keys)", "tol"),
            _c("attn_received", "DOUBLE", "attention it has received so far, summed over heads and queries", "tol")),
            "step, layer, pos", "per cached token, at the prefill and the final step")),
        ("attn_stats", "attn_row", "attn_probs"), "KV-cache state"),
    Signal("attention", (Table("attention", (
        _c("pos", "INTEGER", "query position", "key"), LAYER, _c("head", "INTEGER", "", "key"),
        _c("entropy", "DOUBLE", "nats, over the keys 0..pos", "tol"),
        _c("norm_entropy", "DOUBLE", "entropy / log(pos + 1); NULL at pos 0", "tol"),
        _c("max_weight", "DOUBLE", "", "tol"),
        _c("sink_weight", "DOUBLE", "weight on position 0", "tol")), "pos, layer, head",
        "per query position x layer x head"),), ("attn_stats", "attn_row", "attn_probs"), "attention entropy"),
    Signal("routing", (Table("routing", (
        POS, LAYER, _c("slot", "INTEGER", "0..K-1, by decreasing gate weight", "key"),
        _c("expert", "INTEGER", "", "exact"),
        _c("weight", "DOUBLE", "gate weight the expert's output is mixed with (what the experts received)", "tol"),
        _c("score", "DOUBLE", "raw score (softmax or sigmoid of the router logit)", "tol"),
        _c("margin", "DOUBLE", "last chosen minus best unchosen selection score (score + bias)", "tol")),
        "pos, layer, slot",
        "per position x MoE layer x slot: the router's actual selection"),), ("routed",),
        "expert routing"),
    Signal("resid_norm", (Table("resid_norm", (
        POS, LAYER, _c("norm", "DOUBLE", "L2 norm of the residual stream after the block", "tol")),
        "pos, layer", "per position x layer"),), ("resid_post",), "residual-stream norm"),
    Signal("head_norm", (Table("head_norm", (
        POS, LAYER, _c("head", "INTEGER", "", "key"),
        _c("norm", "DOUBLE", "L2 norm of the head's output (its slice of the attention output projection's input)",
           "tol")), "pos, layer, head", "per position x layer x head"),), ("head_out",),
        "attention-head output norm"),
    Signal("expert_extremes", (Table("expert_extremes", (
        POS, LAYER,
        _c("max_out_norm", "DOUBLE", "largest L2 norm of a chosen expert's own output (before its gate weight)", "tol"),
        _c("max_out_expert", "INTEGER", "the chosen expert that produced it", "exact"),
        _c("max_act", "DOUBLE", "largest |activation| inside a chosen expert: its down projection's input", "tol"),
        _c("max_act_expert", "INTEGER", "the chosen expert that produced it", "exact")), "pos, layer",
        "per position x MoE layer: the chosen experts' extremes (massive activations, arXiv 2507.23279); "
        "not recorded for experts modules the workbench cannot run exactly (the run's notes say so)"),),
        ("routed", "expert_in", "expert_out"), "expert extremes (super experts)"),
    Signal("steps", (Table("steps", (
        _c("step", "INTEGER"), _c("kind", "VARCHAR", "prefill | decode"), _c("n_tokens", "INTEGER"),
        _c("wall_ms", "DOUBLE")), "step", "one row per generation step"),), (), "step timing"),
)

SIGNALS: dict[str, Signal] = {s.name: s for s in REGISTRY}
RECORDED_SEAMS: frozenset[str] = frozenset(seam for s in REGISTRY for seam in s.seams)
assert RECORDED_SEAMS <= set(SEAMS)
TABLES: dict[str, Table] = {t.name: t for s in REGISTRY for t in s.tables}
PROBES: tuple[str, ...] = tuple(SIGNALS)
# signals declared after prompt-set batch ids were fixed: left out of the id's hash
# (``RecordSettings.batch_dict``), so an existing shard folder recorded with the default probes resumes
UNHASHED_PROBES: frozenset[str] = frozenset({"expert_extremes"})
