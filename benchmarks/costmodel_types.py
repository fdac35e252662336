"""Two registered cost models' compute error by weight type, on the same measured shards (FP16 against FP32).

`python -m benchmarks.costmodel_types --run runs/local --a models:/embshard-cost/1 --b models:/embshard-cost/4
[--b ...] [--data DIR] [--note TEXT] [--name PAGE]`

A model's features carry a table's bytes, not its type, so a model measured on FP32 tables alone prices an FP16
one as some FP32 table of half the rows. This page scores A and B on one pipeline run's measured shards (`--data`:
a run data folder whose tables hold FP16 ones, default the newest such run of `--run`), on its `unseen` shards:
those made only of tables of the test pool, which no model of the run's seed trains on (the `heldout` split of
seen tables is a random draw over the costs a model was fitted on: a refit's includes its round's measured plans,
so a draw over the first costs alone would score shards it trained on). The shards holding an FP16 table are
apart from the FP32-only ones: MAPE of forward + backward compute, and the median signed
error (a model that never measured FP16 is biased, which a MAPE hides). Writes costmodel_types.md (or --name)
under --out.
"""
from __future__ import annotations

import argparse
import glob
import os
import sys

import numpy as np
import pandas as pd

from .common import hardware, md_table, progress, write_text


def fp16_run_data(run: str) -> str:
    """The newest run data folder of `run` whose tables hold FP16 ones (run_layout's data/<run id>/)."""
    from embshard import schemas

    folders = sorted(glob.glob(os.path.join(run, "data", "*", "tables.parquet")), key=os.path.getmtime, reverse=True)
    for path in folders:
        if (schemas.read(path, "tables")["bytes_per_element"] == 2).any():
            return os.path.dirname(path)
    raise SystemExit(f"no run under {run}/data has FP16 tables: run the pipeline with fp16_fraction > 0, or give "
                     "--data")


def rows(name: str, model, data, split: str) -> list[dict]:
    """The report's weight-type breakdown (train_cost.element_breakdown) plus the median signed error."""
    from embshard.jobs.train_cost import element_breakdown, predict_rows

    idx = data.index(split)
    learned = predict_rows(model, data, idx)
    by_type = element_breakdown(learned, data, idx)
    pred, true = learned[:, :2].sum(1), data.targets[idx, :2].sum(1)
    half = data.holds_fp16[idx]
    out = []
    for group, key, sel in (("holds an FP16 table", "holds_fp16", half), ("FP32 only", "fp32_only", ~half)):
        if not sel.any():
            continue
        m = by_type[key]
        ok = true[sel] > 0
        signed = float(np.median(pred[sel][ok] / true[sel][ok] - 1) * 100) if ok.any() else float("nan")
        out.append({"model": name, "split": split, "shards": group, "n": int(sel.sum()), "compute MAPE %": m["mape"],
                    "median signed error %": signed,
                    "Spearman": m["spearman"]})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.costmodel_types", description=__doc__.split("\n")[0])
    ap.add_argument("--run", required=True, help="the pipeline folder whose registry holds both models")
    ap.add_argument("--a", required=True, help="cost model A, e.g. models:/embshard-cost/1")
    ap.add_argument("--b", required=True, action="append", help="cost model B (repeatable: each is scored)")
    ap.add_argument("--data", default=None, help="a run data folder (tables.parquet + costs/); default: the newest "
                                                 "of --run with FP16 tables")
    ap.add_argument("--note", default="", help="a sentence for the page: where A and B come from")
    ap.add_argument("--name", default="costmodel_types", help="page name (default costmodel_types)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = ap.parse_args(argv)
    os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{os.path.abspath(args.run)}/mlflow.db")
    from embshard.costmodel import load as load_model
    from embshard.costmodel.data import load as load_data

    folder = args.data or fp16_run_data(args.run)
    data = load_data(os.path.join(folder, "costs"), os.path.join(folder, "tables.parquet"))
    table = []
    for name in (args.a, *args.b):
        progress(f"costmodel_types: scoring {name} on {folder}")
        model = load_model(name)
        table += rows(name, model, data, "unseen")
    frame = pd.DataFrame(table)
    lines = ["# Cost-model error by weight type (FP16 against FP32)", "", hardware().line(), "",
             f"A = `{args.a}`, B = {', '.join(f'`{b}`' for b in args.b)}, scored on the measured shards of "
             f"`{os.path.relpath(folder)}` "
             f"({data.hardware}, {data.backend}, batch {data.batch_size}) made only of tables of the test pool "
             "(`unseen`: no model of the run's seed trains on them). Compute = forward + backward; the signed error "
             "is prediction / measured - 1 (negative: priced too cheap).", ""]
    if args.note:
        lines += [args.note, ""]
    lines += [md_table(frame, {"n": 0}), ""]
    os.makedirs(args.out, exist_ok=True)
    write_text(os.path.join(args.out, f"{args.name}.md"), "\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
