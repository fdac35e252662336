"""The split suite as one suite: each run's learned (and refined) plans / TorchRec's full plan over every task of
every table list, from the runs' raw rows (`raw/quality_splits.csv`, written by the harness).

Issue 24 asks for learned <= 0.70x TorchRec full "on the splitting suite"; the split page gives each table list
and, since this session, that pooled row too. This reads the rows of runs measured before the page had it:

    python -m benchmarks.split_pooled benchmarks/results/split_runs/*/raw/quality_splits.csv
"""
from __future__ import annotations

import argparse
import json
import os

import numpy as np
import pandas as pd

from .common import md_table

LIST_COLUMNS = ("round_costs_ms", "ratios_to_best_baseline")


def read_raw(path: str) -> pd.DataFrame:
    """A harness raw CSV with its per-round lists (stored as JSON text) back as lists."""
    frame = pd.read_csv(path)
    for col in frame.columns:
        if col.endswith("_round_ratios") or col in LIST_COLUMNS:
            frame[col] = [json.loads(v) if isinstance(v, str) and v.startswith("[") else v for v in frame[col]]
    return frame


def pooled(frame: pd.DataFrame) -> dict:
    """The pooled row of one run (quality.vs_torchrec_full_row over every task, the widest list floor), and the
    hot-table list's own median for contrast."""
    from .quality import AA_PLANNER, REFINED, vs_torchrec_full_row, whole_suite_floor

    row = vs_torchrec_full_row("all", frame, whole_suite_floor(frame))
    hot = frame[frame["suite"].str.startswith("hot table")]
    out = {"tasks": row["tasks"], "learned / torchrec_full [95% CI]": row["learned / torchrec_full [95% CI]"],
           "learned verdict": row["learned verdict"]}
    if f"{REFINED} / torchrec_full [95% CI]" in row:
        out[f"{REFINED} / torchrec_full [95% CI]"] = row[f"{REFINED} / torchrec_full [95% CI]"]
    out["A/A floor (widest list)"] = row[f"A/A floor ({AA_PLANNER}) [95% CI]"]
    if len(hot):
        out["hot-table list alone (learned)"] = vs_torchrec_full_row("hot", hot, (np.nan,) * 3)[
            "learned / torchrec_full [95% CI]"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.split_pooled", description=__doc__.splitlines()[0])
    p.add_argument("csv", nargs="+", help="raw/quality_splits.csv files of split-suite runs")
    args = p.parse_args(argv)
    rows = [{"run": os.path.basename(os.path.dirname(os.path.dirname(os.path.abspath(f)))), **pooled(read_raw(f))}
            for f in args.csv]
    print(md_table(pd.DataFrame(rows)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
