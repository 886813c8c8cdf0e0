"""workbench profile: record a calibration set with a model and store its baseline profile."""
from __future__ import annotations

import json

from workbench.analysis.baseline import export_profile, profile
from workbench.data.store import Store


def main(args) -> int:

    res = profile(args.prompts, model=args.model, db=args.db, max_new_tokens=args.max_new_tokens,
                  tokenizer=args.tokenizer, progress=True)
    if args.out:
        export_profile(Store(args.db), res["sha"], args.out)
    out = {"checkpoint_sha256": res["sha"], "runs": len(res["runs"]), "cells": res["cells"],
           "components": res["components"], "source": res["source"]}
    print(json.dumps(out))
    return 0
