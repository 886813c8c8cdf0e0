"""workbench report: write a run's anomaly report (self-contained HTML, JSON or Markdown)."""
from __future__ import annotations

from workbench.run import Workbench
from workbench.views.report import write_report


def main(args) -> int:

    run = Workbench(args.db).run(args.run_id)
    path = write_report(run, args.out, args.format, explain=getattr(args, "explain", 3))
    print(path)
    return 0
