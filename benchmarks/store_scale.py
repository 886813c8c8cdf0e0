"""Store at scale: ingestion rate into DuckDB, and every UI view / query-layer call on a store of 1M tokens.

    python benchmarks/store_scale.py [--runs 2000] [--tokens 500] [--db PATH] [--samples 40] [--write]

1. Ingestion, through the store's real write path (``Store.append`` with the recorder's ``Rows``, which
   ``to_frame`` turns into polars/Arrow frames and DuckDB ingests with ``from_arrow(...).insert_into``).
   Two patterns: (a) the build below, one transaction per run holding all of its tables (the largest batch
   the recorder's writer thread commits), and (b) one run written as the recorder writes it: the prefill,
   then decode steps merged 32 at a time (``FLUSH_STEPS``), each merge one ``append``. Rate = signal values
   per second: rows x non-key columns (``run_id``, ``pos``, ``step``, ``layer``, ``head``, ``slot`` are keys;
   a top-k list counts as k values).

2. A synthetic store: ``--runs`` runs of about ``--tokens`` tokens (prompt 20-200 tokens, the rest generated)
   with the shape of the demo model (``ModelArgs.preset("demo")``: layers, heads, MoE layers, experts, top-k,
   MLA latent size), every signal table at its real size (tokens; attention and head_norm pos x layer x head;
   routing pos x MoE layer x slot; resid_norm; kv per step x layer; kv_tokens at step 0 and the last step;
   steps) plus a few stored anomalies per run, generated with numpy, never by the model. Then the views the
   app computes when a run is picked (``apps/app.py``'s callbacks, call for call: load_run, token_views,
   attention_views, expert_views, kv_views, code_views, anomaly_table, replay, compare), the runs table, and
   each query-layer / ``Run`` accessor alone, are timed on ``--samples`` random runs, each twice (a first
   and a repeated call): p50 / p95 / max in milliseconds. Target: p95 <= 150 ms.

With ``--write`` the tables go into benchmarks/RESULTS.md under "## Store at scale" (that section only).
``--db`` keeps (or reuses, if it exists) the synthetic database instead of a temporary one.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path

import numpy as np
import polars as pl

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

from workbench.data.rows import Rows  # noqa: E402
from workbench.data.schema import columns  # noqa: E402
from workbench.data.store import Store  # noqa: E402

SECTION = "## Store at scale"
KEYS = {"run_id", "pos", "step", "layer", "head", "slot"}
TARGET_MS = 150.0
TARGET_VALUES_S = 5e6


@dataclass
class Shape:
    """What a model's signal tables look like: the demo model's by default."""

    n_layers: int
    n_heads: int
    moe_layers: list[int]
    n_experts: int
    top_k: int
    kv_bytes_per_token: int  # per layer
    vocab: int
    max_seq_len: int
    config: dict

    @classmethod
    def demo(cls) -> "Shape":
        from dataclasses import asdict

        from workbench.model import ModelArgs

        a = ModelArgs.preset("demo")
        return cls(a.n_layers, a.n_heads, list(range(a.n_dense_layers, a.n_layers)), a.n_routed_experts,
                   a.n_activated_experts, (a.kv_lora_rank + a.qk_rope_head_dim) * 4, a.vocab_size, a.max_seq_len,
                   asdict(a))

    def summary(self) -> dict:
        from workbench.capture.adapters.base import ModelSummary
        return ModelSummary(family="deepseek_v3", backend="native", n_layers=self.n_layers, n_heads=self.n_heads,
                            n_kv_heads=1, vocab_size=self.vocab, max_seq_len=self.max_seq_len,
                            moe_layers=self.moe_layers, n_routed_experts=self.n_experts, n_shared_experts=1,
                            top_k=self.top_k, selection_bias=True).to_dict()


def vocab_texts(n: int, seed: int = 0) -> np.ndarray:
    """Short token texts (object array), some with spaces and newlines, as a byte-level BPE has."""
    rng = np.random.default_rng(seed)
    alphabet = list("abcdefghijklmnopqrstuvwxyz_()[]:=+-*/ ,.") + ["    ", "\n", " def", " return", " self"]
    return np.array(["".join(rng.choice(alphabet, rng.integers(1, 4))) for _ in range(n)], dtype=object)


def run_id_of(i: int, rng: random.Random) -> str:
    """An id like the recorder's (``"r"`` + 11 random hex digits): insertion order says nothing about it."""
    return "r" + "".join(rng.choice("0123456789abcdef") for _ in range(11))


def synth_run(rng: np.random.Generator, run_id: str, n_prompt: int, n_tokens: int, shape: Shape,
              texts: np.ndarray, created_at: datetime) -> dict[str, object]:
    """One finished run's rows, table by table, as the recorder hands them to the store (``Rows`` and frames)."""
    L, H, E, K = shape.n_layers, shape.n_heads, shape.n_experts, shape.top_k
    n_gen = n_tokens - n_prompt
    last_step = n_gen - 1
    fed = n_tokens - 1  # the last token is produced, never fed
    i32, f64 = np.int32, np.float64
    out: dict[str, object] = {}

    # runs: finished, anomalies detected
    params = {"max_new_tokens": n_gen, "temperature": 0.0, "top_p": 1.0, "topk": 5, "probes": [],
              "prompt_ids": [], "backend": "native"}
    out["runs"] = pl.DataFrame({
        "run_id": [run_id], "created_at": [created_at], "status": ["complete"], "model": ["data/demo"],
        "config": [json.dumps(shape.config)], "checkpoint_sha256": ["0" * 64], "dtype": ["float32"],
        "device": ["cpu"], "prompt": ["".join(texts[:n_prompt % 40 + 5])], "params": [json.dumps(params)],
        "seed": [0], "parent_run_id": [None], "finished_at": [created_at + timedelta(seconds=5)],
        "error": [None], "n_prompt_tokens": [n_prompt], "n_tokens": [n_tokens], "pid": [None],
        "summary": [json.dumps(shape.summary())], "notes": [None], "pid_start": [None],
        "detection": [json.dumps({"alpha": 0.01, "profile": "within-run"})],
    }, schema_overrides={"parent_run_id": pl.String, "error": pl.String, "pid": pl.Int32, "notes": pl.String,
                         "pid_start": pl.String, "n_prompt_tokens": pl.Int32, "n_tokens": pl.Int32})

    # tokens: position 0 has no prediction (a frame with NULLs), the others the distribution's statistics
    ids = rng.integers(0, shape.vocab, n_tokens).astype(i32)
    pos = np.arange(n_tokens, dtype=i32)
    step = np.where(pos < n_prompt, 0, pos - n_prompt).astype(i32)
    prob = rng.beta(2, 2, n_tokens)
    conf = np.maximum(prob, rng.beta(5, 2, n_tokens))
    topk_p = -np.sort(-rng.dirichlet(np.ones(6), n_tokens)[:, :5], axis=1) * 0.9
    topk_p[:, 0] = conf
    first = pl.DataFrame({"run_id": [run_id], "pos": [0], "step": [0], "token_id": [int(ids[0])],
                          "text": [texts[ids[0]]], "is_prompt": [True]},
                         schema_overrides={"pos": pl.Int32, "step": pl.Int32, "token_id": pl.Int32})
    rest = Rows(run_id, {
        "pos": pos[1:], "step": step[1:], "token_id": ids[1:], "text": texts[ids[1:]], "is_prompt": pos[1:] < n_prompt,
        "prob": prob[1:], "logprob": np.log(prob[1:]), "confidence": conf[1:],
        "entropy": rng.uniform(0, np.log(shape.vocab), n_tokens - 1), "rank": rng.integers(1, 6, n_tokens - 1).astype(i32),
        "topk_ids": rng.integers(0, shape.vocab, (n_tokens - 1, 5)).astype(i32), "topk_probs": topk_p[1:],
    }, dtypes={"text": pl.String, "topk_ids": pl.List(pl.Int32), "topk_probs": pl.List(pl.Float64)})
    out["tokens"] = [first, rest]

    # attention, head_norm: fed position x layer x head
    p = np.repeat(np.arange(fed, dtype=i32), L * H)
    lay = np.tile(np.repeat(np.arange(L, dtype=i32), H), fed)
    hd = np.tile(np.arange(H, dtype=i32), fed * L)
    ne = rng.beta(3, 2, p.size)
    ne[p == 0] = np.nan
    out["attention"] = Rows(run_id, {
        "pos": p, "layer": lay, "head": hd, "entropy": np.nan_to_num(ne) * np.log(p + 1.0), "norm_entropy": ne,
        "max_weight": rng.beta(2, 3, p.size), "sink_weight": rng.beta(1, 4, p.size)}, nan_to_null=("norm_entropy",))
    out["head_norm"] = Rows(run_id, {"pos": p, "layer": lay, "head": hd, "norm": rng.gamma(4, 2, p.size)})

    # routing: fed position x MoE layer x slot, K distinct experts per token and layer
    M = len(shape.moe_layers)
    choice = np.argsort(rng.random((fed * M, E)), axis=1)[:, :K].astype(i32)
    w = -np.sort(-rng.dirichlet(np.ones(K), fed * M), axis=1)
    out["routing"] = Rows(run_id, {
        "pos": np.repeat(np.arange(fed, dtype=i32), M * K),
        "layer": np.tile(np.repeat(np.asarray(shape.moe_layers, i32), K), fed),
        "slot": np.tile(np.arange(K, dtype=i32), fed * M), "expert": choice.ravel(), "weight": w.ravel(),
        "score": rng.beta(2, 5, fed * M * K), "margin": np.repeat(rng.exponential(0.05, fed * M), K)})

    # resid_norm: fed position x layer
    out["resid_norm"] = Rows(run_id, {"pos": np.repeat(np.arange(fed, dtype=i32), L),
                                      "layer": np.tile(np.arange(L, dtype=i32), fed),
                                      "norm": rng.gamma(9, 3, fed * L)})

    # kv: step x layer, the cache growing by one token a decode step
    s = np.repeat(np.arange(last_step + 1, dtype=i32), L)
    cached = (n_prompt + s).astype(i32)
    out["kv"] = Rows(run_id, {"step": s, "layer": np.tile(np.arange(L, dtype=i32), last_step + 1),
                              "cached_tokens": cached, "bytes": cached.astype(np.int64) * shape.kv_bytes_per_token})

    # kv_tokens: every cached token x layer after the prefill and after the last step
    parts = []
    for st, n in ((0, n_prompt), (last_step, n_prompt + last_step)):
        parts.append((np.full(n * L, st, i32), np.repeat(np.arange(L, dtype=i32), n), np.tile(np.arange(n, dtype=i32), L)))
    kst, kl, kp = (np.concatenate(x) for x in zip(*parts))
    out["kv_tokens"] = Rows(run_id, {"step": kst, "layer": kl, "pos": kp, "latent_norm": rng.gamma(6, 1, kp.size),
                                     "rope_norm": rng.gamma(3, 1, kp.size),
                                     "attn_received": rng.exponential(2.0, kp.size)})

    # steps
    out["steps"] = Rows(run_id, {
        "step": np.arange(last_step + 1, dtype=i32),
        "kind": np.array(["prefill"] + ["decode"] * last_step, dtype=object),
        "n_tokens": np.array([n_prompt] + [1] * last_step, i32),
        "wall_ms": np.concatenate([[n_prompt * 0.4], rng.gamma(8, 1.5, last_step)])}, dtypes={"kind": pl.String})

    # anomalies (derived, stored): a handful per run
    n_anom = int(rng.integers(0, 25))
    kinds = np.array(["low_confidence", "high_surprise", "entropy_spike", "diffuse_head", "routing_near_tie"])
    sev = np.array(["info", "warning", "critical"])
    out["anomalies"] = pl.DataFrame({
        "run_id": [run_id] * n_anom, "anomaly_id": np.arange(n_anom, dtype=i32),
        "kind": kinds[rng.integers(0, len(kinds), n_anom)], "severity": sev[rng.integers(0, 3, n_anom)],
        "pos": rng.integers(1, fed, n_anom).astype(i32), "layer": rng.integers(0, L, n_anom).astype(i32),
        "head": rng.integers(0, H, n_anom).astype(i32), "expert": pl.Series([None] * n_anom, dtype=pl.Int32),
        "score": rng.uniform(0, 10, n_anom), "threshold": np.full(n_anom, 3.0),
        "explanation": ["synthetic anomaly"] * n_anom})
    return out


def signal_values(batches: dict) -> int:
    """Values of a batch: rows x non-key columns (a top-k list counts as k values)."""
    from workbench.data.store import to_frame

    n = 0
    for table, b in batches.items():
        df = b if isinstance(b, pl.DataFrame) else to_frame(b)
        if df is None:
            continue
        for c in df.columns:
            if c in KEYS:
                continue
            n += int(df[c].list.len().sum()) if isinstance(df.schema[c], pl.List) else df.height
    return n


def _rows_values(b) -> int:
    """``signal_values`` without building frames (counted before the write, outside the timing)."""
    parts = b if isinstance(b, list) else [b]
    n = 0
    for p in parts:
        if isinstance(p, pl.DataFrame):
            n += signal_values({"frame": p})
            continue
        n += sum(int(np.prod(v.shape)) for c, v in p.cols.items() if c not in KEYS)
    return n


def build(store: Store, n_runs: int, n_tokens: int, shape: Shape, seed: int = 0, per_append: int = 1,
          progress: bool = True) -> dict:
    """Write ``n_runs`` synthetic runs, ``per_append`` runs per ``Store.append`` (one transaction); returns
    ingestion statistics."""
    rng = np.random.default_rng(seed)
    ids_rng = random.Random(seed)
    texts = vocab_texts(shape.vocab, seed)
    t0 = datetime(2025, 1, 1)
    gen_s = write_s = 0.0
    values = rows = 0
    run_ids = []
    merged: dict[str, list] = {}
    for i in range(n_runs):
        g = time.perf_counter()
        n_prompt = int(rng.integers(20, 201))
        n = max(n_prompt + 2, int(n_tokens + rng.integers(-n_tokens // 10, n_tokens // 10 + 1)))
        rid = run_id_of(i, ids_rng)
        run_ids.append(rid)
        b = synth_run(rng, rid, n_prompt, n, shape, texts, t0 + timedelta(minutes=i))
        values += sum(_rows_values(x) for t, x in b.items() if t not in ("runs",))
        rows += sum(sum(p.height for p in (x if isinstance(x, list) else [x])) for t, x in b.items())
        for t, x in b.items():
            merged.setdefault(t, []).extend(x if isinstance(x, list) else [x])
        gen_s += time.perf_counter() - g
        if (i + 1) % per_append and i + 1 < n_runs:
            continue
        w = time.perf_counter()
        store.append(merged)
        write_s += time.perf_counter() - w
        merged = {}
        if progress and (i + 1) % max(per_append, n_runs // 20) == 0:
            print(f"  {i + 1}/{n_runs} runs, {rows / 1e6:.1f}M rows, {values / write_s / 1e6:.2f}M values/s",
                  file=sys.stderr, flush=True)
    c = time.perf_counter()
    store.checkpoint()
    ck = time.perf_counter() - c
    return {"runs": n_runs, "rows": rows, "values": values, "write_s": write_s, "gen_s": gen_s, "checkpoint_s": ck,
            "values_per_s": values / (write_s + ck), "run_ids": run_ids, "per_append": per_append,
            "transactions": -(-n_runs // per_append)}


def recorder_pattern(store: Store, shape: Shape, n_tokens: int = 500, n_prompt: int = 100, seed: int = 1,
                     steps_per_commit: int = 32) -> dict:
    """One run written as the recorder's writer commits it: the prefill's rows, then decode steps
    ``steps_per_commit`` at a time, each one ``Store.append`` (runs row first, marked running)."""
    from workbench.data.store import to_frame

    rng = np.random.default_rng(seed)
    rid = "rpattern" + f"{seed:04d}"
    b = synth_run(rng, rid, n_prompt, n_tokens, shape, vocab_texts(shape.vocab), datetime(2025, 6, 1))
    runs = b.pop("runs").with_columns(pl.lit("running").alias("status"))
    b.pop("anomalies")
    frames = {t: to_frame(x) for t, x in b.items()}

    def step_of(t: str, df: pl.DataFrame) -> pl.Series:
        if "step" in df.columns:
            return df["step"]
        return (df["pos"] - n_prompt + 1).clip(0)  # the step that fed the position

    groups: dict[int, dict] = {}
    for t, df in frames.items():
        s = step_of(t, df)
        key = pl.when(s == 0).then(0).otherwise((s - 1) // steps_per_commit + 1)
        for (g,), part in df.with_columns(key.alias("_g")).partition_by("_g", as_dict=True).items():
            groups.setdefault(int(g), {})[t] = part.drop("_g")
    store.append({"runs": runs})
    values = sum(signal_values(g) for g in groups.values())
    w = time.perf_counter()
    for g in sorted(groups):
        store.append(groups[g])
    store.update_run(rid, status="complete", finished_at=datetime(2025, 6, 1))
    dt = time.perf_counter() - w
    return {"commits": len(groups), "values": values, "s": dt, "values_per_s": values / dt}


# -- the views ------------------------------------------------------------------------------------

def views(store: Store) -> dict[str, object]:
    """name -> fn(run_id, other_run_id): what the app computes (call for call, see apps/app.py) and the
    query-layer / Run calls alone."""
    from workbench.analysis.anomalies import select as select_anomalies
    from workbench.analysis.diff import diff_runs
    from workbench.analysis.replay import step_range
    from workbench.apps.app import run_choices, runs_table, strip_value
    from workbench.data import query
    from workbench.run import Run

    def load_run(rid, _):
        run = Run(store, rid)
        t = run.tokens()
        strip_value(t)
        run.summary()
        step_range(store, rid)
        run.fig_tokens()

    def token_views(rid, _):
        run = Run(store, rid)
        pos = int(run.info["n_prompt_tokens"])
        t = run.tokens()
        t.row(pos, named=True)
        run.fig_topk(pos), run.fig_token_heads(pos), run.fig_token_routing(pos)
        run.fig_attribution(pos), run.fig_components(pos)

    def attention_views(rid, _):
        run = Run(store, rid)
        run.model_summary
        run.fig_head_entropy(), run.fig_entropy_along(heads=None, normalised=False)

    def expert_views(rid, _):
        run = Run(store, rid)
        layers = sorted(set(run.expert_load()["layer"].to_list()))
        run.fig_expert_load(), run.fig_coactivation(layers[0]), run.fig_load_along(layers[0], 16)

    def kv_views(rid, _):
        run = Run(store, rid)
        run.fig_kv_bytes(), run.fig_kv_received(None)

    def code_views(rid, _):
        run = Run(store, rid)
        run.code_view(per_token=True), run.compile_check(), run.code_view(generated_only=True)
        run.fig_code_view(generated_only=True)

    def anomaly_table(rid, _):
        run = Run(store, rid)
        df = run.anomalies()
        run.findings()
        select_anomalies(df, None, "warning", [])

    def replay(rid, _):
        run = Run(store, rid)
        t = step_range(store, rid)[1] // 2
        st = run.at_step(t)
        strip_value(st.tokens)
        run.fig_tokens(step=t), run.fig_head_entropy(step=t), run.fig_expert_load(step=t), run.fig_kv_bytes(step=t)

    def compare(a, b):
        d = diff_runs(store, a, b)
        d.figures()

    def run_pick(rid, other):  # everything that runs when a run is picked (the .then chain of run_pick.change)
        load_run(rid, other), replay(rid, other), token_views(rid, other), attention_views(rid, other)
        expert_views(rid, other), kv_views(rid, other), code_views(rid, other)

    v: dict[str, object] = {
        "runs table (refresh_runs: runs_table + run_choices)": lambda r, o: (runs_table(store), run_choices(store)),
        "view: run picked (whole chain)": run_pick,
        "view: load_run": load_run, "view: replay": replay, "view: token_views": token_views,
        "view: attention_views": attention_views, "view: expert_views": expert_views, "view: kv_views": kv_views,
        "view: code_views": code_views, "view: anomaly_table": anomaly_table, "view: compare": compare,
        "query.runs": lambda r, o: query.runs(store),
        "query.run_row": lambda r, o: query.run_row(store, r),
    }
    for name in ("tokens", "attention", "routing", "kv", "kv_tokens", "steps", "resid_norm", "head_norm"):
        v[f"run.{name}()"] = (lambda n: lambda r, o: Run(store, r).signal(n))(name)
    v.update({
        "run.expert_load()": lambda r, o: Run(store, r).expert_load(),
        "run.anomalies() (stored)": lambda r, o: Run(store, r).anomalies(),
        "run.findings()": lambda r, o: Run(store, r).findings(),
        "run.at_step(mid)": lambda r, o: Run(store, r).at_step(step_range(store, r)[1] // 2),
        "query.head_entropy": lambda r, o: query.head_entropy(store, r),
        "query.token_heads": lambda r, o: query.token_heads(store, r, 50),
        "query.token_routing": lambda r, o: query.token_routing(store, r, 50),
        "query.coactivation": lambda r, o: query.coactivation(store, r, 1),
        "query.load_along_run": lambda r, o: query.load_along_run(store, r, 1, 16),
        "query.last_step": lambda r, o: query.last_step(store, r),
        "query.head_shift (a, b)": lambda r, o: query.head_shift(store, r, o),
        "query.routing_agreement (a, b)": lambda r, o: query.routing_agreement(store, r, o),
        "query.policy_results": lambda r, o: query.policy_results(store, r),
    })
    return v


def time_views(store: Store, run_ids: list[str], samples: int, seed: int = 0, only: list[str] | None = None,
               progress: bool = True) -> dict[str, dict]:
    """Each view on ``samples`` random runs, called twice per run (first, repeated); ms statistics."""
    rng = random.Random(seed)
    picked = [rng.choice(run_ids) for _ in range(samples)]
    others = [rng.choice(run_ids) for _ in range(samples)]
    out = {}
    for name, fn in views(store).items():
        if only and not any(o in name for o in only):
            continue
        fn(picked[0], others[0])  # warm-up: imports, first-call costs
        first, again = [], []
        for r, o in zip(picked, others):
            for acc in (first, again):
                t = time.perf_counter()
                fn(r, o)
                acc.append((time.perf_counter() - t) * 1e3)
        every = first + again
        q = statistics.quantiles(every, n=20, method="inclusive")
        out[name] = {"calls": len(every), "p50": statistics.median(every), "p95": q[18], "max": max(every),
                     "p95_first": statistics.quantiles(first, n=20, method="inclusive")[18] if len(first) > 1 else first[0]}
        if progress:
            s = out[name]
            print(f"  {name}: p50 {s['p50']:.1f} ms  p95 {s['p95']:.1f} ms  max {s['max']:.1f} ms", file=sys.stderr,
                  flush=True)
    return out


def load() -> str:
    try:
        return ", ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=2000)
    ap.add_argument("--tokens", type=int, default=500, help="tokens per run (about: +-10%%)")
    ap.add_argument("--db", default=None, help="keep (or reuse, if it exists) the synthetic store here")
    ap.add_argument("--samples", type=int, default=40, help="random runs per view (each called twice)")
    ap.add_argument("--only", nargs="*", default=None, help="time only views whose name contains one of these")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--per-append", type=int, default=50, help="runs per Store.append while building")
    ap.add_argument("--write", action="store_true", help="write the tables into benchmarks/RESULTS.md")
    args = ap.parse_args(argv)
    shape = Shape.demo()
    tmp = None
    if args.db:
        path = Path(args.db)
    else:
        tmp = Path(tempfile.mkdtemp(prefix="store_scale_"))
        path = tmp / "scale.duckdb"
    load0 = load()
    try:
        reused = path.exists()
        store = Store(path)
        if reused:
            ingest = None
            print(f"reusing {path}", file=sys.stderr)
        else:
            print(f"building {path}: {args.runs} runs x ~{args.tokens} tokens", file=sys.stderr)
            b = time.perf_counter()
            ingest = build(store, args.runs, args.tokens, shape, args.seed, per_append=args.per_append)
            ingest["build_s"] = time.perf_counter() - b
        side = path.with_name(path.stem + "-ingest")
        side.mkdir(exist_ok=True)
        try:  # the other write patterns, into stores of their own
            single = build(Store(side / "single.duckdb"), 40, args.tokens, shape, args.seed + 1, per_append=1,
                           progress=False)
            pattern = recorder_pattern(Store(side / "pattern.duckdb"), shape)
        finally:
            for p in side.glob("*"):
                Store(p).close() if p.suffix == ".duckdb" else None
            shutil.rmtree(side, ignore_errors=True)
        run_ids = store.sql("SELECT run_id FROM runs WHERE run_id <> 'rpattern0001' ORDER BY created_at")["run_id"].to_list()
        counts = store.sql("SELECT (SELECT count(*) FROM tokens) AS tokens, (SELECT count(*) FROM attention) AS attention,"
                           " (SELECT count(*) FROM routing) AS routing, (SELECT count(*) FROM head_norm) AS head_norm,"
                           " (SELECT count(*) FROM resid_norm) AS resid_norm, (SELECT count(*) FROM kv) AS kv,"
                           " (SELECT count(*) FROM kv_tokens) AS kv_tokens, (SELECT count(*) FROM steps) AS steps"
                           ).row(0, named=True)
        store.close()
        size = path.stat().st_size
        load1 = load()
        timings = time_views(store, run_ids, args.samples, args.seed, args.only)
        load2 = load()
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    text = report(args, shape, ingest, single, pattern, counts, size, timings, (load0, load1, load2), len(run_ids))
    print(text)
    if args.write:
        from results_md import write_section
        write_section(ROOT / "benchmarks" / "RESULTS.md", SECTION, text)
    return 0


def report(args, shape, ingest, single, pattern, counts, size, timings, loads, n_runs) -> str:
    import duckdb

    over = [k for k, s in timings.items() if s["p95"] > TARGET_MS]
    lines = [
        SECTION, "",
        f"`python benchmarks/store_scale.py --runs {args.runs} --tokens {args.tokens} --samples {args.samples}` "
        f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {platform.machine()}, {os.cpu_count()} cores shared "
        f"with other jobs, load average (1, 5, 15 min) {loads[0]} before the build, {loads[1]} before the timings, "
        f"{loads[2]} after; DuckDB {duckdb.__version__}, polars {pl.__version__}).", "",
        f"Synthetic store: {n_runs} finished runs of ~{args.tokens} tokens (prompt 20-200), demo-model shape "
        f"({shape.n_layers} layers x {shape.n_heads} heads, MoE layers {shape.moe_layers[0]}-{shape.moe_layers[-1]}: "
        f"{shape.n_experts} experts top-{shape.top_k}), generated with numpy and written through `Store.append`; "
        f"file {size / 2**30:.2f} GiB. Rows: " + ", ".join(f"{k} {v / 1e6:.2f}M" for k, v in counts.items()) + ".", "",
    ]
    def row(what, d):
        secs = d["write_s"] + d["checkpoint_s"]
        return (f"| {what} | {d['transactions']} | {d['values'] / 1e6:.1f}M | {secs:.1f} | "
                f"**{d['values_per_s'] / 1e6:.2f}M** |")

    lines += [
        "Ingestion through `Store.append` (values = rows x non-key columns; keys: run_id, pos, step, layer, head, "
        "slot; a top-k list counts as k values; the final checkpoint included):", "",
        "| pattern | transactions | values | seconds | values/s |", "|---|---|---|---|---|",
        *([row(f"build: {ingest['per_append']} runs per `append` (all their tables, one transaction)", ingest)]
          if ingest else []),
        row("one `append` per run (40 runs)", single),
        f"| the recorder's pattern: one 500-token run, prefill then 32 decode steps per `append` | "
        f"{pattern['commits']} | {pattern['values'] / 1e6:.2f}M | {pattern['s']:.2f} | "
        f"**{pattern['values_per_s'] / 1e6:.2f}M** |", "",
    ]
    if ingest:
        lines += [f"Build {ingest['build_s']:.0f} s in all (numpy generation {ingest['gen_s']:.0f} s, `append` "
                  f"{ingest['write_s']:.0f} s, final checkpoint {ingest['checkpoint_s']:.1f} s). Target >= "
                  f"{TARGET_VALUES_S / 1e6:.0f}M values/s.", ""]
    lines += [
        f"Views and queries, {args.samples} random runs each called twice (first call, then again): wall ms per "
        f"call, one thread of this process. Target p95 <= {TARGET_MS:.0f} ms.", "",
        "| call | calls | p50 ms | p95 ms | p95 first call ms | max ms |", "|---|---|---|---|---|---|",
        *[f"| {k} | {s['calls']} | {s['p50']:.1f} | {'**' if s['p95'] > TARGET_MS else ''}{s['p95']:.1f}"
          f"{'**' if s['p95'] > TARGET_MS else ''} | {s['p95_first']:.1f} | {s['max']:.1f} |" for k, s in timings.items()],
        "",
        (f"Over target (p95 > {TARGET_MS:.0f} ms): " + ", ".join(over) + ".") if over else
        f"Every call's p95 is within {TARGET_MS:.0f} ms.", "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
