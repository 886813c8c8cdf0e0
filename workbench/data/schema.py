"""The DuckDB schema in one form: table declarations -> DDL (docs/schema.md mirrors them).

Conventions: ``pos`` is the 0-based position in the sequence, ``layer`` the 0-based transformer block
(dense or MoE), ``step`` 0 for the prefill and n for the n-th decode step. Every run's table is keyed by
``run_id``. Bump ``SCHEMA_VERSION`` on any incompatible change; a newer database is refused.
"""
from __future__ import annotations

from workbench.data.signals import TABLES as SIGNAL_TABLES
from workbench.data.signals import Table, c

SCHEMA_VERSION = 1

_OWN = (
    Table("meta", (c("key", "VARCHAR"), c("value", "VARCHAR")), keyed=False, primary_key="key"),
    Table("runs", (
        c("created_at", "TIMESTAMP"),
        c("status", "VARCHAR", "running | complete | failed | interrupted"),
        c("model", "VARCHAR", "absolute checkpoint folder, or a module's class name"),
        c("config", "VARCHAR", "the model's own config as JSON (ModelArgs, or a transformers config)"),
        c("checkpoint_sha256", "VARCHAR"),
        c("dtype", "VARCHAR"),
        c("device", "VARCHAR"),
        c("prompt", "VARCHAR"),
        c("params", "VARCHAR", "generation settings as JSON (max_new_tokens, temperature, top_p, ...)"),
        c("seed", "BIGINT"),
        c("parent_run_id", "VARCHAR"),
        c("finished_at", "TIMESTAMP"),
        c("error", "VARCHAR"),
        c("n_prompt_tokens", "INTEGER"),
        c("n_tokens", "INTEGER", "prompt + generated tokens recorded so far"),
        c("pid", "INTEGER", "recording process, to tell a live run from an interrupted one"),
        c("summary", "VARCHAR", "the neutral model summary as JSON (docs/schema.md); every consumer reads it"),
        c("notes", "VARCHAR", "what the recorder could not see (e.g. MoE blocks no adapter recognises)"),
        c("pid_start", "VARCHAR", "the recording process beyond its pid: <boot id>:<start ticks> (a reused pid differs)"),
        c("detection", "VARCHAR", "the detector settings (JSON) of the run's stored anomalies; NULL: never detected"),
        c("batch_id", "VARCHAR", "the prompt set recording (workbench.record_many) the run belongs to; NULL: none"),
        c("batch_item", "VARCHAR", "the prompt's key within its batch (its id, else <index>:<text hash>)"),
        c("tokenizer", "VARCHAR", "absolute path of the tokenizer.json the run encoded and decoded with; NULL: a "
          "tokenizer object passed in, or the bundled demo's"),
        c("weights_sha256", "VARCHAR", "SHA-256 of the weights in memory when the run was recorded (names, shapes, "
          "dtypes, bytes): differs from a clean load's after an in-place edit or a weight fault; NULL: offloaded")),
        primary_key="run_id"),
)
_DERIVED = (
    Table("anomalies", (
        c("anomaly_id", "INTEGER"), c("kind", "VARCHAR"), c("severity", "VARCHAR", "info | warning | critical"),
        c("pos", "INTEGER"), c("layer", "INTEGER"), c("head", "INTEGER"), c("expert", "INTEGER"),
        c("score", "DOUBLE"), c("threshold", "DOUBLE"), c("explanation", "VARCHAR"),
        c("component", "VARCHAR", "component_outlier rows: the component judged (kinds of "
          "workbench.analysis.activations: head, expert, router, mlp_block, ...); NULL for other rows"))),
    Table("attributions", (
        c("target_pos", "INTEGER", "the position whose token is explained"),
        c("kind", "VARCHAR", "token | head | expert | shared_expert | router | ..."),
        c("layer", "INTEGER"), c("head", "INTEGER"), c("expert", "INTEGER"), c("source_pos", "INTEGER"),
        c("score", "DOUBLE"),
        c("rank", "INTEGER", "1 = most responsible, across all kinds"),
        c("method", "VARCHAR", "ig_routing_frozen, ig_plain, ablation, patching (+ _vs_reference)"),
        c("delta", "DOUBLE", "captum convergence delta (IG rows)"),
        c("created_at", "TIMESTAMP"),
        c("restored", "DOUBLE", "activation patching: the fraction of the logprob gap to the reference that taking "
          "this component from the reference closes (NULL for other methods)"))),
    Table("profiles", (
        c("checkpoint_sha256", "VARCHAR", "the model (runs.checkpoint_sha256) this baseline describes"),
        c("signal", "VARCHAR",
          "norm_entropy | confidence | surprise | margin | expert_share | latent_norm | resid_norm | ..."),
        c("layer", "INTEGER"), c("head", "INTEGER"), c("expert", "INTEGER"),
        c("bucket", "INTEGER", "context-length bucket (workbench.analysis.baseline.BUCKETS); NULL where not bucketed"),
        c("n", "BIGINT", "values (or, for expert_share, routed slots) the cell was made from"),
        c("mean", "DOUBLE", "for expert_share: the expert's share of the layer's slots"),
        c("std", "DOUBLE"),
        c("quantiles", "DOUBLE[]", "empirical quantiles at workbench.analysis.baseline.PROBS"),
        c("created_at", "TIMESTAMP"),
        c("source", "VARCHAR", "what it was calibrated on (JSON: prompts, runs, max_new_tokens)")), keyed=False),
    Table("interventions", (
        c("idx", "INTEGER", "order of the intervention in the run's list (0-based)"),
        c("kind", "VARCHAR", "ban | boost | force | scale_head | scale | router_bias (workbench.interventions)"),
        c("layer", "INTEGER"), c("expert", "INTEGER"), c("head", "INTEGER"),
        c("path", "VARCHAR", "scale: the module path inside the model"),
        c("value", "DOUBLE", "boost: the delta; scale_head, scale: the factor; NULL otherwise"),
        c("spec", "VARCHAR", "the intervention's string form, e.g. ban:L3E5 (router_bias: its vector is here)")),
        order="idx", doc="the interventions a run was recorded under (workbench.record(..., interventions=))"),
    Table("policy_results", (
        c("policy", "VARCHAR",
          "the KV policy's canonical spec (workbench.analysis.kv_policies), e.g. window:sink=4,recent=64"),
        c("bytes_kept", "BIGINT", "cache bytes at the end of the run under the policy, all layers"),
        c("bytes_full", "BIGINT", "the same cache unpruned"),
        c("delta_nll", "DOUBLE", "mean change in NLL of the recorded generated tokens vs the full cache (nats)"),
        c("top1_agreement", "DOUBLE", "share of generated positions whose argmax is the full cache's"),
        c("first_divergence", "INTEGER", "first position whose argmax differs; NULL: none"),
        c("events", "BIGINT", "evictions / low-precision entries / recompute triggers (per policy)"),
        c("created_at", "TIMESTAMP"))),
    Table("activation_profiles", (
        c("checkpoint_sha256", "VARCHAR", "the model (runs.checkpoint_sha256) these statistics describe"),
        c("kind", "VARCHAR", "component kind, as in attributions.kind (head, attn_block, resid, router, ...)"),
        c("layer", "INTEGER"), c("head", "INTEGER"), c("expert", "INTEGER"),
        c("signal", "VARCHAR",
          "out (the component's output vector) | logit | pos_distance | prev_weight | chosen | angle"),
        c("n", "BIGINT", "calibration positions"),
        c("mean", "FLOAT[]", "per-dimension mean"),
        c("std", "FLOAT[]", "per-dimension standard deviation"),
        c("log_norm_mean", "DOUBLE"), c("log_norm_std", "DOUBLE"),
        c("dev_mean", "DOUBLE", "mean of log(mean over dimensions of z^2)"), c("dev_std", "DOUBLE"),
        c("run_norm_mean", "DOUBLE[]", "per context-length bucket, over clean prompts: mean of a run's mean z of "
          "the log norm"),
        c("run_norm_std", "DOUBLE[]"), c("run_dev_mean", "DOUBLE[]"), c("run_dev_std", "DOUBLE[]"),
        c("created_at", "TIMESTAMP"),
        c("source", "VARCHAR", "what it was calibrated on")), keyed=False,
        doc="workbench.analysis.activations: each component's activations on clean prompts"),
    Table("atlas", (
        c("scope", "VARCHAR",
          "what the atlas covers: batch:<batch_id>, or runs:<12 hex of the sorted run ids' SHA-256>"),
        c("fingerprint", "VARCHAR", "SHA-256 of the sorted run ids it was computed from (a resumed batch differs)"),
        c("layer", "INTEGER"), c("expert", "INTEGER"),
        c("slots", "BIGINT", "routed slots (routing rows) of the expert over the runs"),
        c("load_share", "DOUBLE", "slots / the layer's routed slots"),
        c("runs", "INTEGER", "runs that routed a token to the expert"),
        c("mean_weight", "DOUBLE", "mean gate weight of its slots"),
        c("label", "VARCHAR", "short deterministic label from its top tokens and classes"),
        c("top_tokens", "VARCHAR[]", "token texts by summed gate weight, highest first"),
        c("token_weights", "DOUBLE[]", "their summed gate weights"),
        c("key_tokens", "VARCHAR[]", "token texts that characterise it: summed gate weight x the share of the "
          "text's tokens in the layer routed to it, highest first (texts routed to it at least twice)"),
        c("key_scores", "DOUBLE[]", "their scores"),
        c("top_classes", "VARCHAR[]", "token classes of its slots, most frequent first"),
        c("class_shares", "DOUBLE[]", "their shares of its slots"),
        c("co_experts", "INTEGER[]", "experts chosen with it for the same token in the same layer, most often first"),
        c("co_shares", "DOUBLE[]", "share of its slots whose token also chose that expert"),
        c("contexts", "VARCHAR", "JSON list of its highest-weight tokens with 8 tokens either side"),
        c("created_at", "TIMESTAMP")), keyed=False,
        doc="workbench.analysis.atlas: each expert over a batch or a list of runs"),
    Table("logit_lens", (
        c("pos", "INTEGER", "position of the produced token (as tokens.pos); read from the residual stream at pos - 1"),
        c("layer", "INTEGER", "the block whose output (the residual stream after it) goes through the final norm and "
          "the unembedding"),
        c("token_id", "INTEGER", "the run's token at pos (tokens.token_id)"),
        c("prob", "DOUBLE", "its probability under that layer's distribution"),
        c("rank", "INTEGER", "its rank there (1 = the argmax; -1 if the logits were non-finite)"),
        c("top_token_id", "INTEGER", "that layer's most likely token"),
        c("top_prob", "DOUBLE", "its probability"),
        c("top_text", "VARCHAR", "its text (untrusted: escape before showing in HTML)"),
        c("created_at", "TIMESTAMP")), order="pos, layer",
        doc="workbench.analysis.lens: the logit lens, computed with the model on demand (Run.logit_lens)"),
)

# meta and runs, the signal tables (from the registry, workbench/data/signals.py), then the derived ones
TABLES: dict[str, Table] = {t.name: t for t in _OWN} | dict(SIGNAL_TABLES) | {t.name: t for t in _DERIVED}

# tables whose rows a later analysis replaces (per run and key)
DERIVED = ("anomalies", "attributions")

# columns added at the end of a table since a database may have been created (same schema_version:
# old queries keep working); applied, idempotently, on every open. New tables come from ddl() itself.
ADDED_COLUMNS = [f"ALTER TABLE runs ADD COLUMN IF NOT EXISTS {name} VARCHAR"
                 for name in ("summary", "notes", "pid_start", "detection", "batch_id", "batch_item",
                                  "tokenizer", "weights_sha256")] + [
    "ALTER TABLE attributions ADD COLUMN IF NOT EXISTS restored DOUBLE",
    "ALTER TABLE anomalies ADD COLUMN IF NOT EXISTS component VARCHAR"]


def ddl() -> str:
    return "\n".join(f"CREATE TABLE IF NOT EXISTS {name} ({t.ddl()}\n);" for name, t in TABLES.items())


def columns(table: str) -> list[str]:
    """Column names of a table, in order."""
    return TABLES[table].column_names()
