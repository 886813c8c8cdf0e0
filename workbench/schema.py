"""The DuckDB schema: one place that says what every table holds (docs/schema.md mirrors it).

Conventions: ``pos`` is the 0-based position in the sequence, ``layer`` the 0-based transformer block
(dense or MoE), ``step`` 0 for the prefill and n for the n-th decode step. Every table is keyed by
``run_id``. Bump ``SCHEMA_VERSION`` on any incompatible change; a newer database is refused.
"""
from __future__ import annotations

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
        config VARCHAR,            -- ModelArgs as JSON
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
        pid INTEGER                -- recording process, to tell a live run from an interrupted one""",
    "tokens": """
        run_id VARCHAR,
        pos INTEGER,
        step INTEGER,              -- step that produced (or, for the prompt, fed) this token
        token_id INTEGER,
        text VARCHAR,
        is_prompt BOOLEAN,
        prob DOUBLE,               -- p(token) under the distribution at pos-1; NULL at pos 0
        logprob DOUBLE,
        confidence DOUBLE,         -- max prob of that distribution
        entropy DOUBLE,            -- nats
        rank INTEGER,              -- 1 = the argmax
        topk_ids INTEGER[],
        topk_probs DOUBLE[]""",
    "attention": """
        run_id VARCHAR,
        pos INTEGER,               -- query position
        layer INTEGER,
        head INTEGER,
        entropy DOUBLE,            -- nats, over the keys 0..pos
        norm_entropy DOUBLE,       -- entropy / log(pos + 1); NULL at pos 0
        max_weight DOUBLE,
        sink_weight DOUBLE         -- weight on position 0""",
    "routing": """
        run_id VARCHAR,
        pos INTEGER,
        layer INTEGER,
        slot INTEGER,              -- 0..K-1, by decreasing gate weight
        expert INTEGER,
        weight DOUBLE,             -- gate weight used to mix the expert's output
        score DOUBLE,              -- raw score (sigmoid or softmax of the router logit)
        margin DOUBLE              -- last chosen minus best unchosen selection score (score + bias)""",
    "kv": """
        run_id VARCHAR,
        step INTEGER,
        layer INTEGER,
        cached_tokens INTEGER,
        bytes BIGINT""",
    "kv_tokens": """
        run_id VARCHAR,
        step INTEGER,
        layer INTEGER,
        pos INTEGER,               -- cached token
        latent_norm DOUBLE,        -- L2 norm of its cached kv latent
        rope_norm DOUBLE,          -- L2 norm of its cached rope key
        attn_received DOUBLE       -- attention it has received so far, summed over heads and queries""",
    "steps": """
        run_id VARCHAR,
        step INTEGER,
        kind VARCHAR,              -- prefill | decode
        n_tokens INTEGER,
        wall_ms DOUBLE""",
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
}

# columns that identify a row, for idempotent replacement of derived tables
DERIVED = ("anomalies", "attributions")


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
