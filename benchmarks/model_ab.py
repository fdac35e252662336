"""Two registered versions of the learned planner, measured side by side on the held-out quality suites.

`python -m benchmarks.model_ab --run runs/local --a learned/1 --b learned/2 [--suite main|split] [--spec F:D:GB]
[--note TEXT]`

What the pipeline's promotion gate asks on its 5 tasks (is the candidate better than the champion?), asked on the
quality suites with the ruler: every task is planned by both versions and the greedy baselines and TorchRec's
table-wise planner, measured in 5 rounds (each in a fresh process), and each suite reports B's cost over A's,
paired per round (median over tasks, bootstrap interval over tasks and rounds) next to the suite's A/A floor
(dim_greedy measured twice), with the rule's verdict. `--spec FILE:DEVICES:GIB` adds a table list of one's own as
a suite of one task (repeatable). Writes model_ab.md (or --name) and raw/<name>.csv under --out.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import pandas as pd

from .common import hardware, md_table, progress, write_text

BASELINES = ["dim_greedy", "lookup_greedy", "size_lookup_greedy", "torchrec_table_wise"]


def spec_arg(text: str) -> tuple[str, int, float]:
    """--spec FILE:DEVICES:GIB as (the file's absolute path, devices, GiB per device)."""
    parts = text.rsplit(":", 2)
    try:
        path, devices, gib = parts[0], int(parts[1]), float(parts[2])
    except (IndexError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not FILE:DEVICES:GIB (e.g. my_tables.csv:8:16)") from None
    if not os.path.isfile(path) or devices < 1 or gib <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give an existing table spec, devices >= 1 and GiB > 0")
    return os.path.abspath(path), devices, gib


def configure(suite: str, a: str, b: str, specs: list[tuple[str, int, float]]):
    """The quality suites of `suite` with A, B and the baselines as planners (the A/A entry is added by quality),
    plus one suite per --spec (spec_arg's tuples)."""
    from . import quality

    cfg = quality.split_config() if suite == "split" else quality.full_config()
    cfg.estimate_in_rounds = False  # ratios between the two plans are what is asked, not their multiple of BE
    planners = [a, b, *BASELINES]
    for s in cfg.suites:
        s.planners = list(planners)
    for path, devices, gib in specs:
        cfg.suites.append(quality.Suite(spec_suite_name(path, devices, gib), path, None, [devices],
                                        planners=list(planners), memory_gb=gib))
    return cfg


def spec_suite_name(path: str, devices: int, gib: float) -> str:
    return f"{os.path.basename(path)} D={devices} {gib:g} GiB"


def paired(frame: pd.DataFrame, a: str, b: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(per suite: B over A with its interval, the A/A floor and the verdict; per task: B/A and each over the best
    greedy baseline and TorchRec's table-wise plan)."""
    from embshard import stats

    suites, tasks = [], []
    for suite, g in frame.groupby("suite", sort=False):
        per_task = []
        for task, gt in g.groupby("task_id", sort=False):
            ra, rb = gt[gt["planner"] == a], gt[gt["planner"] == b]
            if ra.empty or rb.empty or not (ra["feasible"].iloc[0] and rb["feasible"].iloc[0]):
                continue
            r = np.asarray(rb["round_costs_ms"].iloc[0], dtype=float) / np.asarray(ra["round_costs_ms"].iloc[0],
                                                                                 dtype=float)
            per_task.append(r)
            tasks.append({"suite": suite, "task": task, f"{b} / {a}": stats.median_ci(r)[0],
                          f"{a} / best greedy": ra["ratio_to_best_baseline"].iloc[0],
                          f"{b} / best greedy": rb["ratio_to_best_baseline"].iloc[0],
                          f"{a} / TorchRec": ra["ratio_to_torchrec"].iloc[0],
                          f"{b} / TorchRec": rb["ratio_to_torchrec"].iloc[0]})
        med, lo, hi = stats.suite_ci(per_task) if per_task else (np.nan,) * 3
        aa, aa_lo, aa_hi = (float(g[c].iloc[0]) for c in ("aa_floor", "aa_ci_low", "aa_ci_high"))
        suites.append({"suite": suite, "tasks": len(per_task), f"{b} / {a}": med, "ci_low": lo, "ci_high": hi,
                       "A/A floor": f"{aa:.3f} [{aa_lo:.3f}, {aa_hi:.3f}]",
                       "verdict": stats.floor_verdict(lo, hi, aa_lo, aa_hi)})
    return pd.DataFrame(suites), pd.DataFrame(tasks)


def markdown(frame: pd.DataFrame, a: str, b: str, suite: str, hw_line: str, secs: float, uris: dict,
             note: str = "") -> str:
    from . import quality

    per_suite, per_task = paired(frame, a, b)
    summary = quality.summarize(frame)
    cols = ["suite", "planner", "tasks", "failed", "ratio_best_median", "ratio_best_ci_low", "ratio_best_ci_high",
            "ratio_best_worst", "ratio_torchrec_median", "measured_ms_median", "planning_s_median"]
    lines = [f"# {b} against {a}, side by side ({suite} suites)", "", hw_line, "",
             f"A = `{uris[a]}`, B = `{uris[b]}`. Every task is planned by both and by the greedy baselines and "
             "TorchRec's table-wise planner; the placements are measured in 5 rounds with real FBGEMM kernels (each "
             "round in a fresh process) and compared by paired per-round ratios. A suite's ratio is the median "
             "over its tasks with a bootstrap interval over tasks and rounds; the verdict is the ruler's rule: a "
             "difference only where the interval clears 1 and the suite's A/A floor (dim_greedy measured twice). "
             f"Measured in {secs / 60:.1f} min. `python -m benchmarks.model_ab` reproduces it." + note, "",
             "## B over A per suite", "", md_table(per_suite, {"tasks": 0}), "",
             "## Per task", "", md_table(per_task), "",
             "## Every planner per suite (over the best greedy baseline of each task)", "",
             md_table(summary[[c for c in cols if c in summary.columns]], {"tasks": 0, "failed": 0}), ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.model_ab", description=__doc__.split("\n")[0])
    ap.add_argument("--run", required=True, help="the pipeline folder whose registry holds both versions "
                                                 "(its mlflow.db) and whose calibration prices the all-to-all")
    ap.add_argument("--a", default="learned/1", help="planner A, e.g. learned/1 or learned@champion")
    ap.add_argument("--b", default="learned@challenger", help="planner B")
    ap.add_argument("--suite", default="main", choices=["main", "split"])
    ap.add_argument("--spec", action="append", default=[], metavar="FILE:DEVICES:GIB", type=spec_arg,
                    help="also a table list of one's own on DEVICES devices of GIB GiB (repeatable)")
    ap.add_argument("--note", default="", help="a sentence for the page: where A and B come from, why the lists")
    ap.add_argument("--name", default="model_ab", help="page name (default model_ab: model_ab.md)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--workdir", default=None, help="suite files (default: a temporary folder)")
    args = ap.parse_args(argv)
    import tempfile

    from embshard import registry
    from embshard.planners import learned_uri

    from . import pipeline_stages, quality

    info = pipeline_stages.reuse(args.run)  # its registry, batch and (newest run's) all-to-all calibration
    uris = {p: registry.pinned(learned_uri(p)) for p in (args.a, args.b)}
    cfg = configure(args.suite, args.a, args.b, args.spec)
    work = args.workdir or tempfile.mkdtemp(prefix="embshard-model-ab-")
    t0 = time.perf_counter()
    frame = quality.run(uris[args.a], cfg, work, info.batch_size, comm_root=info.root)
    secs = time.perf_counter() - t0
    os.makedirs(os.path.join(args.out, "raw"), exist_ok=True)
    frame.drop(columns=[c for c in ("error",) if c in frame.columns]).to_csv(
        os.path.join(args.out, "raw", f"{args.name}.csv"), index=False)
    write_text(os.path.join(args.out, f"{args.name}.md"),
               markdown(frame, args.a, args.b, args.suite, hardware().line(), secs, uris,
                        f" {args.note}" if args.note else ""))
    per_suite, _ = paired(frame, args.a, args.b)
    progress("model A/B: " + "; ".join(f"{r['suite']}: {r[f'{args.b} / {args.a}']:.3f} {r['verdict']}"
                                       for _, r in per_suite.iterrows()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
