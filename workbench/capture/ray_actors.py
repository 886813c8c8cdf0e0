"""A prompt set on Ray: ``workbench record --prompts FILE --ray [ADDRESS] --workers N --out DIR``.

Ray Data runs the set's prompts on an actor pool of ``workers`` actors (``ActorPoolStrategy``). Each actor
loads the model once, takes one GPU when the cluster has GPUs (else one CPU, with torch on one thread),
records each block of prompts (``batch_size``, similar lengths) as one batched generation into its own
temporary DuckDB file (``workbench.capture.prompt_sets.record_group``) and writes the
finished run into ``DIR`` as Parquet shards with ``workbench.data.export.write_run``: every file under a
temporary name moved into place, then the run's completion marker. A killed actor leaves no half-written
run (readers skip runs without a marker) and running the command again records only the prompts without a
``complete`` run in the batch. Needs ``pip install 'moe-workbench[ray]'`` (``ray[data]``).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from workbench.capture.prompt_sets import Bars, completed, flush_run, groups, load_model, record_group
from workbench.capture.settings import RecordSettings
from workbench.data.store import Store


class ShardWorker:
    """One Ray actor: the model loaded once, a temporary store; ``__call__`` records a batch of prompts."""

    def __init__(self, out: str, batch_id: str, model, tokenizer, settings: RecordSettings, after_run, threads: int):
        if threads > 0:
            torch.set_num_threads(threads)
        self.out, self.batch_id, self.after_run, self.settings = out, batch_id, after_run, settings
        device = "cuda" if torch.cuda.is_available() else "cpu"
        self.adapter, self.tokenizer, self.label = load_model(model, tokenizer, settings)
        if device == "cuda":
            self.adapter.module.to(device)
        self.tmp = Path(tempfile.mkdtemp(prefix="wb-ray-shard-"))
        self.store = Store(self.tmp / "shard.duckdb")

    def __call__(self, batch: dict) -> dict:

        rows: dict[str, list] = {"run_id": [], "key": [], "status": [], "n_tokens": [], "generated": [], "error": []}
        items = [json.loads(str(text)) for text in list(batch["item"])]
        for group in groups(items, self.tokenizer, len(items)):
            for row in record_group(group, store=self.store, batch_id=self.batch_id, adapter=self.adapter,
                                    tokenizer=self.tokenizer, label=self.label, settings=self.settings,
                                    after_run=self.after_run):
                flush_run(self.store, self.out, row["run_id"])
                for k in rows:
                    rows[k].append(row[k])
        return rows

    def __del__(self):
        try:
            self.store.close()
            shutil.rmtree(self.tmp, ignore_errors=True)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def record_many_ray(items: list[dict], *, out, batch_id: str, model=None, tokenizer=None, settings: RecordSettings,
                    after_run=None, progress: bool = True, address: str | None = None,
                    workers: int = 1, batch_size: int = 8) -> list[dict]:
    """Record the prompts of ``items`` not yet complete in ``out`` on a Ray Data actor pool; returns the rows
    (run_id, key, status, n_tokens, generated, error) of the prompts recorded."""
    try:
        import ray  # optional: pip install 'moe-workbench[ray]'
        import ray.data  # optional: as above
    except ImportError:
        raise ValueError("--ray needs Ray: pip install 'moe-workbench[ray]' (ray[data])") from None

    out = str(Path(out).resolve())
    Path(out).mkdir(parents=True, exist_ok=True)
    done = completed(None, out, batch_id)
    todo = [d for d in items if d["key"] not in done]
    if not todo:
        return []
    if isinstance(model, (str, Path)):
        model = str(Path(model).resolve())
    if isinstance(tokenizer, (str, Path)):
        tokenizer = str(Path(tokenizer).resolve())
    started = False
    if not ray.is_initialized():
        kw = {"address": address} if address else {"num_cpus": max(workers, 1)}
        ray.init(ignore_reinit_error=True, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"GRADIO_ANALYTICS_ENABLED": "False"}}, **kw)
        started = True
    try:
        ctx = ray.data.DataContext.get_current()
        ctx.enable_progress_bars = False
        gpus = float(ray.cluster_resources().get("GPU", 0))
        per = {"num_gpus": 1} if gpus >= 1 else {"num_cpus": 1}
        # prompts of similar length in one block (by characters: the driver loads no model or tokenizer); an
        # actor records a block in batched generations (workbench.capture.prompt_sets.groups)
        ordered = sorted(todo, key=lambda d: len(d["prompt"]))
        block = max(1, min(batch_size, -(-len(ordered) // workers)))  # every worker gets some when there are few
        ds = ray.data.from_items([{"item": json.dumps(d)} for d in ordered],
                                 override_num_blocks=-(-len(ordered) // block))
        res = ds.map_batches(ShardWorker, batch_size=block, compute=ray.data.ActorPoolStrategy(size=workers),
                             fn_constructor_kwargs={"out": out, "batch_id": batch_id, "model": model,
                                                    "tokenizer": tokenizer, "settings": settings, "after_run": after_run,
                                                    "threads": 1 if not gpus else 0},
                             batch_format="numpy", **per)
        bars = Bars(len(todo), sum(int(d.get("max_new_tokens", settings.max_new_tokens)) for d in todo),
                    f"ray x{workers}", progress)
        rows = []
        try:
            for r in res.iter_rows():
                r = {k: (v.item() if hasattr(v, "item") else v) for k, v in r.items()}
                rows.append(r)
                bars.done(r, int(r["generated"]))
        finally:
            bars.close()
        return rows
    finally:
        if started and not os.environ.get("WORKBENCH_RAY_KEEP"):
            ray.shutdown()
