"""The ruler's A/A noise floor from an A/A bench run (benchmarks.gpu_shards' aa_shards.parquet measured by
`embshard bench`): the same shards built and timed again, in shuffled order.

`python -m benchmarks.gpu_aa AA_COSTS.parquet [--devices 4]` prints the per-shard coefficient of variation of the
measured compute (fwd + bwd) across rounds and, for placements made of the A/A shards (consecutive groups of
`--devices` shards, cost = the slowest device's compute + comm), the ratio of two identical placements' costs
measured in two rounds (every pair of rounds): median and the 2.5-97.5% interval. Also the same ratio per shard.
"""
from __future__ import annotations

import argparse
import itertools

import numpy as np
import pandas as pd


def analyse(df: pd.DataFrame, devices: int = 4) -> dict:
    d = df[df["sample_id"].str.startswith("aa-r")].copy()
    parts = d["sample_id"].str.extract(r"^aa-r(\d+)-(\d+)$").astype(int)
    d["round"], d["shard"] = parts[0], parts[1]
    d["compute"] = d["fwd_compute_ms"] + d["bwd_compute_ms"]
    d["total"] = d["compute"] + d["fwd_comm_ms"] + d["bwd_comm_ms"]
    g = d.groupby("shard")["compute"]
    cv = (g.std(ddof=1) / g.mean()).dropna()
    rounds = sorted(d["round"].unique())
    wide = d.pivot(index="shard", columns="round", values="total")
    shard_ratios, place_ratios = [], []
    shards = sorted(wide.index)
    groups = [shards[i:i + devices] for i in range(0, len(shards) - devices + 1, devices)]
    for a, b in itertools.combinations(rounds, 2):
        r = (wide[a] / wide[b]).dropna()
        shard_ratios += list(r) + list(1 / r)   # both orders: the ratio's distribution is symmetric in log
        for grp in groups:
            ca, cb = wide.loc[grp, a].max(), wide.loc[grp, b].max()
            if np.isfinite(ca) and np.isfinite(cb):
                place_ratios += [ca / cb, cb / ca]

    def summary(x):
        x = np.asarray(x)
        return {"n": int(len(x) // 2), "median": float(np.median(x)), "lo": float(np.percentile(x, 2.5)),
                "hi": float(np.percentile(x, 97.5)), "median_abs_dev_pct": float(100 * np.median(np.abs(x - 1)))}

    return {"rounds": len(rounds), "shards": int(d["shard"].nunique()), "measurements": int(len(d)),
            "cv_median_pct": float(100 * cv.median()), "cv_p90_pct": float(100 * cv.quantile(0.9)),
            "cv_max_pct": float(100 * cv.max()), "spread_median_pct": float(100 * d["spread"].median()),
            "shard_ratio": summary(shard_ratios), "placement_ratio": summary(place_ratios),
            "placements": len(groups), "compute_ms_median": float(d["compute"].median()),
            "compute_ms_range": (float(d["compute"].min()), float(d["compute"].max()))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("costs")
    ap.add_argument("--devices", type=int, default=4)
    a = ap.parse_args(argv)
    import json

    print(json.dumps(analyse(pd.read_parquet(a.costs), a.devices), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
