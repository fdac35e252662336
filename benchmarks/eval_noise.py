"""How much of a measured planner ratio is noise: re-measure a quality suite's saved placements several times.

`python -m benchmarks.eval_noise --suite runs/bench/quality/suite-00 --run runs/bench/pipeline --passes 3`

Each pass measures, for every task, the learned planner's placement and every greedy baseline's placement again
(real kernels, the run's batch and comm calibration), in a shuffled order. Per pass it recomputes the ratio
learned / best baseline; across passes it reports how far one task's ratio moves (the noise in a single ratio),
how often the identity of the best baseline changes (the best of several noisy measurements is biased low: the
winner's curse of the protocol), and the median ratio per pass. Writes eval_noise.md and raw/eval_noise.csv.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import pandas as pd

from .common import md_table, progress

GREEDY = ("dim_greedy", "size_greedy", "lookup_greedy", "size_lookup_greedy")


def load_placements(suite_dir: str):
    """{(task_id, planner): Placement} rebuilt from the suite's evaluation placements.parquet."""
    from embshard import schemas
    from embshard.placement import Placement, Shard
    from embshard.tableset import TableSet

    tables = TableSet.read(os.path.join(suite_dir, "tables.parquet"))
    tasks = schemas.read(os.path.join(suite_dir, "tasks.parquet"), "tasks").set_index("task_id")
    frame = schemas.read(os.path.join(suite_dir, "eval", "placements.parquet"), "placements")
    out = {}
    for (task_id, planner), g in frame.groupby(["task_id", "planner"], sort=False):
        t = tasks.loc[task_id]
        sub = tables.select(list(t["table_ids"]), task_id)
        index = {str(tid): i for i, tid in enumerate(sub.table_ids)}
        shards = [Shard(index[str(r.table_id)], int(r.device),
                        0 if pd.isna(r.col_offset) else int(r.col_offset),
                        None if pd.isna(r.col_size) else int(r.col_size)) for r in g.itertuples()]
        out[(task_id, planner)] = Placement(sub, int(t["num_devices"]), int(t["memory_bytes_per_device"]), shards,
                                            planner=planner, task_id=task_id)
    return out


def run(suite_dir: str, settings, passes: int, planners: tuple[str, ...], seed: int = 0) -> pd.DataFrame:
    """`settings`: the MeasureSettings every pass measures with."""
    from embshard.bench import measure_placement

    placements = {k: v for k, v in load_placements(suite_dir).items() if k[1] in planners}
    rng = np.random.default_rng(seed)
    rows = []
    for p in range(passes):
        t0 = time.perf_counter()
        keys = list(placements)
        for k in rng.permutation(len(keys)):
            task_id, planner = keys[k]
            m = measure_placement(placements[keys[k]], settings)
            rows.append({"pass": p, "task_id": task_id, "planner": planner,
                         "measured_cost_ms": float(m["total_ms"].max())})
        progress(f"eval noise: pass {p + 1}/{passes} in {time.perf_counter() - t0:.0f} s")
    return pd.DataFrame(rows)


def analyse(df: pd.DataFrame, learned: str = "learned") -> tuple[pd.DataFrame, dict]:
    """Per (pass, task): ratio learned / best baseline and which baseline was best; plus summary numbers."""
    per = []
    for (p, task), g in df.groupby(["pass", "task_id"]):
        g = g.set_index("planner")["measured_cost_ms"]
        base = g[[b for b in GREEDY if b in g.index]]
        per.append({"pass": p, "task_id": task, "ratio": g[learned] / base.min(), "best": base.idxmin()})
    per = pd.DataFrame(per)
    spread = per.groupby("task_id")["ratio"].agg(lambda r: r.max() / r.min() - 1)
    changes = per.groupby("task_id")["best"].nunique().gt(1).mean()
    # The same baseline every pass (chosen on pass 0), measured on the other passes: no selection bias.
    fixed = []
    first = per[per["pass"] == 0].set_index("task_id")["best"]
    for (_pass, task), g in df[df["pass"] > 0].groupby(["pass", "task_id"]):
        g = g.set_index("planner")["measured_cost_ms"]
        fixed.append(g[learned] / g[first[task]])
    summary = {
        "tasks": int(per["task_id"].nunique()), "passes": int(per["pass"].nunique()),
        "ratio_spread_median": float(spread.median()), "ratio_spread_max": float(spread.max()),
        "best_baseline_changes": float(changes),
        "median_ratio_per_pass": [float(x) for x in per.groupby("pass")["ratio"].median()],
        "median_ratio_all": float(per["ratio"].median()),
        "median_ratio_baseline_fixed_on_pass0": float(np.median(fixed)) if fixed else float("nan"),
    }
    return per, summary


def markdown(per: pd.DataFrame, s: dict, suite_dir: str, hw_line: str) -> str:
    wide = per.pivot(index="task_id", columns="pass", values="ratio")
    wide.columns = [f"pass {c}" for c in wide.columns]
    wide["best baseline per pass"] = per.groupby("task_id")["best"].agg(lambda b: ", ".join(b))
    return "\n".join([
        "# Evaluation noise: the same placements measured again", "", f"Hardware: {hw_line}", "",
        f"Suite `{suite_dir}`: the learned planner's placement and the four greedy baselines' placements of each "
        f"of its {s['tasks']} tasks, measured {s['passes']} times (shuffled order, real kernels).", "",
        f"- a single task's ratio learned / best baseline moves by a median {100 * s['ratio_spread_median']:.1f}% "
        f"between passes (max {100 * s['ratio_spread_max']:.1f}%);",
        f"- the best baseline is a different heuristic on another pass in {100 * s['best_baseline_changes']:.0f}% "
        f"of the tasks;",
        f"- suite median ratio per pass: {', '.join(f'{x:.3f}' for x in s['median_ratio_per_pass'])}; "
        f"against the baseline that was best on pass 0, measured on the later passes (no winner's curse): "
        f"{s['median_ratio_baseline_fixed_on_pass0']:.3f}.", "",
        md_table(wide.reset_index()),
    ])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.eval_noise", description=__doc__.split("\n")[0])
    ap.add_argument("--suite", required=True, help="a quality suite folder (holds tables, tasks, eval/)")
    ap.add_argument("--run", required=True, help="the pipeline folder whose run root holds the comm calibration")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=1024)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = ap.parse_args(argv)
    import glob

    from .common import hardware

    roots = sorted(glob.glob(os.path.join(args.run, "data", "*", "comm_calibration.json")))
    from embshard.bench.runner import MeasureSettings

    settings = MeasureSettings(batch_size=args.batch_size,
                               calibration_dir=os.path.dirname(roots[-1]) if roots else None)
    df = run(args.suite, settings, args.passes, ("learned",) + GREEDY)
    per, s = analyse(df)
    os.makedirs(os.path.join(args.out, "raw"), exist_ok=True)
    df.to_csv(os.path.join(args.out, "raw", "eval_noise.csv"), index=False)
    with open(os.path.join(args.out, "eval_noise.md"), "w", encoding="utf-8") as f:
        f.write(markdown(per, s, args.suite, hardware().line()) + "\n")
    progress(f"eval noise: {s}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
