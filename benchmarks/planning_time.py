"""Planning time scaling: the learned planner and TorchRec's, tables x devices (no kernels measured: cheap).

Tables are the first T of one synthetic population (nested sets), memory per device a fixed budget; a combination
whose tables cannot fit (total over 95% of D x memory, or one table over a device) is skipped, as are D > T.
The learned planner runs with its default time budget (its search stops there), TorchRec with a timeout (it keeps
its best plan so far; `timed_out` says when it stopped). A cell is repeated while it stays cheap; the median and
the spread (max - min) are reported. A planner slower than `stop_after_s` at some T is not run at larger T (same D).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import pandas as pd

from embshard.checks import GiB

from .common import md_table, progress, pyplot


@dataclass
class PlanningConfig:
    tables: tuple = (10, 30, 100, 200, 300, 1000, 2000)
    devices: tuple = (2, 8, 32, 64, 128)
    # no_splits: the learned planner without split refinement, so that the page shows what the split search costs
    planners: tuple = ("learned", "no_splits", "torchrec_table_wise", "torchrec_full")
    memory_gb: float = 128.0
    torchrec_timeout_s: float = 20.0
    full_max_tables: int = 200      # TorchRec's full search only up to this many tables
    repeats: int = 3                # at most; a cell repeats only while its total time stays under repeat_budget_s
    repeat_budget_s: float = 4.0
    stop_after_s: float = 60.0      # a planner slower than this at some T is not run at larger T (same D)
    seed: int = 0
    bins_batch_size: int = 4096     # planning does not measure kernels; bins only feed the features
    cells: tuple | None = None      # only these (tables, devices) cells (a side-by-side check); None: the grid


def full_config() -> PlanningConfig:
    return PlanningConfig()


def quick_config() -> PlanningConfig:
    return PlanningConfig(tables=(10, 30), devices=(2, 4), planners=("learned", "no_splits", "torchrec_table_wise"),
                          torchrec_timeout_s=10.0, repeats=2, repeat_budget_s=2.0)


def _planner(name: str, policy_uri: str, cfg: PlanningConfig):
    from embshard.planners import get_planner

    if name.startswith("torchrec_"):
        return get_planner(name, timeout_s=cfg.torchrec_timeout_s)
    return get_planner(name, model_uri=policy_uri)


def run(policy_uri: str, cfg: PlanningConfig) -> pd.DataFrame:
    from embshard.errors import EmbshardError
    from embshard.evaluation import predicted_device_costs
    from embshard.ingest.synthetic import generate_tables
    from embshard.tableset import TableSet

    population = TableSet.from_frame(generate_tables(max(cfg.tables), seed=cfg.seed,
                                                     bins_batch_size=cfg.bins_batch_size))
    mem = int(cfg.memory_gb * GiB)
    planners = {}
    for name in cfg.planners:
        try:
            planners[name] = _planner(name, policy_uri, cfg)
        except EmbshardError as exc:  # e.g. torchrec not installed
            progress(f"planning time: skipping {name}: {exc}")
    rows = []
    too_slow: dict[tuple[str, int], int] = {}  # (planner, D) -> the T where it passed stop_after_s
    for t in cfg.tables:
        tables = population.subset(range(t))
        total, largest = int(tables.size_bytes.sum()), int(tables.size_bytes.max())
        for d in cfg.devices:
            if d > t or (cfg.cells is not None and (t, d) not in cfg.cells):
                continue
            if largest > mem or total > 0.95 * d * mem:
                rows.append({"tables": t, "devices": d, "planner": "(all)", "skipped":
                             f"{total / GiB:.0f} GiB of tables do not fit {d} x {cfg.memory_gb:g} GiB"})
                continue
            cell = {}  # name -> [times, error, meta, placement]
            for name in planners:
                if name == "torchrec_full" and t > cfg.full_max_tables:
                    continue
                if (name, d) in too_slow:
                    rows.append({"tables": t, "devices": d, "planner": name, "runs": 0, "median_s": np.nan,
                                 "spread_s": np.nan, "timed_out": False,
                                 "error": f"not run: over {cfg.stop_after_s:g} s at T={too_slow[(name, d)]}"})
                    continue
                cell[name] = [[], None, {}, None]
            # The planners take turns, one plan each per repeat, so that a burst of load on a shared machine falls on
            # every planner of the cell alike (one planner's repeats in a row had put a burst on one side of a ratio).
            for _ in range(cfg.repeats):
                for name, (times, err, _, _) in cell.items():
                    if err is not None or (times and sum(times) >= cfg.repeat_budget_s):
                        continue
                    t0 = time.perf_counter()
                    try:
                        pl = planners[name].plan(tables, d, mem, f"T{t}-D{d}")
                    except EmbshardError as exc:
                        cell[name][1] = str(exc)
                        continue
                    times.append(time.perf_counter() - t0)
                    cell[name][2], cell[name][3] = pl.meta, pl
            for name, (times, err, meta, pl) in cell.items():
                planner = planners[name]
                # the plan's predicted slowest device, once (repeats give the same plan); None: no cost model
                pred = predicted_device_costs(planner, pl) if pl is not None else None
                predicted = float(pred.max()) if pred is not None else np.nan
                row = {"tables": t, "devices": d, "planner": name, "runs": len(times),
                       "median_s": float(np.median(times)) if times else np.nan,
                       "spread_s": float(np.ptp(times)) if times else np.nan,
                       "timed_out": bool(meta.get("torchrec_timed_out", False) or meta.get("torchrec_fallback")),
                       "predicted_ms": predicted, "error": err}
                rows.append(row)
                if times and row["median_s"] > cfg.stop_after_s:
                    too_slow[(name, d)] = t
                progress(f"planning time T={t:<5} D={d:<4} {name:<20} "
                         + (f"{row['median_s']:8.3f} s (x{len(times)})" if times else f"failed: {err}")
                         + ("  [timeout]" if row["timed_out"] else ""))
    return pd.DataFrame(rows)


def plot(df: pd.DataFrame, path: str, cfg: PlanningConfig, hw_line: str) -> str:
    plt = pyplot()
    ok = df[(df["planner"] != "(all)") & df["median_s"].notna()]
    fig, ax = plt.subplots(figsize=(9, 6))
    colors = {"learned": "tab:blue", "no_splits": "tab:green", "policy_only": "tab:cyan",
              "torchrec_table_wise": "tab:orange", "torchrec_full": "tab:red"}
    markers = ["o", "s", "^", "D", "v", "P", "X"]
    devs = sorted(ok["devices"].unique())
    for name in dict.fromkeys(ok["planner"]):
        for k, d in enumerate(devs):
            sub = ok[(ok["planner"] == name) & (ok["devices"] == d)].sort_values("tables")
            if sub.empty:
                continue
            ax.plot(sub["tables"], sub["median_s"], marker=markers[k % len(markers)], ms=5, lw=1.2,
                    color=colors.get(name), alpha=0.5 + 0.5 * (k + 1) / len(devs), label=f"{name} D={d}")
            to = sub[sub["timed_out"]]
            if len(to):
                ax.scatter(to["tables"], to["median_s"], s=90, facecolors="none", edgecolors="black", zorder=5)
    ax.axhline(cfg.torchrec_timeout_s, color="grey", ls=":", lw=0.8)
    ax.text(ok["tables"].min() if len(ok) else 1, cfg.torchrec_timeout_s * 1.08,
            f"TorchRec timeout {cfg.torchrec_timeout_s:g} s (circled: stopped by it)", fontsize=7, color="grey")
    ax.set(xscale="log", yscale="log", xlabel="tables T", ylabel="planning wall time (s), median",
           title="Planning time scaling\n" + hw_line.split(";")[0])
    ax.title.set_fontsize(9)
    ax.grid(which="both", alpha=0.25)
    ax.legend(fontsize=6, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def pivot(df: pd.DataFrame) -> pd.DataFrame:
    """Tables x (planner, D) grid of median seconds, as text cells ('>' marks a TorchRec timeout)."""
    ok = df[df["planner"] != "(all)"].copy()
    if ok.empty:
        return pd.DataFrame()
    ok["cell"] = [("–" if not np.isfinite(s) else f"{s:.3g}") + (" (timeout)" if to else "")
                  for s, to in zip(ok["median_s"], ok["timed_out"])]
    ok["column"] = ok["planner"] + " D=" + ok["devices"].astype(str)
    order = [f"{p} D={d}" for p in dict.fromkeys(ok["planner"]) for d in sorted(ok["devices"].unique())]
    table = ok.pivot_table(index="tables", columns="column", values="cell", aggfunc="first")
    table = table[[c for c in order if c in table.columns]].reset_index()
    return table.fillna("–").astype(str).rename(columns={"tables": "T"})


def ratio_table(df: pd.DataFrame, a: str, b: str, value: str = "median_s") -> pd.DataFrame:
    """Tables x D grid of a's `value` / b's (median seconds, or `predicted_ms`: the plans' predicted slowest
    device), as text cells; empty when either planner or the column is missing."""
    if value not in df.columns:
        return pd.DataFrame()
    ok = df[df["planner"].isin([a, b])].pivot_table(index=["tables", "devices"], columns="planner",
                                                    values=value, aggfunc="first")
    if a not in ok.columns or b not in ok.columns:
        return pd.DataFrame()
    r = (ok[a] / ok[b]).dropna().rename("ratio").reset_index()
    if r.empty:
        return pd.DataFrame()
    r["cell"] = [f"{v:.2f}" for v in r["ratio"]]
    table = r.pivot_table(index="tables", columns="devices", values="cell", aggfunc="first")
    table.columns = [f"D={d}" for d in table.columns]
    return table.reset_index().fillna("–").astype(str).rename(columns={"tables": "T"})


def markdown(df: pd.DataFrame, cfg: PlanningConfig, hw_line: str, policy_uri: str, png: str | None) -> str:
    lines = ["# Planning time scaling", "", f"Hardware: {hw_line}", "",
             f"Wall seconds of `plan()` (median of up to {cfg.repeats} runs while a cell stays under "
             f"{cfg.repeat_budget_s:g} s; the planners of a cell take turns, one plan each per repeat, so that load "
             f"on a shared machine falls on both sides of a ratio). Learned planner `{policy_uri}` with its default "
             "time budget; TorchRec "
             f"table-wise and full search with a {cfg.torchrec_timeout_s:g} s timeout (full search only up to "
             f"{cfg.full_max_tables} tables). Synthetic tables, {cfg.memory_gb:g} GiB per device.", ""]
    if png:
        lines += [f"![planning time]({png.rsplit('/', 1)[-1]})", ""]
    piv = pivot(df)
    if not piv.empty:
        # One table per planner keeps the page readable.
        for name in dict.fromkeys(df.loc[df["planner"] != "(all)", "planner"]):
            cols = ["T", *[c for c in piv.columns if c.startswith(name + " D=")]]
            sub = piv[cols].rename(columns={c: c.removeprefix(name + " ") for c in cols})
            lines += [f"## {name}", "", md_table(sub), ""]
    ratio = ratio_table(df, "learned", "torchrec_table_wise")
    if not ratio.empty:
        lines += ["## learned / torchrec_table_wise", "",
                  "Ratio of the median seconds of the two planners in the same cell of this run (under 1: the learned "
                  "planner is faster).", "", md_table(ratio), ""]
    ratio = ratio_table(df, "no_splits", "torchrec_table_wise")
    if not ratio.empty:
        lines += ["## no_splits / torchrec_table_wise", "",
                  "The learned planner without its split refinement (it cuts only what cannot be placed whole), "
                  "against TorchRec's table-wise planner in the same cell: what the learned planner's time is without "
                  "the search for column, row and replica cuts.", "", md_table(ratio), ""]
    gain = ratio_table(df, "learned", "no_splits", value="predicted_ms")
    if not gain.empty:
        lines += ["## What the split refinement buys: predicted cost, learned / no_splits", "",
                  "The learned plan's predicted slowest device over no_splits' in the same cell (the cost model's "
                  "view, not a measurement: the split suite measures cuts, quality_splits.md).", "", md_table(gain),
                  ""]
    lines += ["5,000 tables on 1,024 devices (by simulation: wall time, peak memory, gap to the balanced estimate): "
              "[planning_scale.md](planning_scale.md).", ""]
    lines += ["`–`: not run (more devices than tables, tables that cannot fit the devices' memory, TorchRec's full "
              f"search above {cfg.full_max_tables} tables, or a planner already over {cfg.stop_after_s:g} s at a "
              "smaller T).", ""]
    skipped = df[df["planner"] == "(all)"]
    if len(skipped):
        lines += ["Skipped (memory cannot fit): " + "; ".join(f"T={r.tables} D={r.devices}"
                                                              for r in skipped.itertuples()), ""]
    lines += ["## Raw", "", md_table(df.drop(columns=[c for c in ("skipped",) if c in df.columns]),
                                     {"median_s": 3, "spread_s": 3, "tables": 0, "devices": 0, "runs": 0})]
    return "\n".join(lines)
