"""`embshard evaluate`: several planners on the same tasks, measured side by side with real kernels.

Per task, every planner plans; then the placements are measured in an interleaved order (planner A, B, C, then
again) so that machine noise hits all of them alike. A planner that cannot place a task is recorded as failed and
counted as such in the summary (never dropped from the average). The lower bound is measured too: all of a
task's tables as one fused shard and each table alone: per cost head the smaller of the two, over the device count.
"""
from __future__ import annotations

import argparse
import logging
import os
import time
from typing import Any

import numpy as np
import pandas as pd

from .. import schemas, storage
from ..bench.runner import MeasureSettings
from ..errors import EmbshardError
from ..placement import Placement
from ..planners.baselines import BASELINES, GREEDY_BASELINES
from ..tableset import TableSet
from ..types import load_tasks

log = logging.getLogger(__name__)


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tables", required=True, help="tables.parquet")
    p.add_argument("--tasks", required=True, help="tasks.parquet")
    p.add_argument("--planners", default=",".join(["learned", *BASELINES]),
                   help="comma-separated planner names (learned, learned@ALIAS, policy_only, baselines, "
                        "torchrec_table_wise, torchrec_full)")
    p.add_argument("--split", default="test", help="which tasks: test (default), train or all")
    p.add_argument("--max-tasks", type=int, default=None, help="evaluate at most this many tasks")
    p.add_argument("--repeats", type=int, default=1, help="measure every placement this many times (median)")
    p.add_argument("--batch-size", type=int, default=None, help="benchmark batch size (default: the bench's)")
    p.add_argument("--out", required=True, help="output folder: evaluation.parquet, placements, plot")


def main(args) -> int:
    res = run(args.tables, args.tasks, args.out, planners=[p for p in args.planners.split(",") if p],
              split=args.split, max_tasks=args.max_tasks, repeats=args.repeats,
              settings=MeasureSettings(batch_size=args.batch_size or None))
    print(res["summary_text"])
    print(f"wrote {res['evaluation']} and {res['plot']}")
    return 0


def run(tables: str, tasks: str, out: str, *, planners: list[str], split: str = "test",
        max_tasks: int | None = None, repeats: int = 1, settings: MeasureSettings | None = None,
        planner_kw: dict | None = None, progress: bool = True) -> dict:
    from tqdm import tqdm

    from ..bench import measure_placement
    from ..planners import get_planner

    if not planners:
        raise EmbshardError("no planners given", field="planners", fix="e.g. --planners learned,size_lookup_greedy")
    task_list = load_tasks(tables, tasks, split, limit=max_tasks)
    # A task that no planner can place is bad input, not a failed planner: refuse before measuring anything.
    from ..planners.base import check_feasible

    for t in task_list:
        check_feasible(t.tables, t.num_devices, t.memory_bytes_per_device, f"{os.fspath(tasks)} (task {t.task_id})")
    bench_kw = (settings or MeasureSettings()).kwargs()
    planner_objs = {name: get_planner(name, **(planner_kw or {}).get(name, {})) for name in planners}
    rows, placements = [], []
    bar = tqdm(total=len(task_list) * (len(planners) + 1) * repeats, desc="evaluate (measured)",
               disable=not progress)
    for t in task_list:
        sub = t.tables
        D, mem = t.num_devices, t.memory_bytes_per_device
        planned: dict[str, Placement] = {}
        for name, planner in planner_objs.items():
            row: dict[str, Any] = {"task_id": t.task_id, "planner": name, "num_tables": len(sub), "num_devices": D,
                   "memory_bytes_per_device": mem, "feasible": False, "error": None}
            t0 = time.perf_counter()
            try:
                planned[name] = planner.plan_task(t)
                row["feasible"] = True
            except EmbshardError as exc:
                row["error"] = str(exc)
            row["planning_time_s"] = time.perf_counter() - t0
            rows.append(row)
        # Interleaved measurement: every repeat measures each planner's placement once, in turn.
        measured: dict[str, list[pd.DataFrame]] = {name: [] for name in planned}
        lb_samples = []
        singles = measured_singles(sub, D, bench_kw)
        for _ in range(repeats):
            lb_samples.append(measured_lower_bound(sub, D, singles, bench_kw, t.task_id))
            bar.update(1)
            for name, pl in planned.items():
                measured[name].append(measure_placement(pl, **bench_kw))
                bar.update(1)
        # Table-wise plans also owe the largest single table; column-wise splits can go below it.
        lb_split = float(np.median(lb_samples))
        lb_table = max(lb_split, float(singles.sum(1).max()))
        for row in rows[-len(planner_objs):]:
            name = row["planner"]
            splits = name in planned and any(s.col_size is not None for s in planned[name].shards)
            row["lower_bound_ms"] = lb_split if splits else lb_table
            if name not in planned:
                row["measured_cost_ms"] = np.nan
                continue
            per_dev = _median_device_totals(measured[name], D)
            row["measured_cost_ms"] = float(per_dev.max())
            row["measured_imbalance"] = float(per_dev.max() / max(per_dev.mean(), 1e-12))
            pl = planned[name]
            row["column_splits"] = int(sum(s.col_size is not None for s in pl.shards))
            pred = _predicted(planner_objs[name], pl)
            row["predicted_cost_ms"] = float(pred.max()) if pred is not None else np.nan
            frame = pl.to_frame(pred)
            frame["measured_cost_ms"] = [float(per_dev[d]) for d in frame["device"]]
            placements.append(frame)
    bar.close()
    df = pd.DataFrame(rows)
    df = add_ratios(df)
    with storage.staged_dir(out) as stage:  # every output or none
        _write_parquet(df, os.path.join(stage, "evaluation.parquet"))
        if placements:
            schemas.write(pd.concat(placements, ignore_index=True), os.path.join(stage, "placements.parquet"),
                          "placements")
        plot_evaluation(df, os.path.join(stage, "evaluation.png"))
    eval_path = storage.join(out, "evaluation.parquet")
    plot_path = storage.join(out, "evaluation.png")
    summary = summarize(df)
    _log_to_mlflow(df, summary, plot_path)
    return {"evaluation": eval_path, "plot": plot_path, "frame": df, "summary": summary,
            "summary_text": format_summary(summary)}


HEAD_COLUMNS = (["fwd_compute_ms"], ["bwd_compute_ms"], ["fwd_comm_ms", "bwd_comm_ms"])


def measured_singles(tables: TableSet, num_devices: int, bench_kw: dict) -> np.ndarray:
    """(N, 3) measured fwd compute, bwd compute and comm of every table alone on one of D devices."""
    from ..bench import measure_placement

    out = np.zeros((len(tables), len(HEAD_COLUMNS)))
    for i in range(len(tables)):
        one = Placement.from_assignment(tables.subset([i]), np.zeros(1, dtype=np.int64), num_devices, 2**62,
                                        planner="single")
        row = measure_placement(one, **bench_kw).iloc[0]
        out[i] = [sum(float(row[c]) for c in cols) for cols in HEAD_COLUMNS]
    return out


def measured_lower_bound(tables: TableSet, num_devices: int, singles: np.ndarray, bench_kw: dict,
                         task_id: str) -> float:
    """Sum over heads of min(all tables fused on one device, sum of singles) / D: the bound of any plan, column
    splits included (a table-wise plan also owes its largest single table; the caller adds that term).

    All-on-one / D (docs/method.md, "Lower bound") bounds a sub-additive fused cost, the sum of singles / D a
    super-additive one;
    measured CPU heads are of both kinds (forward shares work, backward grows faster than linearly, the
    all-to-all pays its latency once per device), so each head takes the smaller of the two.
    """
    from ..bench import measure_placement

    fused = Placement.from_assignment(tables, np.zeros(len(tables), dtype=np.int64), num_devices, 2**62,
                                      planner="lower_bound", task_id=task_id)
    row = measure_placement(fused, **bench_kw).iloc[0]  # device 0 holds everything; its all-to-all is for D ranks
    fused_heads = np.array([sum(float(row[c]) for c in cols) for cols in HEAD_COLUMNS])
    return float(np.minimum(fused_heads, singles.sum(0)).sum()) / num_devices


def _median_device_totals(frames: list[pd.DataFrame], D: int) -> np.ndarray:
    stack = np.zeros((len(frames), D))
    for k, f in enumerate(frames):
        stack[k, f["device"].to_numpy(dtype=int)] = f["total_ms"].to_numpy(dtype=float)
    return np.median(stack, axis=0)


def _predicted(planner, placement: Placement):
    model = getattr(planner, "cost_model", None)
    if model is None:
        return None
    from ..planners.scoring import placement_costs

    return placement_costs(model, placement)


def add_ratios(df: pd.DataFrame) -> pd.DataFrame:
    """Per task: ratio of each planner's measured cost to the best greedy baseline's and to TorchRec's."""
    df = df.copy()
    best = (df[df["planner"].isin(GREEDY_BASELINES)].groupby("task_id")["measured_cost_ms"].min())
    df["best_baseline_ms"] = df["task_id"].map(best)
    df["ratio_to_best_baseline"] = df["measured_cost_ms"] / df["best_baseline_ms"]
    tr = df[df["planner"].str.startswith("torchrec")].groupby("task_id")["measured_cost_ms"].min()
    df["ratio_to_torchrec"] = df["measured_cost_ms"] / df["task_id"].map(tr)
    df["gap_to_lower_bound"] = df["measured_cost_ms"] / df["lower_bound_ms"] - 1.0
    return df


def summarize(df: pd.DataFrame) -> pd.DataFrame:
    """Per planner: tasks, failures, median/worst ratio to the best baseline and to TorchRec, median gap."""
    g = df.groupby("planner", sort=False)
    out = pd.DataFrame({
        "tasks": g.size(),
        "failed": g["feasible"].apply(lambda s: int((~s.astype(bool)).sum())),
        "median_ms": g["measured_cost_ms"].median(),
        "median_ratio_best_baseline": g["ratio_to_best_baseline"].median(),
        "worst_ratio_best_baseline": g["ratio_to_best_baseline"].max(),
        "median_ratio_torchrec": g["ratio_to_torchrec"].median(),
        "median_gap_lower_bound": g["gap_to_lower_bound"].median(),
        "median_planning_s": g["planning_time_s"].median(),
    })
    return out


def format_summary(summary: pd.DataFrame) -> str:
    with pd.option_context("display.width", 160, "display.max_columns", 20, "display.float_format", "{:.3f}".format):
        return "measured cost per planner (ratios: lower is better; failed = tasks it could not place)\n" + \
            summary.to_string()


def plot_evaluation(df: pd.DataFrame, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    planners = list(dict.fromkeys(df["planner"]))
    tasks = list(dict.fromkeys(df["task_id"]))
    fig, ax = plt.subplots(1, 2, figsize=(13, 4.2), gridspec_kw={"width_ratios": [3, 1]})
    width = 0.8 / max(len(planners), 1)
    for k, name in enumerate(planners):
        sub = df[df["planner"] == name].set_index("task_id").reindex(tasks)
        ax[0].bar(np.arange(len(tasks)) + k * width, sub["ratio_to_best_baseline"].fillna(0), width, label=name)
    ax[0].axhline(1.0, color="black", lw=0.8, ls="--")
    ax[0].set_xticks(np.arange(len(tasks)) + 0.4 - width / 2)
    ax[0].set_xticklabels(tasks, rotation=60, fontsize=7)
    ax[0].set_ylabel("measured cost / best greedy baseline")
    ax[0].legend(fontsize=7, ncol=3)
    data = [df[df["planner"] == n]["gap_to_lower_bound"].dropna() * 100 for n in planners]
    ax[1].boxplot(data, tick_labels=planners, vert=True)
    ax[1].tick_params(axis="x", rotation=70, labelsize=7)
    ax[1].set_ylabel("gap to lower bound (%)")
    fig.suptitle("embshard evaluation: measured with real kernels, side by side")
    fig.tight_layout()
    with storage.atomic_write(path) as f:
        fig.savefig(f, format="png", dpi=110)
    plt.close(fig)


def _write_parquet(df: pd.DataFrame, path: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    with storage.atomic_write(path) as f:
        pq.write_table(pa.Table.from_pandas(df, preserve_index=False), f)


def _log_to_mlflow(df: pd.DataFrame, summary: pd.DataFrame, plot_path: str) -> None:
    import mlflow

    if mlflow.active_run() is None:
        return
    for name, r in summary.iterrows():
        key = name.replace("@", "_at_").replace("/", "_v")
        for col in ("median_ratio_best_baseline", "worst_ratio_best_baseline", "median_gap_lower_bound"):
            if np.isfinite(r[col]):
                mlflow.log_metric(f"{key}.{col}", float(r[col]))
    if os.path.exists(plot_path):
        mlflow.log_artifact(plot_path)
