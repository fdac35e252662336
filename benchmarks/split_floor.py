"""What each shard kind can reach at 16 devices on the MLPerf-like list: hand-built layouts beside the learned plan.

The split suite (quality_splits.md) asks the learned plan to be within 1.5x of the balanced estimate (BE) at 16
devices. This page measures, with the ruler (paired rounds, intervals), how close plans of each kind of cut of the
hottest table (`t_cat_20`: 40M rows, 100 lookups per sample, 47% of the list's lookups) get, whatever planner
made them. The rest of the tables are laid out by longest-processing-time first on their costs measured alone
(whole, or every table in two 64-column halves, which evens out the all-to-all width each device sends). A layout
is only as good as that simple filler, so each row is an upper bound on what its kind of cut can reach.

Measured as the split suite measures: each ruler round in a fresh process, the balanced estimate's shards in every
round (so x BE is a paired ratio with an interval), the run's all-to-all calibration. Each layout also gets the
learned planner's predicted slowest device: a layout the model ranks above the learned plan but the ruler does not
(or the reverse) is a cost-model error, not a search one.

    python -m benchmarks.split_floor --run runs/pinned    # ~5 min on 2 cores -> benchmarks/results/split_floor.md
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np

from benchmarks.common import git_commit, hardware, progress, write_text
from embshard import stats
from embshard.bench.runner import MeasureSettings, measure_placement
from embshard.evaluation import balanced_estimate_rounds, estimate_probes
from embshard.placement import Placement
from embshard.ruler import Entry, measure_probed
from embshard.tableset import TableSet
from embshard.types import DeviceTopology, Shard, row_blocks

HERE = os.path.dirname(os.path.abspath(__file__))
SPEC = os.path.join(HERE, "..", "components", "embshard", "ingest", "examples", "mlperf_dlrm.yaml")
D, MEMORY = 16, 128 * 2**30
HOT = "t_cat_20"
# (label, how TorchRec runs it, the hot table's pieces as (devices, "column" | "row"))
HOT_LAYOUTS = [
    ("4 column slices", "column_wise (any hosts)", (4, "column")),
    ("row-wise over all 16", "row_wise (any hosts)", (16, "row")),
    ("row-wise over 8 (one host of 8)", "table_row_wise on 2 hosts x 8", (8, "row")),
    ("row-wise over 4 (one host of 4)", "table_row_wise on 4 hosts x 4", (4, "row")),
]


def hot_pieces(tables: TableSet, hot: int, parts: int, kind: str) -> list[Shard]:
    if kind == "column":
        width = int(tables.dims[hot]) // parts
        return [Shard(hot, d, d * width, width) for d in range(parts)]
    return [Shard(hot, d, row_offset=o, row_size=n) for d, (o, n) in enumerate(row_blocks(int(tables.rows[hot]),
                                                                                           parts))]


def alone_ms(tables: TableSet, shards: list[Shard], settings: MeasureSettings) -> float:
    """Measured cost of `shards` together on one device of D (everything else empty)."""
    moved = [Shard(s.table, 0, s.col_offset, s.col_size, s.row_offset, s.row_size, s.kind) for s in shards]
    return float(measure_placement(Placement(tables, D, 2**62, moved), settings)["total_ms"].iloc[0])


def fill(tables: TableSet, fixed: list[Shard], halves: bool, settings: MeasureSettings, cache: dict) -> list[Shard]:
    """`fixed` plus every other table (whole, or in two column halves), longest first onto the least loaded
    device by costs measured alone."""
    load = np.zeros(D)
    for d in {s.device for s in fixed}:
        load[d] = alone_ms(tables, [s for s in fixed if s.device == d], settings)
    done = {s.table for s in fixed}
    pieces = []
    for i in range(len(tables)):
        if i in done:
            continue
        dim = int(tables.dims[i])
        parts = [Shard(i, 0, 0, dim // 2), Shard(i, 0, dim // 2, dim - dim // 2)] if halves and dim >= 8 else \
            [Shard(i, 0)]
        for p in parts:
            key = (i, p.col_offset, p.col_size)
            if key not in cache:
                cache[key] = alone_ms(tables, [p], settings)
            pieces.append((cache[key], p))
    out = list(fixed)
    for cost, p in sorted(pieces, key=lambda c: -c[0]):
        d = int(np.argmin(load))
        load[d] += cost
        out.append(Shard(p.table, d, p.col_offset, p.col_size))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", default="runs/pinned", help="pipeline folder whose registered models and calibration "
                                                         "are used (default runs/pinned)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "split_floor.md"))
    args = ap.parse_args(argv)
    from benchmarks.pipeline_stages import reuse
    from embshard.ingest.spec import tables_from_spec
    from embshard.planners import get_planner
    from embshard.planners.registered import load_planner
    from embshard.planners.scoring import placement_costs

    info = reuse(args.run)  # the run's MLflow store, its models and the calibration it trained with
    t0 = time.perf_counter()
    tables = TableSet.from_frame(tables_from_spec(SPEC, progress=False))
    hot = list(tables.table_ids).index(HOT)
    settings = MeasureSettings(batch_size=info.batch_size, calibration_dir=info.root, round_processes=True)
    learned = load_planner(info.policy_uri)
    entries = [Entry("learned", learned.plan(tables, D, MEMORY, "mlperf-d16")),
               Entry("torchrec_full", get_planner("torchrec_full").plan(tables, D, MEMORY, "mlperf-d16"))]
    runs_on = {"learned": "its own cuts, one host", "torchrec_full": "TorchRec's choice, one host"}
    cache: dict = {}
    for label, torchrec, (parts, kind) in HOT_LAYOUTS:
        fixed = hot_pieces(tables, hot, parts, kind)
        for halves in (False, True):
            name = f"{label}, rest {'in halves' if halves else 'whole'}"
            pl = Placement(tables, D, MEMORY, fill(tables, fixed, halves, settings, cache), task_id="mlperf-d16",
                           topology=DeviceTopology(D, MEMORY))
            pl.check()
            entries.append(Entry(name, pl))
            runs_on[name] = torchrec
        progress(f"split_floor: built {label} ({time.perf_counter() - t0:.0f} s)")
    out = measure_probed(entries, args.rounds, settings, probes=estimate_probes(tables))
    costs = out.costs
    be_rounds, _ = balanced_estimate_rounds(out.probes, len(tables), D)
    be = float(np.median(be_rounds))
    predicted = [float(placement_costs(learned.cost_model, e.placement).max()) for e in entries]
    minutes = (time.perf_counter() - t0) / 60
    lines = ["# What each cut of the hottest table reaches at 16 devices (MLPerf-like list)", "",
             f"Hardware: {hardware().line()}", "",
             f"{__doc__.split(chr(10) + chr(10))[1]}", "",
             f"Balanced estimate (BE, every table divisible): {be:.3f} ms (median over rounds). {args.rounds} ruler "
             f"rounds, each in a fresh process; x BE and the ratios to the learned plan are paired per round (median, "
             f"95% CI). Learned planner `{info.policy_uri}` of `{args.run}`; predicted: its cost model's slowest "
             f"device. Measured in {minutes:.1f} min at commit `{git_commit()}` "
             f"(`python -m benchmarks.split_floor --run {args.run}`).", "",
             "| layout | TorchRec runs it as | predicted ms | measured ms | x BE [95% CI] | / learned [95% CI] |",
             "| --- | --- | ---: | ---: | --- | --- |"]
    for j, e in enumerate(entries):
        m = float(np.median(costs[j]))
        x, xlo, xhi = stats.median_ci(costs[j] / be_rounds)
        r, lo, hi = stats.median_ci(costs[j] / costs[0])
        lines.append(f"| {e.label} | {runs_on[e.label]} | {predicted[j]:.2f} | {m:.2f} | {x:.2f} [{xlo:.2f}, "
                     f"{xhi:.2f}] | {r:.3f} [{lo:.3f}, {hi:.3f}] |")
    write_text(args.out, "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
