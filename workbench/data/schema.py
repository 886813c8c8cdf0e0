"""The DuckDB schema: one place that says what every table holds (docs/schema.md mirrors it).

Conventions: ``pos`` is the 0-based position in the sequence, ``layer`` the 0-based transformer block
(dense or MoE), ``step`` 0 for the prefill and n for the n-th decode step. Every table is keyed by
``run_id``. Bump ``SCHEMA_VERSION`` on any incompatible change; a newer database is refused.
"""
from __future__ import annotations

from workbench.data.signals import TABLES as SIGNAL_TABLES

SCHEMA_VERSION = 1

TABLES: dict[str, str] = {
    "meta": """
        key VARCHAR PRIMARY KEY,
        value VARCHAR""",
    "runs": """
        run_id VARCHAR PRIMARY KEY,
        created_at TIMESTAMP,
        status VARCHAR,            -- running | complete | failed | interrupted
        model VARCHAR,             -- checkpoint path or a module's class name
        config VARCHAR,            -- the model's own config as JSON (ModelArgs, or a transformers config)
        checkpoint_sha256 VARCHAR,
        dtype VARCHAR,
        device VARCHAR,
        prompt VARCHAR,
        params VARCHAR,            -- generation settings as JSON (max_new_tokens, temperature, top_p, ...)
        seed BIGINT,
        parent_run_id VARCHAR,
        finished_at TIMESTAMP,
        error VARCHAR,
        n_prompt_tokens INTEGER,
        n_tokens INTEGER,          -- prompt + generated tokens recorded so far
        pid INTEGER,               -- recording process, to tell a live run from an interrupted one
        summary VARCHAR,           -- the neutral model summary as JSON (docs/schema.md); every consumer reads it
        notes VARCHAR,             -- what the recorder could not see (e.g. MoE blocks no adapter recognises)
        pid_start VARCHAR,         -- the recording process beyond its pid: <boot id>:<start ticks> (a reused pid differs)
        detection VARCHAR,         -- the detector settings (JSON) of the run's stored anomalies; NULL: never detected
        batch_id VARCHAR,          -- the prompt set recording (workbench.record_many) the run belongs to; NULL: none
        batch_item VARCHAR         -- the prompt's key within its batch (its id, else <index>:<text hash>)""",
    "anomalies": """
        run_id VARCHAR,
        anomaly_id INTEGER,
        kind VARCHAR,
        severity VARCHAR,          -- info | warning | critical
        pos INTEGER,
        layer INTEGER,
        head INTEGER,
        expert INTEGER,
        score DOUBLE,
        threshold DOUBLE,
        explanation VARCHAR""",
    "attributions": """
        run_id VARCHAR,
        target_pos INTEGER,        -- the position whose token is explained
        kind VARCHAR,              -- token | head | expert | shared_expert | router
        layer INTEGER,
        head INTEGER,
        expert INTEGER,
        source_pos INTEGER,
        score DOUBLE,
        rank INTEGER,              -- 1 = most responsible, across all kinds
        method VARCHAR,            -- ig_routing_frozen, ig_plain, ablation (+ _vs_reference)
        delta DOUBLE,              -- captum convergence delta (IG rows)
        created_at TIMESTAMP""",
    "profiles": """
        checkpoint_sha256 VARCHAR, -- the model (runs.checkpoint_sha256) this baseline describes
        signal VARCHAR,            -- norm_entropy | confidence | surprise | margin | expert_share | latent_norm | resid_norm
        layer INTEGER,
        head INTEGER,
        expert INTEGER,
        bucket INTEGER,            -- context-length bucket (workbench.analysis.baseline.BUCKETS); NULL where not bucketed
        n BIGINT,                  -- values (or, for expert_share, routed slots) the cell was made from
        mean DOUBLE,               -- for expert_share: the expert's share of the layer's slots
        std DOUBLE,
        quantiles DOUBLE[],        -- empirical quantiles at workbench.analysis.baseline.PROBS
        created_at TIMESTAMP,
        source VARCHAR             -- what it was calibrated on (JSON: prompts, runs, max_new_tokens)""",
    "policy_results": """
        run_id VARCHAR,
        policy VARCHAR,            -- the KV policy's canonical spec (workbench.analysis.kv_policies), e.g. window:sink=4,recent=64
        bytes_kept BIGINT,         -- cache bytes at the end of the run under the policy, all layers
        bytes_full BIGINT,         -- the same cache unpruned
        delta_nll DOUBLE,          -- mean change in NLL of the recorded generated tokens vs the full cache (nats)
        top1_agreement DOUBLE,     -- share of generated positions whose argmax is the full cache's
        first_divergence INTEGER,  -- first position whose argmax differs; NULL: none
        events BIGINT,             -- evictions / low-precision entries / recompute triggers (per policy)
        created_at TIMESTAMP""",
}

# the signal tables come from the registry (workbench/signals.py), after runs and before the derived ones
TABLES = {k: v for k, v in TABLES.items() if k in ("meta", "runs")} | \
    {name: "\n        " + t.ddl().replace(",\n", ",\n        ") for name, t in SIGNAL_TABLES.items()} | \
    {k: v for k, v in TABLES.items() if k not in ("meta", "runs")}

# columns that identify a row, for idempotent replacement of derived tables
DERIVED = ("anomalies", "attributions")

# columns added at the end of a table since a database may have been created (same schema_version:
# old queries keep working); applied, idempotently, on every open. New tables come from ddl() itself.
ADDED_COLUMNS = ["ALTER TABLE runs ADD COLUMN IF NOT EXISTS summary VARCHAR",
                 "ALTER TABLE runs ADD COLUMN IF NOT EXISTS notes VARCHAR",
                 "ALTER TABLE runs ADD COLUMN IF NOT EXISTS pid_start VARCHAR",
                 "ALTER TABLE runs ADD COLUMN IF NOT EXISTS detection VARCHAR",
                 "ALTER TABLE runs ADD COLUMN IF NOT EXISTS batch_id VARCHAR",
                 "ALTER TABLE runs ADD COLUMN IF NOT EXISTS batch_item VARCHAR"]


def ddl() -> str:
    return "\n".join(f"CREATE TABLE IF NOT EXISTS {name} ({cols}\n);" for name, cols in TABLES.items())


def columns(table: str) -> list[str]:
    """Column names of a table, in order."""
    out = []
    for line in TABLES[table].strip().splitlines():
        line = line.split("--")[0].strip().rstrip(",")
        if line and not line.upper().startswith(("PRIMARY", "UNIQUE")):
            out.append(line.split()[0])
    return out
