"""`embshard evaluate`: several planners on the same tasks, measured side by side with real kernels: the ruler.

The evaluation itself (one task: embshard.evaluation.evaluate_task; the tasks of a split: evaluation.run) lives
in embshard.evaluation, which the promotion (jobs.promote) runs too; this module is its command line.
"""
from __future__ import annotations

import argparse
import logging
import os

from ..bench.runner import MeasureSettings
from ..checks import gib_text
from ..errors import EmbshardError
from ..evaluation import (  # noqa: F401  (re-exported: the evaluation's names, importable from the job)
    PLANNER_NAMES,
    USER_PLAN,
    check_planner_names,
    entry_labels,
    evaluate_task,
    format_summary,
    judged_costs,
    measured_balanced_estimate,
    measured_singles,
    placement_accuracy,
    ranking_agreement,
    run,
    summarize,
)
from ..planners.baselines import BASELINES
from ..ruler import DEFAULT_ROUNDS

log = logging.getLogger(__name__)

# What `embshard evaluate` writes and reads: its --out is checked before any work (cli.check_output).
OUTPUT = {"kind": "folder", "inputs": ("tables", "tasks", "plan"),
          "writes": ("evaluation.parquet", "ratios.parquet", "placements.parquet", "evaluation.png")}


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tables", required=True,
                   help="tables.parquet, or a table spec (read as `embshard ingest --source spec` reads it)")
    p.add_argument("--tasks", default=None,
                   help="tasks.parquet (default with --plan FILE: the plan.json's own task, its tables, devices and "
                        "memory)")
    p.add_argument("--task-id", default=None, metavar="ID",
                   help="evaluate only this task of --tasks, whatever its split (default with --plan: the plan's "
                        "own task_id when the tasks file has it, else every task of --split)")
    p.add_argument("--planners", default=",".join(["learned", *BASELINES]),
                   help=f"comma-separated planner names, each one of: {PLANNER_NAMES}. A name given twice is "
                        "measured as two separate entries (an A/A test of the ruler)")
    p.add_argument("--plan", default=None, metavar="FILE",
                   help="also measure this placement (a plan.json of any version, or the torchrec_plan.json "
                        "`embshard export` wrote), as the entry `user_plan`; it must be a plan of every task evaluated")
    p.add_argument("--memory-gb", type=gib_text, default=None,
                   help="with --plan and no --tasks: memory per device for embedding weights, GiB, of the plan's "
                        "task (needed for a torchrec_plan.json, which records none; for a plan.json it replaces "
                        "the plan's own)")
    p.add_argument("--devices-per-host", type=int, default=None, metavar="L",
                   help="with --plan and no --tasks: devices per host of a torchrec_plan.json's task (host h holds "
                        "ranks h*L .. h*L+L-1), so that its table-row-wise cuts and the planners' are measured on "
                        "their hosts (default: one host; a plan.json records its own hosts)")
    p.add_argument("--split", default="test", help="which tasks: test (default), train or all")
    p.add_argument("--max-tasks", type=int, default=None, help="evaluate at most this many tasks")
    p.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS,
                   help=f"measuring rounds (default {DEFAULT_ROUNDS}): each measures every distinct device shard "
                        "once, in a fresh random order")
    p.add_argument("--batch-size", type=int, default=None, help="benchmark batch size (default: the bench's)")
    p.add_argument("--timer", default="auto", choices=["auto", "wall", "thread_cpu"],
                   help="CPU clock (auto: thread CPU time at 1 thread)")
    p.add_argument("--statistic", default="median", choices=["median", "min"],
                   help="of a shard's timed iterations within a round (median, or min-of-k)")
    p.add_argument("--calibration-dir", default=None, metavar="DIR",
                   help="folder of the comm_calibration.json the all-to-all model uses, e.g. a pipeline "
                        "folder's OUT/calibration (runs/local/calibration) or a run's data folder (default: "
                        "EMBSHARD_CALIBRATION_DIR, else calibrated now: a fresh "
                        "calibration moves from one call to the next, so compare evaluations that share one)")
    p.add_argument("--round-processes", action="store_true",
                   help="measure each round in a fresh process (CPU; about 2.5 s more per round): in one "
                        "process, large tables measure 12-17%% faster once it has measured for a while "
                        "(its recycled heap), so a task's ratios depend on what was measured before it; "
                        "fresh processes take that history out")
    p.add_argument("--estimate-in-rounds", action="store_true",
                   help="measure the balanced estimate (all tables fused, each table alone) in every round beside "
                        "the plans, so that each plan's multiple of it is a paired ratio with an interval "
                        "(estimate_ratio, estimate_ratio_ci_low/high); about one more measurement per table and "
                        "round (default: measured once per task, outside the rounds)")
    p.add_argument("--out", required=True,
                   help="output folder: evaluation.parquet, ratios.parquet, placements.parquet, evaluation.png")


def main(args) -> int:
    import tempfile

    from .. import checks, schemas
    from ..ingest.spec import is_spec_path

    planners = [p for p in args.planners.split(",") if p]
    if not planners and getattr(args, "plan", None):  # your plan alone: nothing to say it is faster or slower than
        raise EmbshardError("no planners to measure the plan beside", field="planners",
                            fix="give --planners, e.g. learned,lookup_greedy,torchrec_full")
    given = {}
    tasks, task_ids = args.tasks, [args.task_id] if args.task_id else None
    if tasks is None and not getattr(args, "plan", None):
        raise EmbshardError("no tasks to evaluate", field="tasks",
                            fix="give --tasks (a tasks.parquet, e.g. from `embshard tasks`), or --plan FILE to "
                                "measure a plan.json on its own task beside --planners")
    memory_gb = getattr(args, "memory_gb", None)
    if memory_gb is not None and (tasks is not None or not getattr(args, "plan", None)):
        raise EmbshardError("--memory-gb sizes the task of --plan, and --tasks has its own memory per device",
                            field="memory_gb", fix="leave out --memory-gb, or --tasks to measure the plan's own task")
    per_host = getattr(args, "devices_per_host", None)
    if per_host is not None and (tasks is not None or not getattr(args, "plan", None)):
        raise EmbshardError("--devices-per-host lays out the task of --plan, and --tasks has its own hosts",
                            field="devices_per_host",
                            fix="leave out --devices-per-host, or --tasks to measure the plan's own task")
    with tempfile.TemporaryDirectory(prefix="embshard-evaluate-") as scratch:
        tables = args.tables
        if is_spec_path(tables):  # the tables ingest would make of the spec (the same seed: the same tables)
            from ..ingest.spec import tables_from_spec

            tables = os.path.join(scratch, "tables.parquet")
            schemas.write(tables_from_spec(args.tables, progress=True, reread=True), tables, "tables")
        if getattr(args, "plan", None):
            from ..export.user_plan import NAME, UserPlan
            from ..types import load_tasks

            user_plan = UserPlan(args.plan)
            if tasks is None:  # the plan's own task: is it better than what the planners make of the same task?
                if is_spec_path(args.tables):
                    # A spec lists the model's tables (a tables.parquet is a pool a task takes some of): a plan
                    # that leaves one out is not a plan of that model, as `export` says too.
                    left_out = sorted(set(schemas.read(tables, "tables")["table_id"].astype(str))
                                      - set(user_plan.table_ids()))
                    if left_out:
                        raise EmbshardError(
                            f"{len(left_out)} table(s) of the spec {args.tables} are not placed by the plan "
                            f"({', '.join(left_out[:3])}{', ...' if len(left_out) > 3 else ''})", path=args.plan,
                            field="tables", fix="plan again with these tables (embshard place --tables "
                            f"{args.tables}), or pass the spec the plan was made from")
                else:  # a tables.parquet may be a run's pool: a plan of a few of its tables is said, not refused
                    from ..export.plan_json import PLAN_AGAIN, left_out_note

                    note = left_out_note(user_plan.table_ids(), schemas.read(tables, "tables")["table_id"], tables)
                    if note:
                        log.warning("evaluate --plan: %s: only the plan's tables are measured " + PLAN_AGAIN, note)
                tasks = os.path.join(scratch, "tasks.parquet")
                memory = None if memory_gb is None else checks.memory_bytes(memory_gb, field="memory_gb")
                schemas.write(user_plan.task_frame(memory, per_host), tasks, "tasks")
                task_ids = None
            elif task_ids is None and user_plan.own_task_id() in set(
                    schemas.read(tasks, "tasks")["task_id"].astype(str)):
                task_ids = [str(user_plan.own_task_id())]
                print(f"evaluating task {task_ids[0]} of {tasks}: the plan's own task (--task-id to choose another)")
            # Refused before anything is measured: the file must be a plan of every task evaluated.
            try:
                task_list = load_tasks(tables, tasks, "all" if args.tasks is None else args.split,
                                       limit=args.max_tasks, task_ids=task_ids)
            except EmbshardError as exc:
                if args.tasks is not None or exc.field != "table_ids":  # e.g. an unreadable --tables: as it is
                    raise
                # The task is the plan's own (written to a scratch file): the user's files are the plan and --tables.
                raise type(exc)(f"the plan's task does not fit --tables: {exc.message}", path=args.plan,
                                field=exc.field, fix=f"give --tables the tables this plan was made for (not "
                                                     f"{args.tables})") from None
            user_plan.check_tasks(task_list)
            planners = [p for p in planners if p != NAME] + [NAME]
            if len(set(planners)) == len(planners):
                # Your plan once more, as an entry of its own: the ruler's A/A floor in this very run, without
                # which a ratio of 0.93 read "faster" inside a floor of [0.89, 1.04].
                planners.append(NAME)
            given[NAME] = user_plan
        return _evaluate(args, planners, given, tables, tasks, task_ids,
                         "all" if args.tasks is None else args.split)


def _evaluate(args, planners: list[str], given: dict, tables: str, tasks: str, task_ids: list[str] | None,
              split: str) -> int:
    from ..bench.comm import given_calibration_dir, shared_calibration_dir

    res = run(tables, tasks, args.out, planners=planners, given=given, task_ids=task_ids,
              split=split, max_tasks=args.max_tasks, rounds=args.rounds,
              settings=MeasureSettings(batch_size=args.batch_size, timer=args.timer,
                                       statistic=args.statistic, round_processes=args.round_processes,
                                       calibration_dir=given_calibration_dir(args.calibration_dir)
                                       or shared_calibration_dir()),
              estimate_in_rounds=args.estimate_in_rounds)
    print(res["summary_text"])
    frame = res["frame"]
    for r in frame[~frame["feasible"].astype(bool)].itertuples():  # `failed` counts them; here is why
        print(f"{r.planner} could not place task {r.task_id}: {r.error}")
    if given:
        print(_against_user_plan(res["summary"], int(args.rounds), res["ratio_frame"], _measured_on(frame)))
    rk = res["ranking"]
    if rk["pairs"]:
        print(f"cost model ranking: it orders {rk['correct']} of the {rk['pairs']} placement pairs the ruler tells "
              f"apart the same way ({100 * rk['accuracy']:.0f}%)")
    if rk.get("placements"):
        print(f"cost model on whole placements: slowest device {rk['placement_mape']:.1f}% MAPE over "
              f"{rk['placements']} placements; Spearman within a task {rk['within_task_spearman']:.2f} "
              f"(mean over {rk['spearman_tasks']} tasks)")
    placed = f", {res['placements_path']}" if res.get("placements_path") else ""
    print(f"wrote {res['evaluation']}, {res['ratios']}{placed} and {res['plot']}")
    return 0


WIDE_FLOOR = 0.2  # an A/A floor wider than this (about +-10%) hides differences a team cares about: said so


def _measured_on(frame) -> str | None:
    """'cpu:AMD EPYC ..., batch 2048' from the evaluation's rows: what the verdict holds for (None: not recorded)."""
    if frame is None or "measured_on" not in getattr(frame, "columns", ()):
        return None
    where = ", ".join(sorted({str(v) for v in frame["measured_on"].dropna()}))
    batch = sorted({int(b) for b in frame["batch_size"].dropna()}) if "batch_size" in frame.columns else []
    return (where or "?") + (f", batch {', '.join(map(str, batch))}" if batch else "")


def _against_user_plan(summary, rounds: int, ratios=None, measured_on: str | None = None) -> str:
    """What `--plan` asks: each planner's measured cost over the user's plan, paired per round, with its
    interval and what it says: a difference only where the interval clears 1, and the ruler's A/A floor too where a
    planner was named twice (`ratios`: the evaluation's ratio frame); no verdict from fewer than
    stats.VERDICT_ROUNDS rounds (a user read "faster" off 2). `measured_on`: the hardware and batch measured,
    said first (a user asking "is it better on our GPUs?" had a CPU answer with no label on it)."""
    import numpy as np

    from ..stats import VERDICT_ROUNDS, aa_floor, floor_verdict

    if "median_ratio_user_plan" not in summary.columns:
        return f"no planner placed a task beside {USER_PLAN}: nothing to compare it with"
    repeated = sorted((str(n).split("#")[0] for n in summary.index if str(n).endswith("#2")),
                      key=lambda n: n != USER_PLAN)  # your plan against itself first (it is always measured twice)
    aa_lo = aa_hi = np.nan
    head = f"against your plan ({USER_PLAN}), paired over {rounds} round(s) (under 1: faster than yours"
    if repeated and ratios is not None:
        _, aa_lo, aa_hi = aa_floor(ratios, repeated[0])
        head += (f"; the ruler's A/A floor, {repeated[0]} against itself: [{aa_lo:.3f}, {aa_hi:.3f}]"
                 if np.isfinite(aa_lo) and np.isfinite(aa_hi) else
                 f"; no A/A floor from {rounds} round{'s' if rounds != 1 else ''}")  # it had printed [nan, nan]
    lines = [head + "):"]
    if measured_on:
        lines.append(f"  measured on {measured_on}: it holds for this hardware (on other hardware, a GPU, measure "
                     "there: costs and even the order of plans may differ)")
    for name, row in summary.iterrows():
        med, lo, hi = (float(row[k]) for k in ("median_ratio_user_plan", "user_plan_ci_low", "user_plan_ci_high"))
        if name == USER_PLAN or str(name).endswith("#2") or not np.isfinite(med):
            continue
        verdict = floor_verdict(lo, hi, aa_lo, aa_hi) if rounds >= VERDICT_ROUNDS else \
            f"no verdict from {rounds} round{'s' if rounds != 1 else ''} (--rounds {VERDICT_ROUNDS} or more)"
        if verdict == "no difference":  # which of the two it did not clear (an interval above 1 had read bare)
            verdict += (": its interval clears 1 but not the A/A floor" if (hi < 1 or lo > 1) else
                        ": its interval holds 1")
        interval = f"[{lo:.3f}, {hi:.3f}]" if np.isfinite(lo) and np.isfinite(hi) else "[no interval]"
        lines.append(f"  {name}: {med:.3f} {interval} {verdict}")
    if np.isfinite(aa_lo) and np.isfinite(aa_hi) and aa_hi - aa_lo > WIDE_FLOOR:
        lines.append(f"  the A/A floor is wide ({aa_hi - aa_lo:.2f}): this machine's noise hides differences smaller "
                     "than that; measure on a quiet machine, with more --rounds or --round-processes, or on the "
                     "target hardware")
    return "\n".join(lines)
