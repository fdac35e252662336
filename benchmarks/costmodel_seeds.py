"""How much a cost model's accuracy on unseen tables depends on its split seed, with every table's own measurement
drawn into val/heldout like any shard (the former split) or kept in training (`costmodel.data.load`'s
`singles_train`, the default since 2026-12-07).

`python -m benchmarks.costmodel_seeds --data RUN_DATA [--refit] [--seeds 5] [--name PAGE]` trains the pipeline's
ensemble (`costmodel.train.fit_ensemble`, 3 members) on one run's measured costs (`--refit`: plus its round-2
measured plans, as the outer loop's refit) with split seeds 0..N-1, both ways, and scores each model on the run's
`unseen` split (test-pool tables, the same shards for every model): compute MAPE, the median signed error (a model
biased one way; a MAPE hides it), Spearman, and the same on plan shards. Side by side in one run, same data; no
kernel is measured. Writes benchmarks/results/costmodel_seeds.md (or --name).
"""
from __future__ import annotations

import argparse
import os

import numpy as np
import pandas as pd

from .common import hardware, md_table, progress, write_text

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def run(data_dir: str, seeds: int = 5, refit: bool = False, members: int = 3, score_dir: str | None = None,
        rules: tuple = (False, True)) -> pd.DataFrame:
    """`score_dir`: another run's data folder to score on (its unseen shards; default `data_dir`'s), e.g. an FP16
    run's, to see how models trained on FP32 tables alone price FP16 ones. `rules`: the singles_train values."""
    from embshard.costmodel.data import load
    from embshard.costmodel.reference import AnalyticEstimator
    from embshard.costmodel.train import TrainParams, fit_ensemble
    from embshard.jobs.train_cost import evaluate, predict_rows

    costs = [os.path.join(data_dir, "costs")]
    if refit:
        costs.append(os.path.join(data_dir, "policy", "measured-round-2", "costs"))
    tables = os.path.join(data_dir, "tables.parquet")
    scored = None if score_dir is None else load(os.path.join(score_dir, "costs"),
                                                 os.path.join(score_dir, "tables.parquet"))
    rows = []
    for singles in rules:
        for seed in range(seeds):
            data = load(costs, tables, seed=seed, singles_train=singles)
            ens, _ = fit_ensemble(data, TrainParams(seed=seed), members)
            on = data if scored is None else scored
            rep = evaluate(ens, on, AnalyticEstimator().fit(on, on.index("train")))["unseen"]
            m = rep["learned_all_shards"]["total_compute"]
            plan = (rep.get("by_origin") or {}).get("plan") or {}
            idx = on.index("unseen")
            pred, true = predict_rows(ens, on, idx)[:, :2].sum(1), on.targets[idx, :2].sum(1)
            ok = true > 0
            signed = float(np.median(pred[ok] / true[ok] - 1) * 100)
            row = {"split": "tables alone train" if singles else "former (drawn like any shard)",
                   "seed": seed, "val shards": int((data.split == "val").sum()),
                   "unseen compute MAPE %": m["mape"], "median signed error %": signed,
                   "Spearman": m["spearman"], "plan-shard MAPE %": plan.get("mape", np.nan)}
            half = on.holds_fp16[idx] if on.holds_fp16 is not None else np.zeros(len(idx), dtype=bool)
            if half.any():  # the weight types apart: a type the model never measured is priced from its bytes
                for name, sel in (("FP16-holding", half & ok), ("FP32-only", ~half & ok)):
                    row[f"{name} signed %"] = float(np.median(pred[sel] / true[sel] - 1) * 100)
            rows.append(row)
            progress(f"costmodel_seeds: {rows[-1]['split']}, seed {seed}: unseen MAPE {m['mape']:.1f}%, median "
                     f"signed {signed:+.1f}%")
    return pd.DataFrame(rows)


def summary(df: pd.DataFrame) -> pd.DataFrame:
    """Per split rule: the range over seeds of each score."""
    out = []
    for rule, g in df.groupby("split", sort=False):
        row = {"split": rule, "seeds": len(g)}
        for col in ("unseen compute MAPE %", "median signed error %", "Spearman", "plan-shard MAPE %",
                    "FP16-holding signed %", "FP32-only signed %"):
            if col in g:
                row[col] = f"{g[col].min():.3g} to {g[col].max():.3g}"
        out.append(row)
    return pd.DataFrame(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.costmodel_seeds", description=__doc__.split("\n")[0])
    ap.add_argument("--data", required=True, help="a pipeline run's data folder (tables.parquet + costs/)")
    ap.add_argument("--refit", action="store_true", help="add its round-2 measured plans (the outer loop's refit)")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--score", default=None, help="score on this run data folder's unseen shards instead (e.g. an "
                                                  "FP16 run's)")
    ap.add_argument("--only-new", action="store_true", help="only the current rule (every table alone trains)")
    ap.add_argument("--name", default="costmodel_seeds")
    ap.add_argument("--out", default=RESULTS)
    args = ap.parse_args(argv)
    df = run(args.data, seeds=args.seeds, refit=args.refit, score_dir=args.score,
             rules=(True,) if args.only_new else (False, True))
    what = "benchmark costs and round-2 measured plans (the refit)" if args.refit else "benchmark costs"
    where = f"`{os.path.relpath(args.score)}`'s" if args.score else "the run's"
    lines = ["# Cost model: accuracy on unseen tables by split seed", "", hardware().line(), "",
             f"Ensembles of 3 members (the pipeline's) trained on `{os.path.relpath(args.data)}`'s {what}, split "
             f"seeds 0-{args.seeds - 1}, each scored on {where} `unseen` shards (test-pool tables; the same shards "
             "for every model; shards holding an FP16 table apart where there are). `former`: every shard, a "
             "table measured alone included, drawn into train 70% / val 15% / "
             "heldout 15%; `tables alone train`: each table's own measurement always trains (the default). "
             "Signed error: prediction / measured - 1, median (positive: priced too dear). "
             f"`python -m benchmarks.costmodel_seeds --data {os.path.relpath(args.data)}"
             f"{' --refit' if args.refit else ''}{' --score ' + os.path.relpath(args.score) if args.score else ''}"
             f"{' --only-new' if args.only_new else ''}`.", "", "## Range over seeds", "",
             md_table(summary(df)), "", "## Every model", "", md_table(df), ""]
    os.makedirs(args.out, exist_ok=True)
    write_text(os.path.join(args.out, f"{args.name}.md"), "\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
