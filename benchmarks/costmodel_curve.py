"""Learning curve of the cost model: accuracy on unseen tables against the number of shards measured.

`python -m benchmarks.costmodel_curve --run <data root> [--default-budget N]` trains the cost-model ensemble (the
pipeline's training, `costmodel.train.fit_ensemble`) on growing random subsets of a run's measured multi-table
training shards (every single-table shard is kept: they are cheap and always measured) and reports, on the run's
`unseen` split (tables no subset ever saw), compute MAPE and Spearman on every shard and on plan shards alone
(devices of greedy plans and their search neighbours: what the planners compare), and the Spearman of assembled
placements. Mean and spread over seeds per size. It shows where the default run's benchmark budget sits on the
curve: whether more shards would buy accuracy, or the labels' own noise (label_noise.md) is the floor. Give it a
run measured with a larger `bench_shards` than the default so the curve reaches past the default budget.
Writes benchmarks/results/costmodel_curve.md and .png.
"""
from __future__ import annotations

import argparse
import dataclasses
import os

import numpy as np
import pandas as pd

from .common import hardware, md_table, progress, pyplot, write_text

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
FRACTIONS = (0.125, 0.25, 0.5, 1.0)


def run(root: str, fractions=FRACTIONS, seeds: int = 3, members: int = 3) -> pd.DataFrame:
    from embshard.costmodel.data import load
    from embshard.costmodel.reference import AnalyticEstimator
    from embshard.costmodel.train import TrainParams, fit_ensemble
    from embshard.jobs.train_cost import evaluate

    data = load(os.path.join(root, "costs"), os.path.join(root, "tables.parquet"), seed=0)
    tr = data.index("train")
    multi = tr[np.array([len(data.shards[s]) >= 2 for s in tr])]
    rows = []
    for frac in fractions:
        for s in range(seeds if frac < 1.0 else 1):
            rng = np.random.default_rng(100 + s)
            split = data.split.copy()
            split[multi[rng.random(len(multi)) > frac]] = ""
            sub = dataclasses.replace(data, split=split)
            ens, _ = fit_ensemble(sub, TrainParams(seed=s), members)
            rep = evaluate(ens, sub, AnalyticEstimator().fit(sub, sub.index("train")))["unseen"]
            m = rep["learned_all_shards"]["total_compute"]
            plan = (rep.get("by_origin") or {}).get("plan") or {}
            kept = int(np.isin(multi, np.flatnonzero(split == "train")).sum())
            rows.append({"fraction": frac, "multi-table train shards": kept, "seed": s,
                         "compute MAPE %": m["mape"], "compute Spearman": m["spearman"],
                         "plan-shard MAPE %": plan.get("mape", np.nan),
                         "plan-shard Spearman": plan.get("spearman", np.nan),
                         "placement Spearman": rep["overall"]["max_of_device_totals"]["spearman"],
                         "interval coverage": rep["calibration"]["total_compute"]["coverage"]})
            progress(f"curve: {kept} multi-table training shards (seed {s}) -> unseen compute MAPE "
                     f"{m['mape']:.1f}%, Spearman {m['spearman']:.3f}")
    return pd.DataFrame(rows)


def summary(df: pd.DataFrame) -> pd.DataFrame:
    """Per size: the mean over seeds, and the standard deviation of the MAPE (how much one draw of shards
    moves it)."""
    g = df.groupby("fraction")
    out = g.mean(numeric_only=True).drop(columns="seed")
    out["MAPE sd over seeds"] = g["compute MAPE %"].std(ddof=0)
    out["seeds"] = g.size()
    return out.reset_index()


def plot(df: pd.DataFrame, path: str, hw_line: str, default_budget: int | None) -> str:
    plt = pyplot()
    g = summary(df)
    x = g["multi-table train shards"]
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    ax[0].errorbar(x, g["compute MAPE %"], yerr=g["MAPE sd over seeds"], fmt="o-", capsize=3, label="all shards")
    ax[0].plot(x, g["plan-shard MAPE %"], "s--", label="plan shards")
    ax[0].set(xscale="log", xlabel="multi-table training shards measured", ylabel="unseen compute MAPE %")
    ax[1].plot(x, g["compute Spearman"], "o-", label="shards")
    ax[1].plot(x, g["plan-shard Spearman"], "s--", label="plan shards")
    ax[1].plot(x, g["placement Spearman"], "^:", label="assembled placements")
    ax[1].set(xscale="log", xlabel="multi-table training shards measured", ylabel="Spearman on unseen tables")
    for a in ax:
        if default_budget:
            a.axvline(default_budget, color="grey", ls=":", lw=1)
        a.legend(fontsize=8)
    fig.suptitle("Cost-model learning curve (" + hw_line.split(";")[0] + "; dotted: the default run's budget)",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.costmodel_curve", description=__doc__.splitlines()[0])
    p.add_argument("--run", required=True, help="a pipeline run's data root (costs/, tables.parquet)")
    p.add_argument("--default-budget", type=int, default=None,
                   help="multi-table training shards of a default run, marked on the plot")
    p.add_argument("--seeds", type=int, default=3, help="draws of each subset size below the full set")
    p.add_argument("--out", default=RESULTS)
    args = p.parse_args(argv)
    os.environ.setdefault("EMBSHARD_NUM_THREADS", "1")
    df = run(args.run, seeds=args.seeds)
    hw_line = hardware().line()
    png = plot(df, os.path.join(args.out, "costmodel_curve.png"), hw_line, args.default_budget)
    text = "\n".join([
        "# Cost-model learning curve", "", f"Hardware: {hw_line}", "",
        f"The cost-model ensemble trained on random subsets of the measured multi-table training shards of "
        f"`{args.run}` (all single-table shards kept), evaluated on its `unseen` split (shards of tables no subset "
        "saw): compute (forward + backward) error on every unseen shard and on the unseen plan shards alone, and "
        "the Spearman of assembled placements. Mean over seeds per size, with the MAPE's standard deviation over "
        "seeds." + (f" A default run measures about {args.default_budget} multi-table training shards."
                    if args.default_budget else ""), "",
        md_table(summary(df), {"multi-table train shards": 0, "seeds": 0}), "",
        f"![curve]({os.path.basename(png)})"])
    write_text(os.path.join(args.out, "costmodel_curve.md"), text)
    progress(f"curve written to {args.out}/costmodel_curve.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
