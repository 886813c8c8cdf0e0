"""workbench eval: recompute the model card's numbers (bits per byte, expert load, sample) on validation."""
from __future__ import annotations

import json
import sys
import time

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from workbench.model.evaluate import evaluate


class Progress:
    """``workbench eval``'s progress on stderr: a line as each step starts, with the time so far, and, while the model
    scores the validation windows (the long step), a line every ``EVERY`` seconds with an estimate of the rest."""

    EVERY = 5.0

    def __init__(self, out=None):
        self.out = out or sys.stderr
        self.t0 = time.monotonic()
        self.step_t0, self.last = self.t0, 0.0

    def _print(self, text: str) -> None:
        print(f"eval: {text} ({time.monotonic() - self.t0:.0f} s)", file=self.out, flush=True)

    def step(self, text: str) -> None:
        self.step_t0 = self.last = time.monotonic()
        self._print(text)

    def batch(self, done: int, total: int) -> None:
        now = time.monotonic()
        if done < total and now - self.last < self.EVERY:
            return
        self.last = now
        left = (now - self.step_t0) / done * (total - done)
        self._print(f"  window batch {done}/{total}" + (f", about {left:.0f} s left" if done < total else ""))


def main(args) -> int:

    progress = Progress()
    r = evaluate(args.model, max_tokens=args.max_tokens, progress=progress.step, on_batch=progress.batch)
    progress._print("done")
    if args.json:
        print(json.dumps(r))
        return 0

    console = Console()
    cap = f", capped at {r['max_tokens']}" if r["capped"] else ""
    held = ", ".join(r.get("validation_packages", []))
    t = Table(title=escape(f"bits per byte on {r['validation_files']} files of the held-out packages {held} "
                           f"({r['tokens_scored']} tokens, {r['bytes_scored']} bytes{cap})"))
    for c in ("method", "bits/byte", "bits/token"):
        t.add_column(c, justify="right" if c != "method" else "left")
    bpt = r["bits_per_token"]
    for name, label in (("model", f"model ({r['window']}-token windows)"),
                        ("bigram", f"token bigram (k={r['bigram_k']:g})"), ("gzip", "gzip -9")):
        t.add_row(escape(label), f"{r['bits_per_byte'][name]:.3f}", f"{bpt[name]:.3f}" if name in bpt else "")
    console.print(t)
    if r.get("by_package"):
        t = Table(title=f"per held-out package (model / gzip -9 overall: {r['model_vs_gzip']:.3f})")
        for c in ("package", "version", "tokens", "bytes", "model bits/byte", "gzip -9", "model / gzip"):
            t.add_column(c, justify="left" if c in ("package", "version") else "right")
        for p in r["by_package"]:
            t.add_row(escape(p["package"]), escape(p["version"]), str(p["tokens"]), str(p["bytes"]),
                      f"{p['model']:.3f}", f"{p['gzip']:.3f}", f"{p['model'] / p['gzip']:.3f}")
        console.print(t)

    if r["expert_load"]:
        # experts as rows, MoE layers as columns: fits an 80-column terminal
        loads = r["expert_load"]
        n = len(loads[0]["share"])
        t = Table(title=f"routed-slot share per expert, as a multiple of uniform (1/{n})")
        t.add_column("expert", justify="right")
        for row in loads:
            t.add_column(f"layer {row['layer']}", justify="right")
        for j in range(n):
            t.add_row(str(j), *(f"{row['share'][j] * n:.2f}" for row in loads))
        t.add_row("min", *(f"{row['min_share_vs_uniform']:.2f}" for row in loads), style="bold")
        console.print(t)

    s = r["sample"]
    console.print(f"[bold]greedy continuation ({s['tokens']} tokens)[/bold]")
    console.print(escape(s["prompt"] + s["continuation"]), highlight=False)
    comps = r.get("completions", [])
    if comps:
        console.print(f"[bold]greedy completions of the prompt files: {r['completions_parsing']} of {len(comps)} "
                      "parse once closed[/bold]")
        for c in comps:
            verdict = "parses" if c["parses"] else f"{c['valid_lines']} of {c['lines']} lines parse; {c['error']}"
            console.print(f"[bold]{escape(c['file'])}[/bold] ({escape(verdict)})")
            console.print(escape(c["prompt"] + c["continuation"]), highlight=False)
    console.print(f"[dim]{r['wall_s']} s[/dim]")
    return 0
