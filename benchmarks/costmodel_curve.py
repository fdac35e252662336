"""Learning curve of the cost model: accuracy on unseen tables against the number of shards measured.

`python -m benchmarks.costmodel_curve --run runs/local/data/<run>` trains the cost-model ensemble (the pipeline's
training, `costmodel.train.fit_ensemble`) on growing random subsets of a run's measured training shards and
reports, on the run's `unseen` split (tables no subset ever saw): compute MAPE and Spearman, and the Spearman of
assembled placements (max over devices). It shows where the default run's benchmark budget sits on the curve:
whether more shards would buy accuracy, or the labels' own noise (label_noise.md) is the floor.
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


def run(root: str, fractions=FRACTIONS, seeds: int = 2, members: int = 3) -> pd.DataFrame:
    from embshard.costmodel.data import load
    from embshard.costmodel.reference import AnalyticEstimator
    from embshard.costmodel.train import TrainParams, fit_ensemble
    from embshard.jobs.train_cost import evaluate

    data = load(os.path.join(root, "costs"), os.path.join(root, "tables.parquet"), seed=0)
    tr = data.index("train")
    rows = []
    for frac in fractions:
        for s in range(seeds if frac < 1.0 else 1):
            rng = np.random.default_rng(100 + s)
            split = data.split.copy()
            drop = tr[rng.random(len(tr)) > frac]
            split[drop] = ""
            sub = dataclasses.replace(data, split=split)
            ens, _ = fit_ensemble(sub, TrainParams(seed=s), members)
            rep = evaluate(ens, sub, AnalyticEstimator().fit(sub, sub.index("train")))["unseen"]
            m = rep["learned_all_shards"]["total_compute"]
            rows.append({"fraction": frac, "train shards": int((split == "train").sum()), "seed": s,
                         "compute MAPE %": m["mape"], "compute Spearman": m["spearman"],
                         "placement Spearman": rep["overall"]["max_of_device_totals"]["spearman"],
                         "interval coverage": rep["calibration"]["total_compute"]["coverage"]})
            progress(f"curve: {rows[-1]['train shards']} training shards -> unseen compute MAPE "
                     f"{m['mape']:.1f}%, Spearman {m['spearman']:.3f}")
    return pd.DataFrame(rows)


def plot(df: pd.DataFrame, path: str, hw_line: str) -> str:
    plt = pyplot()
    g = df.groupby("train shards").mean(numeric_only=True).reset_index()
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    ax[0].plot(g["train shards"], g["compute MAPE %"], "o-")
    ax[0].set(xscale="log", xlabel="measured training shards", ylabel="unseen compute MAPE %")
    ax[1].plot(g["train shards"], g["compute Spearman"], "o-", label="shards")
    ax[1].plot(g["train shards"], g["placement Spearman"], "s--", label="assembled placements")
    ax[1].set(xscale="log", xlabel="measured training shards", ylabel="Spearman on unseen tables")
    ax[1].legend()
    fig.suptitle("Cost-model learning curve (" + hw_line.split(";")[0] + ")", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.costmodel_curve", description=__doc__.splitlines()[0])
    p.add_argument("--run", required=True, help="a pipeline run's data root (costs/, tables.parquet)")
    p.add_argument("--out", default=RESULTS)
    args = p.parse_args(argv)
    os.environ.setdefault("EMBSHARD_NUM_THREADS", "1")
    df = run(args.run)
    hw_line = hardware().line()
    png = plot(df, os.path.join(args.out, "costmodel_curve.png"), hw_line)
    mean = df.groupby(["fraction", "train shards"], as_index=False).mean(numeric_only=True).drop(columns="seed")
    text = "\n".join([
        "# Cost-model learning curve", "", f"Hardware: {hw_line}", "",
        f"The cost-model ensemble trained on random subsets of the measured training shards of `{args.run}`, "
        "evaluated on its `unseen` split (shards of tables no subset saw). Mean over seeds for the subsets.", "",
        md_table(mean, {"train shards": 0}), "", f"![curve]({os.path.basename(png)})"])
    write_text(os.path.join(args.out, "costmodel_curve.md"), text)
    progress(f"curve written to {args.out}/costmodel_curve.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
