"""Planning at scale, by simulation: the learned planner on 5,000 tables x 1,024 devices (no kernels measured).

Each cell plans once in a fresh subprocess (one intra-op thread), so that its peak memory (`ru_maxrss` of that
process: the interpreter, torch and the models included) is its own. Reported: the wall seconds of `plan()`, the
peak resident memory, the predicted slowest device and its gap to the balanced estimate of the same cost model
(costmodel.scoring.balanced_estimate, column splits allowed: what `embshard place` prints). Targets (issue 25):
<= 30 s and <= 4 GB.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import dataclass

import pandas as pd

from .common import md_table, progress

GB = 1e9


@dataclass
class ScaleConfig:
    cells: tuple = ((5000, 1024),)
    memory_gb: float = 128.0
    seed: int = 0
    bins_batch_size: int = 4096
    target_s: float = 30.0
    target_gb: float = 4.0


def quick_config() -> ScaleConfig:
    return ScaleConfig(cells=((200, 16),))


def _child(policy_uri: str, tables: int, devices: int, memory_gb: float, seed: int, bins_batch_size: int) -> dict:
    """One cell, in this (fresh) process: what `run` reads back as JSON."""
    import resource
    import time

    import torch

    torch.set_num_threads(1)
    from embshard.checks import GiB
    from embshard.ingest.synthetic import generate_tables
    from embshard.planners import get_planner
    from embshard.planners.scoring import balanced_estimate, placement_costs
    from embshard.tableset import TableSet

    ts = TableSet.from_frame(generate_tables(tables, seed=seed, bins_batch_size=bins_batch_size))
    planner = get_planner("learned", model_uri=policy_uri)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t0 = time.perf_counter()
    placement = planner.plan(ts, devices, int(memory_gb * GiB), f"T{tables}-D{devices}")
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    costs = placement_costs(planner.cost_model, placement)
    estimate = balanced_estimate(planner.cost_model, ts, devices, column_splits=True)
    table_wise = balanced_estimate(planner.cost_model, ts, devices, column_splits=False)
    m = placement.meta
    return {"tables": tables, "devices": devices, "plan_s": seconds, "peak_gb": peak / GB,
            "peak_before_plan_gb": rss_before / GB, "predicted_max_ms": float(costs.max()),
            "balanced_estimate_ms": float(estimate), "gap": float(costs.max()) / estimate - 1.0,
            "table_wise_estimate_ms": float(table_wise),
            "start_candidate": m.get("start_candidate"), "search_evaluations": m.get("search_evaluations"),
            "search_budget": m.get("search_budget"), "column_splits": m.get("column_splits"),
            "row_splits": m.get("row_splits"), "time_cap_hit": m.get("time_cap_hit")}


def run(policy_uri: str, cfg: ScaleConfig) -> pd.DataFrame:
    rows = []
    for t, d in cfg.cells:
        cmd = [sys.executable, "-m", "benchmarks.planning_scale", "--child", policy_uri, str(t), str(d),
               str(cfg.memory_gb), str(cfg.seed), str(cfg.bins_batch_size)]
        env = {**os.environ, "EMBSHARD_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        if proc.returncode != 0 or not lines:
            rows.append({"tables": t, "devices": d, "error": (proc.stderr or proc.stdout)[-300:]})
            progress(f"planning scale T={t} D={d}: failed")
            continue
        row = json.loads(lines[-1])
        rows.append(row)
        progress(f"planning scale T={t} D={d}: {row['plan_s']:.1f} s, peak {row['peak_gb']:.2f} GB, "
                 f"gap {100 * row['gap']:+.1f}%")
    return pd.DataFrame(rows)


def markdown(df: pd.DataFrame, cfg: ScaleConfig, hw_line: str, policy_uri: str) -> str:
    lines = ["# Planning at scale (simulation)", "", f"Hardware: {hw_line}", "",
             f"The learned planner (`{policy_uri}`, default work budget) on synthetic tables, {cfg.memory_gb:g} GiB "
             "per device, planned once in a fresh process with one thread. `plan s`: wall seconds of `plan()`; "
             "`peak GB`: the process's peak resident memory (interpreter, torch and models included; "
             "`before plan GB`: the same before planning); `gap`: the predicted slowest device over the balanced "
             "estimate of the same cost model (column splits allowed), minus 1; `table-wise estimate ms`: the same "
             "estimate for plans that keep every table whole (at least the costliest table alone). Estimates, not "
             "bounds: what an evenly spread plan would cost. Targets: "
             f"<= {cfg.target_s:g} s and <= {cfg.target_gb:g} GB.", ""]
    if "plan_s" in df:
        show = df.assign(gap=[f"{100 * g:+.1f}%" for g in df["gap"]])
        cols = ["tables", "devices", "plan_s", "peak_gb", "peak_before_plan_gb", "predicted_max_ms",
                "balanced_estimate_ms", "gap", "table_wise_estimate_ms", "start_candidate", "search_evaluations",
                "search_budget", "column_splits", "row_splits", "time_cap_hit"]
        show = show[[c for c in cols if c in show]].rename(columns={"plan_s": "plan s", "peak_gb": "peak GB",
                                                                    "peak_before_plan_gb": "before plan GB",
                                                                    "table_wise_estimate_ms": "table-wise estimate ms"})
        lines += [md_table(show), ""]
    if "error" in df and df["error"].notna().any():
        lines += ["Failed: " + "; ".join(f"T={r.tables} D={r.devices}: {r.error}"
                                         for r in df.itertuples() if isinstance(r.error, str)), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--child", nargs=6, metavar=("URI", "T", "D", "MEM_GB", "SEED", "BINS"), default=None)
    p.add_argument("--run", default=None, help="a pipeline run folder (e.g. runs/local) whose policy to use")
    p.add_argument("--out", default=None, help="write the Markdown page here")
    args = p.parse_args(argv)
    if args.child:
        uri, t, d, mem, seed, bins = args.child
        print(json.dumps(_child(uri, int(t), int(d), float(mem), int(seed), int(bins))), flush=True)
        return 0
    from . import pipeline_stages
    from .common import hardware, write_text

    info = pipeline_stages.reuse(args.run or "runs/local")
    cfg = ScaleConfig()
    df = run(info.policy_uri, cfg)
    text = markdown(df, cfg, hardware().line(), info.policy_uri)
    if args.out:
        write_text(args.out, text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
