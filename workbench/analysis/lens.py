"""The logit lens: where in depth each token of a run was decided.

The run's tokens go through the model once, teacher-forced (a full forward from position 0), with a forward
hook on every block (``Adapter.blocks()``) keeping the residual stream after it. Each block's stream goes
through what the model does after its last block (``Adapter.lens_logits``: the final norm, the unembedding, a
family's logit softcap or scale), as if that block were the last; the distribution at position ``p - 1``
scores the run's token at ``p``, the row ``pos = p`` (the ``tokens`` table's convention: its ``prob`` is under
the distribution at ``pos - 1``). At the last block this is the model's own output distribution. A run recorded
under interventions (``workbench.interventions``: a child run) is re-run under them.

Stored in the ``logit_lens`` table (docs/schema.md), computed on the first call and read back afterwards.
"""
from __future__ import annotations

from datetime import datetime, timezone
from typing import Callable, Iterable

import polars as pl
import torch

from workbench.capture.adapters import Adapter, adapter_for
from workbench.capture import interventions
from workbench.capture.adapters.base import first_output
from workbench.capture.resolve import load_for_run, run_tokenizer
from workbench.data import query
from workbench.probes.signals import token_confidence

COLUMNS = ["pos", "layer", "token_id", "prob", "rank", "top_token_id", "top_prob", "top_text"]
ROWS = 256  # positions unembedded at once: [ROWS, V] fp32 temporaries per layer


def residual_streams(adapter: Adapter, ids: list[int]) -> list[torch.Tensor]:
    """The residual stream after each block [T, D] on ``ids`` (one forward, no gradients; a block run more than
    once per forward keeps its last pass)."""
    streams: dict[int, torch.Tensor] = {}
    handles = [b.register_forward_hook(lambda _m, _a, out, i=i: streams.__setitem__(i, first_output(out).detach()))
               for i, b in enumerate(adapter.blocks())]
    try:
        with torch.no_grad(), adapter._without_cache():
            adapter.forward(torch.tensor([list(ids)], device=adapter.device))
    finally:
        for h in handles:
            h.remove()
    missing = [i for i in range(len(adapter.blocks())) if i not in streams]
    if missing:
        raise RuntimeError(f"blocks {missing} did not run in the forward: no residual stream to read")
    return [streams[i][0] for i in range(len(streams))]


def compute(model, ids: list[int], tokenizer=None) -> pl.DataFrame:
    """The logit lens of ``ids`` under ``model`` (module or adapter): ``COLUMNS``, one row per produced position
    (1 .. T-1) x layer, ordered by pos then layer. ``tokenizer``: decodes ``top_text`` (None: null)."""
    adapter = adapter_for(model)
    ids = [int(i) for i in ids]
    if len(ids) < 2:
        raise ValueError(f"the logit lens needs at least 2 tokens (a position and the token after it), got {len(ids)}")
    streams = residual_streams(adapter, ids)
    produced = torch.tensor(ids[1:])
    parts = []
    with torch.no_grad():
        for layer, h in enumerate(streams):
            for start in range(0, len(ids) - 1, ROWS):
                stop = min(start + ROWS, len(ids) - 1)
                logits = adapter.lens_logits(h[start:stop]).cpu()
                c = token_confidence(logits, produced[start:stop], k=1)
                parts.append(pl.DataFrame({
                    "pos": pl.Series(range(start + 1, stop + 1), dtype=pl.Int32),
                    "layer": pl.Series([layer] * (stop - start), dtype=pl.Int32),
                    "token_id": pl.Series(ids[start + 1: stop + 1], dtype=pl.Int32),
                    "prob": c["prob"], "rank": c["rank"], "top_token_id": c["topk_ids"][:, 0],
                    "top_prob": c["topk_probs"][:, 0]}))
    df = pl.concat(parts).sort("pos", "layer")
    tops = sorted(set(df["top_token_id"].to_list()))
    texts = {i: tokenizer.decode([i]) for i in tops} if tokenizer is not None else {}
    return df.with_columns(pl.col("top_token_id").replace_strict(texts, default=None, return_dtype=pl.Utf8)
                           .alias("top_text")).select(COLUMNS)


def positions(pos: int | Iterable[int] | None, n_tokens: int, run_id: str = "") -> list[int] | None:
    """The positions asked for (None: every one), each checked to be in 1 .. n_tokens - 1."""
    if pos is None:
        return None
    want = [query.as_position(p) for p in ([pos] if isinstance(pos, int) or hasattr(pos, "__index__") else pos)]
    bad = [p for p in want if not 1 <= p < n_tokens]
    if bad:
        raise ValueError(f"pos {bad[0]} is outside run {run_id}'s produced positions 1..{n_tokens - 1} (position 0 "
                         "has no preceding context)")
    return want


def stored(store, run_id: str) -> pl.DataFrame:
    """The run's stored logit-lens rows (``COLUMNS``), ordered by pos and layer; empty if never computed."""
    return query.table(store, "logit_lens", run_id, "pos, layer", cols=COLUMNS)


def logit_lens(store, run_id: str, pos: int | Iterable[int] | None = None, *,
               adapter: Adapter | Callable[[], Adapter] | None = None, tokenizer=None,
               recompute: bool = False) -> pl.DataFrame:
    """The logit lens of a recorded run at ``pos`` (a position, several, or None: all), with the produced token's
    ``text``: the stored rows when they cover the positions asked for, else computed with the model and stored.

    Args:
        adapter: the model, or a function returning it (called only when the rows must be computed); None
            reloads the run's checkpoint (hash-checked, ``workbench.capture.resolve.load_for_run``).
        tokenizer: decodes ``top_text`` (likewise a function, or None for the run's own, ``run_tokenizer``).
        recompute: compute and store anew even if rows are stored.
    """
    tokens = query.table(store, "tokens", run_id, "pos", cols=["pos", "token_id", "text"])
    want = positions(pos, tokens.height, run_id)
    rows = pl.DataFrame() if recompute else stored(store, run_id)
    need = set(range(1, tokens.height)) if want is None else set(want)
    if not rows.height or not need <= set(rows["pos"].unique().to_list()):
        rows = _compute_and_store(store, run_id, tokens["token_id"].to_list(), adapter, tokenizer)
    if want is not None:
        rows = rows.filter(pl.col("pos").is_in(want))
    return rows.join(tokens.select("pos", "text"), on="pos", how="left")


def _compute_and_store(store, run_id: str, ids: list[int], adapter, tokenizer) -> pl.DataFrame:
    info = query.run_row(store, run_id)
    model = adapter() if callable(adapter) and not isinstance(adapter, (Adapter, torch.nn.Module)) else adapter
    model = model if model is not None else load_for_run(info)
    try:  # texts are a convenience (ids are the facts): no tokenizer here leaves top_text null
        if callable(tokenizer) and not hasattr(tokenizer, "decode"):
            tok = tokenizer()
        else:
            tok = tokenizer if tokenizer is not None else run_tokenizer(info)
    except (OSError, ValueError):
        tok = None
    adapter = adapter_for(model)
    with interventions.applied(adapter, interventions.of_run(store, run_id)):  # a child run's own edits
        df = compute(adapter, ids, tok)
    stamp = datetime.now(timezone.utc).replace(tzinfo=None)
    store.replace_rows("logit_lens", {"run_id": run_id},
                       df.with_columns(pl.lit(run_id).alias("run_id"), pl.lit(stamp).alias("created_at")))
    return df
