"""TorchRec baseline planning time: T = 10, 50, 100, 200 tables x D = 4, 8 devices, table-wise and full search.

Synthetic tables (seeded), memory per device = 1.3 x an even share (at least the largest table + 5%).
Prints one row per (mode, T, D): wall seconds of TorchRecPlanner.plan, TorchRec's proposals, its own predicted
max-rank cost, whether its timeout stopped the search, and column splits used; plus the full/table-wise time
ratio. The published comparison (docs/method.md) quotes ~100 s for TorchRec's full search at 200 tables.

    python benchmarks/torchrec_planning_time.py                 # the whole grid (minutes on a small CPU)
    python benchmarks/torchrec_planning_time.py --quick         # T = 10, 50 only
    python benchmarks/torchrec_planning_time.py --timeout 60    # TorchRec stops proposing after 60 s
"""
from __future__ import annotations

import argparse
import json
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tables", type=int, nargs="+", default=[10, 50, 100, 200])
    parser.add_argument("--devices", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--modes", nargs="+", default=["table_wise", "full"], choices=["table_wise", "full"])
    parser.add_argument("--timeout", type=float, default=None, help="TorchRec search time limit per plan (s)")
    parser.add_argument("--quick", action="store_true", help="T = 10, 50 only")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = parser.parse_args(argv)
    if args.quick:
        args.tables = [t for t in args.tables if t <= 50]

    from embshard.errors import EmbshardError
    from embshard.ingest.synthetic import generate_tables
    from embshard.planners.torchrec_planner import TorchRecPlanner
    from embshard.tableset import TableSet

    try:
        from embshard.export.torchrec_plan import require_torchrec

        require_torchrec()
    except EmbshardError as exc:
        print(f"skipped: {exc}")
        return 0

    population = TableSet.from_frame(generate_tables(max(args.tables), seed=args.seed, bins_batch_size=512))
    rows = []
    print(f"{'mode':<11} {'T':>4} {'D':>2} {'plan_s':>8} {'proposals':>9} {'trec_max_ms':>11} {'timeout':>7} "
          f"{'cw_tables':>9}")
    for t in args.tables:
        tables = population.subset(range(t))
        for d in args.devices:
            mem = int(max(tables.size_bytes.sum() / d * 1.3, tables.size_bytes.max() * 1.05))
            for mode in args.modes:
                planner = TorchRecPlanner(search=mode, timeout_s=args.timeout)
                t0 = time.perf_counter()
                try:
                    placement = planner.plan(tables, d, mem, task_id=f"T{t}-D{d}")
                except EmbshardError as exc:
                    print(f"{mode:<11} {t:>4} {d:>2} error: {exc}")
                    continue
                wall = time.perf_counter() - t0
                m = placement.meta
                cw = len({s.table for s in placement.shards if s.col_size is not None})
                row = {"mode": mode, "tables": t, "devices": d, "plan_s": round(wall, 3),
                       "proposals": m["torchrec_num_proposals"], "torchrec_max_rank_ms": m["torchrec_max_rank_perf_ms"],
                       "timed_out": m["torchrec_timed_out"], "fallback": m.get("torchrec_fallback"),
                       "column_split_tables": cw}
                rows.append(row)
                print(f"{mode:<11} {t:>4} {d:>2} {wall:>8.2f} {row['proposals']:>9} "
                      f"{row['torchrec_max_rank_ms']:>11.4f} {str(row['timed_out']):>7} {cw:>9}", flush=True)
    by = {(r["mode"], r["tables"], r["devices"]): r for r in rows}
    for t in args.tables:
        for d in args.devices:
            tw, full = by.get(("table_wise", t, d)), by.get(("full", t, d))
            if tw and full:
                print(f"T={t:>3} D={d}: full/table-wise time {full['plan_s'] / max(tw['plan_s'], 1e-9):6.1f}x, "
                      f"TorchRec-predicted cost full/table-wise "
                      f"{full['torchrec_max_rank_ms'] / max(tw['torchrec_max_rank_ms'], 1e-12):.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
