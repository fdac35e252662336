"""Evaluating planners on tasks with the ruler: what `embshard evaluate` (jobs.evaluate) and the promotion
(jobs.promote) both run, so neither job imports the other.

`evaluate_task` evaluates one task: per task every planner plans; the placements are then measured in R rounds
(embshard.ruler: each distinct device shard once per round, in a fresh random order, with a freshly built
operator; a placement's cost in a round is its slowest device). `run` evaluates the tasks of a split one by one
and writes the outputs. Planners are compared by paired per-round ratios (embshard.stats):
- per task: the median ratio over rounds with a 95% bootstrap interval, against the best greedy baseline (chosen
  on the rounds not used for the ratio: no winner's curse), against each other baseline, and against TorchRec;
- per planner over the tasks: the median of task ratios with an interval (bootstrap over tasks and rounds) and a
  Wilcoxon signed-rank p-value against 1.
A planner named twice ("lookup_greedy,lookup_greedy") is measured as two entries whose shards are built and
timed separately (an A/A test of the ruler: its ratio should be 1 within the noise floor). An entry "NAME+refineK"
is NAME's plan refined by measurement (embshard.refine: K candidates measured in rounds of their own; its planning
time includes them), then measured here like any other plan. A planner that cannot
place a task is recorded as failed and counted as such. The balanced estimate is measured too: all of a task's
tables as one fused shard and each table alone: per cost head the smaller of the two, over the device count. It is
an estimate of a perfectly balanced plan, not a bound: plans measured in rounds can come in below it. By default
its shards are measured once per task, outside the rounds; with `estimate_in_rounds` they are measured in every
round beside the plans' shards (the same processes, the same drift), so that a plan's multiple of the estimate is
a paired per-round ratio with an interval, like any other ratio here (`estimate_ratio`, `estimate_ratio_ci_*`).
"""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from . import schemas, stats, storage
from .bench.runner import MeasureSettings, measure_placement
from .checks import MAX_ROUNDS
from .errors import EmbshardError
from .placement import Placement
from .planners import LEARNED_COMPOSITIONS
from .planners.baselines import BASELINES, GREEDY_BASELINES
from .ruler import DEFAULT_ROUNDS, Entry, RoundCosts, measure_probed, round_settings
from .tableset import TableSet
from .types import Shard, Task, load_tasks

# The entry of a plan the user handed in (`embshard evaluate --plan`, export.user_plan.NAME): every planner is
# also compared with it, paired per round, since "is it better than the plan we run now?" is the question.
USER_PLAN = "user_plan"

log = logging.getLogger(__name__)
# Every learned composition (planners.compose.COMPOSITIONS) takes @ALIAS or /VERSION like `learned`.
PLANNER_NAMES = "learned, learned@ALIAS, learned/VERSION, " + ", ".join(
    c for c in LEARNED_COMPOSITIONS if c != "learned") + " (each also with @ALIAS or /VERSION), " + \
    ", ".join(BASELINES) + ", torchrec_table_wise, torchrec_full; any of them + refineK (e.g. learned+refine4: " \
    "its plan refined by measuring K candidates here, as `embshard place --refine K`)"


@dataclass
class TaskResult:
    """What evaluate_task returns for one task: the rows of evaluation.parquet and ratios.parquet, the
    placements with measured device costs, the per-round costs by entry, and the cost model's ranking."""
    rows: list[dict] = field(default_factory=list)
    ratio_rows: list[dict] = field(default_factory=list)
    placements: list[pd.DataFrame] = field(default_factory=list)
    round_costs: dict[str, list[float]] = field(default_factory=dict)
    shard_measurements: int = 0
    pairs: int = 0       # placement pairs the ruler tells apart
    correct: int = 0     # ... that the judging cost model orders the same way
    judged: list[tuple[float, float]] = field(default_factory=list)  # (predicted, measured) per placement


def entry_labels(planners: list[str]) -> list[tuple[str, str, str]]:
    """(label, planner name, namespace) per requested entry: repeats of a name become "name#2", "name#3", ... in a
    namespace of their own (their shards are never shared with the first)."""
    seen: dict[str, int] = {}
    out = []
    for name in planners:
        seen[name] = seen.get(name, 0) + 1
        k = seen[name]
        out.append((name if k == 1 else f"{name}#{k}", name, "" if k == 1 else f"#{k}"))
    return out


def check_planner_names(planners: list[str]) -> None:
    from .planners import is_planner_name
    from .refine import check_k, parse_refined

    for name in planners:
        refined = parse_refined(name)
        if refined is not None and is_planner_name(refined[0]):
            check_k(refined[1], field="planners")
            continue
        if is_planner_name(name):
            continue
        raise EmbshardError(f"unknown planner {name!r}", field="planners", fix=f"use names from: {PLANNER_NAMES}")


def evaluate_task(task: Task, labels: list[tuple[str, str, str]], planner_objs: dict, *, rounds: int,
                  settings: MeasureSettings, single_settings: MeasureSettings, judge=None,
                  singles_cache: dict | None = None, seed: int = 0, estimate_in_rounds: bool = False) -> TaskResult:
    """One task: every entry plans it, the placements are measured side by side in `rounds` ruler rounds, the
    balanced estimate is measured (with `single_settings`: a round's timed work; in every round with
    `estimate_in_rounds`), and the rows are assembled: one per entry (costs, intervals, ratios to the best greedy
    baseline and to TorchRec, the multiple of the estimate), paired ratios to the baselines (and A/A), the
    placement frames with measured device costs. `judge`: the cost model whose ranking of the placements is checked
    against the ruler."""
    sub, D, mem = task.tables, task.num_devices, task.memory_bytes_per_device
    res = TaskResult()
    planned: dict[str, Placement] = {}
    for label, name, _ns in labels:
        row = {"task_id": task.task_id, "planner": label, "num_tables": len(sub), "num_devices": D,
               "memory_bytes_per_device": mem, "feasible": False, "error": None, "rounds": int(rounds)}
        t0 = time.perf_counter()
        try:
            planned[label] = planner_objs[name].plan_task(task)
            row["feasible"] = True
        except EmbshardError as exc:
            row["error"] = str(exc)
        row["planning_time_s"] = time.perf_counter() - t0
        res.rows.append(row)
    entries = [Entry(label, planned[label], ns) for label, _, ns in labels if label in planned]
    probes = estimate_probes(sub) if entries and estimate_in_rounds else None
    measured = (measure_probed(entries, int(rounds), settings, seed=seed, probes=probes) if entries else
                RoundCosts(np.zeros((0, int(rounds))), np.zeros((0, D, int(rounds)))))
    costs, device_costs = measured.costs, measured.device_costs
    res.shard_measurements = measured.per_round * int(rounds)
    by_label = {e.label: costs[j] for j, e in enumerate(entries)}
    if judge is not None:
        judged = judged_costs(judge, entries)
        res.pairs, res.correct = ranking_agreement(judged, costs)
        res.judged = [(p, float(np.median(costs[j]))) for j, p in judged.items()]
    res.round_costs = {k: [float(x) for x in v] for k, v in by_label.items()}
    # The balanced estimate: each table alone, and all tables fused on one device; per round when its shards were
    # measured in the rounds (est_rounds), else once per task.
    if probes is not None:
        est_rounds, table_rounds = balanced_estimate_rounds(measured.probes, len(sub), D)
        est_split, est_table = float(np.median(est_rounds)), float(np.median(table_rounds))
    else:
        singles = measured_singles(sub, D, single_settings, singles_cache)
        est_split = measured_balanced_estimate(sub, D, singles, single_settings, task.task_id)
        est_table = float(_table_wise(est_split, float(singles.sum(1).max()), D))
        est_rounds = None
    # Comparators: the greedy baselines measured here (first entries of their names) and TorchRec's plans.
    greedy = {lbl: by_label[lbl] for lbl, name, ns in labels if name in GREEDY_BASELINES and not ns
              and lbl in by_label}
    torchrec = {lbl: by_label[lbl] for lbl, name, ns in labels if name.startswith("torchrec") and not ns
                and lbl in by_label}
    best_cost, best_names = stats.held_out_best(greedy) if greedy else (None, [])
    tr_cost = stats.held_out_best(torchrec)[0] if torchrec else None
    for j, e in enumerate(entries):
        row = next(r for r in res.rows if r["planner"] == e.label)
        c = costs[j]
        med, lo, hi = stats.median_ci(c)
        row.update(measured_cost_ms=med, cost_ci_low=lo, cost_ci_high=hi, round_costs_ms=[float(x) for x in c])
        per_dev = np.median(device_costs[j, :e.placement.num_devices], axis=1)
        row["measured_imbalance"] = float(per_dev.max() / max(per_dev.mean(), 1e-12))
        # Tables cut column- and row-wise; every planner may cut tables, so the estimate treats each table as
        # divisible (the table-wise one, which owes the largest single table, is kept beside it).
        row["column_splits"] = len({s.table for s in e.placement.shards if s.kind == "column"})
        row["row_splits"] = len({s.table for s in e.placement.shards if s.kind == "row"})
        row["balanced_estimate_ms"] = est_split
        row["balanced_estimate_table_wise_ms"] = est_table
        if est_rounds is not None:  # paired: this entry's cost over the estimate of the same round
            e_med, e_lo, e_hi = stats.median_ci(c / est_rounds)
        else:
            e_med, e_lo, e_hi = med / est_split, np.nan, np.nan
        row.update(estimate_ratio=e_med, estimate_ratio_ci_low=e_lo, estimate_ratio_ci_high=e_hi,
                   estimate_in_rounds=est_rounds is not None)
        row["gap_to_estimate"] = e_med - 1.0  # negative: measured below the estimate
        pred = predicted_device_costs(planner_objs[e.label.split("#")[0]], e.placement)
        row["predicted_cost_ms"] = float(pred.max()) if pred is not None else np.nan
        if "refined" in e.placement.meta:  # a refined entry: what its refinement measured, to read back later
            row["refinement"] = json.dumps(e.placement.meta["refined"])
        if best_cost is not None:
            r_med, r_lo, r_hi = stats.median_ci(c / best_cost)
            row.update(best_baseline=max(set(best_names), key=best_names.count),
                       best_baseline_ms=float(np.median(best_cost)), ratio_to_best_baseline=r_med,
                       ratio_ci_low=r_lo, ratio_ci_high=r_hi, ratios_to_best_baseline=[float(x) for x in
                                                                                      c / best_cost])
        if tr_cost is not None:
            row["ratio_to_torchrec"] = stats.median_ci(c / tr_cost)[0]
        user = by_label.get(USER_PLAN)
        if user is not None and e.label != USER_PLAN:
            u_med, u_lo, u_hi = stats.median_ci(c / user)
            row.update(ratio_to_user_plan=u_med, ratio_user_plan_ci_low=u_lo, ratio_user_plan_ci_high=u_hi,
                       ratios_to_user_plan=[float(x) for x in c / user])
        # Paired ratios to every other entry that is a baseline or the user's plan (and to the first of a repeated
        # name: A/A).
        for k, other in enumerate(entries):
            base = other.label.split("#")[0]
            if other.label == e.label or not (base in BASELINES or base.startswith("torchrec") or base == USER_PLAN
                                              or e.label.split("#")[0] == base):
                continue
            m, lo2, hi2 = stats.median_ci(c / costs[k])
            res.ratio_rows.append({"task_id": task.task_id, "planner": e.label, "versus": other.label,
                                   "median_ratio": m, "ci_low": lo2, "ci_high": hi2, "rounds": int(rounds),
                                   "round_ratios": [float(x) for x in c / costs[k]]})
        frame = e.placement.to_frame(pred)
        frame["planner"] = e.label  # the entry's own label: an A/A repeat is NAME#2 (its rows had read NAME)
        frame["measured_cost_ms"] = [float(per_dev[d]) for d in frame["device"]]
        res.placements.append(frame)
    return res


def run(tables: str, tasks: str, out: str, *, planners: list[str], split: str = "test",
        max_tasks: int | None = None, rounds: int = DEFAULT_ROUNDS, settings: MeasureSettings | None = None,
        planner_kw: dict | None = None, progress: bool = True, seed: int = 0,
        given: dict | None = None, estimate_in_rounds: bool = False, task_ids: list[str] | None = None) -> dict:
    """Evaluate `planners` on the tasks of `split` (evaluate_task per task) and write OUT/evaluation.parquet,
    ratios.parquet, placements.parquet and evaluation.png (all or none). `given`: planner objects built by the
    caller (name -> anything with `plan_task`, e.g. a user's plan file), listed in `planners` by that name.
    `estimate_in_rounds`: measure the balanced estimate in every round (evaluate_task), each table alone included:
    about one more measurement per table and round, so opt-in. `task_ids`: only these tasks (any split). Returns
    the frames, the summary, each task's per-round costs and the cost model's ranking accuracy."""
    from tqdm import tqdm

    from .planners.base import check_feasible

    if not planners:
        raise EmbshardError("no planners given", field="planners", fix="e.g. --planners learned,size_lookup_greedy")
    if not 1 <= int(rounds) <= MAX_ROUNDS:  # 10**9 rounds had failed allocating 44.7 GiB in a traceback
        raise EmbshardError(f"{rounds:,} rounds", field="rounds",
                            fix=f"measure 1 to {MAX_ROUNDS} rounds (5 or more to compare)")
    if max_tasks is not None and int(max_tasks) < 1:  # 0 used to mean "all" silently
        raise EmbshardError(f"invalid value {max_tasks}", field="max_tasks",
                            fix="give at least 1, or leave it out to evaluate every task of the split")
    check_planner_names([p for p in planners if p not in (given or {})])
    task_list = load_tasks(tables, tasks, split, limit=max_tasks, task_ids=task_ids)
    # A task that no planner can place is bad input, not a failed planner: refuse before measuring anything.
    for t in task_list:
        check_feasible(t.tables, t.num_devices, t.memory_bytes_per_device, f"{os.fspath(tasks)} (task {t.task_id})")
    settings = settings or MeasureSettings()
    # The balanced estimate's measurements (each table alone, all tables fused) take a round's timed work, not a
    # full single measurement's: it is a reference, and the singles were most of an evaluation's time.
    single_settings = round_settings(settings)
    labels = entry_labels(planners)
    given = given or {}
    planner_objs = {name: given[name] if name in given else _make_planner(name, planner_kw or {}, settings)
                    for name in dict.fromkeys(planners)}
    batch = warn_batch_mismatch(planner_objs, settings)
    rows, placements, ratio_rows = [], [], []
    round_costs: dict[str, dict[str, list[float]]] = {}
    singles_cache: dict = {}
    ranking: dict = {"pairs": 0, "correct": 0}
    judged_tasks: list[list[tuple[float, float]]] = []  # per task: (predicted, measured) cost of each placement
    # The cost model that judges placements (the learned planner's): how often it orders two placements of a
    # task the way the ruler does, on the pairs the ruler tells apart (paired interval clear of 1).
    judge = next((m for m in (getattr(p, "cost_model", None) for p in planner_objs.values()) if m is not None), None)
    t_start = time.perf_counter()
    shard_measurements = 0
    bar = tqdm(total=len(task_list), desc="evaluate (measured rounds)", unit="task", disable=not progress)
    for t in task_list:
        one = evaluate_task(t, labels, planner_objs, rounds=int(rounds), settings=settings,
                            single_settings=single_settings, judge=judge, singles_cache=singles_cache, seed=seed,
                            estimate_in_rounds=estimate_in_rounds)
        rows += [{**r, "batch_size": batch} for r in one.rows]
        ratio_rows += one.ratio_rows
        placements += one.placements
        round_costs[t.task_id] = one.round_costs
        shard_measurements += one.shard_measurements
        if judge is not None:
            ranking["pairs"] += one.pairs
            ranking["correct"] += one.correct
            judged_tasks.append(one.judged)
        bar.update(1)
    bar.close()
    wall = time.perf_counter() - t_start
    df = pd.DataFrame(rows)
    from .bench import backends

    # what the numbers are of, in the files a team shares: this machine's kernels, not the target's
    df["measured_on"] = backends.hardware(backends.resolve_device(settings.device))
    for col in ("measured_cost_ms", "ratio_to_best_baseline", "ratio_ci_low", "ratio_ci_high", "ratio_to_torchrec",
                "best_baseline", "best_baseline_ms", "gap_to_estimate"):
        if col not in df.columns:
            df[col] = np.nan
    ratios = pd.DataFrame(ratio_rows, columns=["task_id", "planner", "versus", "median_ratio", "ci_low", "ci_high",
                                               "rounds", "round_ratios"])
    summary = summarize(df)
    with storage.staged_dir(out) as stage:  # every output or none
        _write_parquet(df, os.path.join(stage, "evaluation.parquet"))
        _write_parquet(ratios, os.path.join(stage, "ratios.parquet"))
        if placements:
            schemas.write(pd.concat(placements, ignore_index=True), os.path.join(stage, "placements.parquet"),
                          "placements")
        plot_evaluation(df, os.path.join(stage, "evaluation.png"))
    eval_path = storage.join(out, "evaluation.parquet")
    plot_path = storage.join(out, "evaluation.png")
    _log_to_mlflow(summary, plot_path)
    return {"evaluation": eval_path, "ratios": storage.join(out, "ratios.parquet"), "plot": plot_path, "frame": df,
            "placements_path": storage.join(out, "placements.parquet") if placements else None,
            "ratio_frame": ratios, "summary": summary, "summary_text": format_summary(summary, int(rounds)),
            "round_costs": round_costs, "rounds": int(rounds), "wall_s": wall,
            "ranking": {**ranking, "accuracy": ranking["correct"] / ranking["pairs"] if ranking["pairs"] else
                        float("nan"), **placement_accuracy(judged_tasks)},
            "shard_measurements": shard_measurements}


def warn_batch_mismatch(planner_objs: dict, settings: MeasureSettings) -> int:
    """The batch size measured (the settings', else the device's default); one warning per model-based planner whose
    cost model was measured at another: it plans for its own batch, and per-lookup and fixed costs weigh otherwise
    at another (a user's list: learned 0.70x the best greedy at the model's 2048, 1.03x at 512)."""
    from .bench.runner import resolve_settings

    batch = int(resolve_settings(settings)["batch_size"])
    for name, p in planner_objs.items():
        trained = getattr(getattr(getattr(p, "cost_model", None), "config", None), "batch_size", None)
        if trained and int(trained) != batch:
            # the batch given (leave it out) or the device's default (another device's model: give the model's)
            fix = (f"give --batch-size {int(trained)}" if settings.batch_size is None
                   else f"leave out --batch-size, or give --batch-size {int(trained)}")
            log.warning("%s plans with a cost model measured at batch %d; this evaluation measures batch %d, so its "
                        "plans are judged at a batch they were not made for (fix: %s)", name, int(trained), batch, fix)
    return batch


def judged_costs(model, entries: list[Entry]) -> dict[int, float]:
    """The cost model's predicted slowest device of each placement (repeated A/A entries left out), by entry."""
    from .planners.scoring import placement_costs

    return {j: float(placement_costs(model, e.placement).max()) for j, e in enumerate(entries) if "#" not in e.label}


def ranking_agreement(pred: dict[int, float], costs: np.ndarray) -> tuple[int, int]:
    """(pairs the ruler tells apart, pairs the cost model orders the same way) among one task's placements.

    A pair counts when the 95% interval of its paired per-round ratio excludes 1 (a difference beyond the noise).
    `pred`: judged_costs, the model's predicted slowest device per entry (A/A repeats are not in it).
    """
    keep = sorted(pred)
    pairs = correct = 0
    for a in range(len(keep)):
        for b in range(a + 1, len(keep)):
            i, j = keep[a], keep[b]
            med, lo, hi = stats.median_ci(costs[i] / costs[j])
            if not (lo > 1.0 or hi < 1.0) or pred[i] == pred[j]:
                continue
            pairs += 1
            correct += int((pred[i] > pred[j]) == (med > 1.0))
    return pairs, correct


def placement_accuracy(judged_tasks: list[list[tuple[float, float]]]) -> dict:
    """The cost model on whole placements: MAPE of the predicted slowest device against the measured cost (median
    over rounds), and the Spearman of predicted against measured among one task's placements, averaged over the
    tasks with >= 3 placements (across tasks it would mostly rank task sizes, which says nothing about planning)."""
    from scipy.stats import spearmanr

    flat = np.array([pm for task in judged_tasks for pm in task], dtype=float).reshape(-1, 2)
    ok = np.isfinite(flat).all(1) & (flat[:, 1] > 0)
    mape = float(np.mean(np.abs(flat[ok, 0] - flat[ok, 1]) / flat[ok, 1]) * 100) if ok.any() else float("nan")
    rhos = []
    for task in judged_tasks:
        a = np.array(task, dtype=float).reshape(-1, 2)
        if len(a) >= 3 and np.ptp(a[:, 0]) > 0 and np.ptp(a[:, 1]) > 0:
            rhos.append(float(spearmanr(a[:, 0], a[:, 1]).statistic))
    return {"placement_mape": mape, "placements": int(ok.sum()),
            "within_task_spearman": float(np.mean(rhos)) if rhos else float("nan"), "spearman_tasks": len(rhos)}


def summarize(df: pd.DataFrame) -> pd.DataFrame:
    """Per planner: tasks, failures, the median over tasks of the ratio to the best baseline with its interval
    (bootstrap over tasks and rounds) and Wilcoxon p, the worst task, the ratio to TorchRec, the median gap."""
    out = []
    for name, g in df.groupby("planner", sort=False):
        med, lo, hi = _pooled(g, "ratios_to_best_baseline")
        u_med, u_lo, u_hi = _pooled(g, "ratios_to_user_plan")
        out.append({"planner": name, "tasks": len(g), "failed": int((~g["feasible"].astype(bool)).sum()),
                    "median_ms": g["measured_cost_ms"].median(),
                    "median_ratio_best_baseline": med, "ci_low": lo, "ci_high": hi,
                    "wilcoxon_p": stats.wilcoxon_p(g["ratio_to_best_baseline"].dropna()),
                    "worst_ratio_best_baseline": g["ratio_to_best_baseline"].max(),
                    "median_ratio_torchrec": g["ratio_to_torchrec"].median(),
                    **({"median_ratio_user_plan": u_med, "user_plan_ci_low": u_lo, "user_plan_ci_high": u_hi}
                       if np.isfinite(u_med) else {}),  # only when `--plan` was measured beside it
                    "median_gap_to_estimate": g["gap_to_estimate"].median(),
                    "median_planning_s": g["planning_time_s"].median()})
    return pd.DataFrame(out).set_index("planner")


def _pooled(g: pd.DataFrame, column: str) -> tuple[float, float, float]:
    """The median over a planner's tasks of the per-round ratios in `column` (lists), with the bootstrap interval
    over tasks and rounds; NaNs when no task has them."""
    per_task = [np.asarray(v, dtype=float) for v in g.get(column, pd.Series(dtype=object))
                if isinstance(v, (list, np.ndarray)) and len(v)]
    return stats.suite_ci(per_task) if per_task else (np.nan, np.nan, np.nan)


def format_summary(summary: pd.DataFrame, rounds: int = 1) -> str:
    """The summary as text, without the columns nothing filled (e.g. the TorchRec ratio when no TorchRec planner
    ran): a column of NaN tells a reader nothing."""
    summary = summary.dropna(axis=1, how="all")
    with pd.option_context("display.width", 180, "display.max_columns", 20, "display.float_format", "{:.3f}".format):
        interval = ("the 95% interval of the median" if rounds >= 6 else
                    f"a task's {stats.interval_words(rounds)}, a suite's bootstrap interval over tasks and rounds")
        return (f"measured cost per planner over {rounds} round(s) (ratios: lower is better; [ci_low, ci_high] is "
                f"{interval}; failed = tasks it could not place; gap = measured / balanced estimate "
                "- 1, an estimate of a perfectly balanced plan, not a bound: a gap can be negative)\n"
                + summary.to_string())


def bar_reference(df: pd.DataFrame) -> tuple[str, str, str, str]:
    """(value, interval low, interval high columns, axis label) of the evaluation plot's bars: against the best
    greedy baseline when one was run, else the user's plan (`--plan` beside TorchRec or learned planners alone had
    drawn no bar at all), else milliseconds."""
    for value, low, high, label in (
            ("ratio_to_best_baseline", "ratio_ci_low", "ratio_ci_high", "measured cost / best greedy baseline"),
            ("ratio_to_user_plan", "ratio_user_plan_ci_low", "ratio_user_plan_ci_high",
             f"measured cost / {USER_PLAN} (--plan)")):
        if value in df and np.isfinite(df[value].to_numpy(dtype=float)).any():
            return value, low, high, label
    return "measured_cost_ms", "cost_ci_low", "cost_ci_high", "measured cost (ms)"


def plot_evaluation(df: pd.DataFrame, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    planners = list(dict.fromkeys(df["planner"]))
    tasks = list(dict.fromkeys(df["task_id"]))
    fig, ax = plt.subplots(1, 2, figsize=(13, 4.2), gridspec_kw={"width_ratios": [3, 1]})
    width = 0.8 / max(len(planners), 1)
    ref = bar_reference(df)
    for k, name in enumerate(planners):
        sub = df[df["planner"] == name].set_index("task_id").reindex(tasks)
        mid = sub[ref[0]].to_numpy(dtype=float)
        err = np.vstack([mid - sub[ref[1]].to_numpy(dtype=float), sub[ref[2]].to_numpy(dtype=float) - mid])
        if name == USER_PLAN and ref[0] == "ratio_to_user_plan":  # the reference itself: 1 where it was measured
            mid, err = np.where(np.isfinite(sub["measured_cost_ms"].to_numpy(dtype=float)), 1.0, np.nan), 0 * err
        ax[0].bar(np.arange(len(tasks)) + k * width, np.nan_to_num(mid), width, label=name,
                  yerr=np.nan_to_num(np.clip(err, 0, None)), capsize=2, error_kw={"lw": 0.8})
    if ref[0] != "measured_cost_ms":
        ax[0].axhline(1.0, color="black", lw=0.8, ls="--")
    ax[0].set_xticks(np.arange(len(tasks)) + 0.4 - width / 2)
    ax[0].set_xticklabels(tasks, rotation=60, fontsize=7)
    rounds = int(df["rounds"].max()) if "rounds" in df and len(df) else 0
    # the bars' interval as stats.interval_words says it, short (under 6 rounds it is the rounds' range)
    bars = "95% interval" if rounds >= 6 else f"range of {rounds} rounds" if rounds > 1 else "one round"
    ax[0].set_ylabel(f"{ref[3]}\n(median over rounds; bars: {bars})", fontsize=8)
    ax[0].legend(fontsize=7, ncol=3)
    data = [df[df["planner"] == n]["gap_to_estimate"].dropna() * 100 for n in planners]
    ax[1].boxplot(data, tick_labels=planners, vert=True)
    ax[1].tick_params(axis="x", rotation=70, labelsize=7)
    ax[1].set_ylabel("gap to the balanced estimate (%)")
    where = f" on {df['measured_on'].iloc[0]}" if "measured_on" in df and len(df) else ""
    fig.suptitle(f"embshard evaluation: measured with real kernels{where}, side by side, in {rounds} rounds")
    fig.tight_layout()
    with storage.atomic_write(path) as f:
        fig.savefig(f, format="png", dpi=110)
    plt.close(fig)


HEAD_COLUMNS = (["fwd_compute_ms"], ["bwd_compute_ms"], ["fwd_comm_ms", "bwd_comm_ms"])


def measured_singles(tables: TableSet, num_devices: int, settings: MeasureSettings,
                     cache: dict | None = None) -> np.ndarray:
    """(N, 3) measured fwd compute, bwd compute and comm of every table alone on one of D devices. `cache`
    ((table id, D) -> heads) lets the tasks of one evaluation, which share tables, measure each table once."""
    cache = {} if cache is None else cache
    out = np.zeros((len(tables), len(HEAD_COLUMNS)))
    for i in range(len(tables)):
        key = (str(tables.table_ids[i]), int(num_devices))
        if key not in cache:
            one = Placement.from_assignment(tables.subset([i]), np.zeros(1, dtype=np.int64), num_devices, 2**62,
                                            planner="single")
            row = measure_placement(one, settings).iloc[0]
            cache[key] = [sum(float(row[c]) for c in cols) for cols in HEAD_COLUMNS]
        out[i] = cache[key]
    return out


FUSED_PROBE = "all tables fused"


def estimate_probes(tables: TableSet) -> dict[str, list[Shard]]:
    """The balanced estimate's shards as ruler probes (ruler.measure_probed): all tables fused on one device, and
    each table alone (a plan's device holding just that table shares its measurement)."""
    return {FUSED_PROBE: [Shard(i, 0) for i in range(len(tables))],
            **{f"alone:{i}": [Shard(i, 0)] for i in range(len(tables))}}


def balanced_estimate_rounds(probes: dict[str, np.ndarray], num_tables: int,
                             num_devices: int) -> tuple[np.ndarray, np.ndarray]:
    """(R,) the balanced estimate of each round from its probes' heads (estimate_probes), the same formula as
    `measured_balanced_estimate`; and (R,) the table-wise one (at least the largest table alone)."""
    singles = np.stack([probes[f"alone:{i}"] for i in range(num_tables)])  # (N, R, 3)
    est = _estimate(probes[FUSED_PROBE], singles.sum(0), num_devices)
    return est, _table_wise(est, singles.sum(2).max(0), num_devices)


def _table_wise(estimate, largest_single, num_devices: int):
    """The table-wise estimate: at least the costliest table alone; on one device the all-on-one plan, the only
    one there is (`_estimate`), which no single table's floor applies to."""
    return estimate if num_devices <= 1 else np.maximum(estimate, largest_single)


def _estimate(fused_heads: np.ndarray, singles_sum: np.ndarray, num_devices: int):
    """The balanced estimate's formula over the last axis (the heads): sum of min(fused, sum of singles) / D; on
    one device the fused cost itself (all tables fused is the only plan there is)."""
    if num_devices <= 1:
        return np.asarray(fused_heads).sum(-1)
    return np.minimum(fused_heads, singles_sum).sum(-1) / num_devices


def measured_balanced_estimate(tables: TableSet, num_devices: int, singles: np.ndarray,
                               settings: MeasureSettings, task_id: str) -> float:
    """Sum over heads of min(all tables fused on one device, sum of singles) / D: the balanced estimate of any
    plan, column splits included (a table-wise plan also owes its largest single table; the caller adds that term).

    All-on-one / D (docs/method.md, "Balanced estimate") would bound a sub-additive fused cost, the sum of
    singles / D a super-additive one; measured CPU heads are of both kinds (forward shares work, backward grows
    faster than linearly, the all-to-all pays its latency once per device), so each head takes the smaller of the
    two. Not a bound of measured plans: these terms are measured once, outside the plans' rounds, and a device's
    fused compute in its own context (cache, operator size) is not the share of the all-on-one shard's.
    """
    fused = Placement.from_assignment(tables, np.zeros(len(tables), dtype=np.int64), num_devices, 2**62,
                                      planner="balanced_estimate", task_id=task_id)
    row = measure_placement(fused, settings).iloc[0]  # device 0 holds everything; its all-to-all is for D ranks
    fused_heads = np.array([sum(float(row[c]) for c in cols) for cols in HEAD_COLUMNS])
    return float(_estimate(fused_heads, singles.sum(0), num_devices))


def _make_planner(name: str, planner_kw: dict, settings: MeasureSettings):
    """A planner by entry name; "NAME+refineK" is NAME's plan refined by measuring K candidates on this machine,
    with the evaluation's settings (its own rounds: the evaluation re-measures the winner independently)."""
    from .planners import get_planner
    from .refine import RefinedPlanner, parse_refined

    refined = parse_refined(name)
    if refined is None:
        return get_planner(name, **planner_kw.get(name, {}))
    base, k = refined
    return RefinedPlanner(get_planner(base, **planner_kw.get(name, planner_kw.get(base, {}))), k,
                          settings=settings, name=name)


def predicted_device_costs(planner, placement: Placement):
    """Each device's predicted cost (ms) of `placement` by the planner's own cost model; None for a planner
    without one (the heuristics, TorchRec's)."""
    model = getattr(planner, "cost_model", None)
    if model is None:
        return None
    from .planners.scoring import placement_costs

    return placement_costs(model, placement)


def _write_parquet(df: pd.DataFrame, path: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    with storage.atomic_write(path) as f:
        pq.write_table(pa.Table.from_pandas(df, preserve_index=False), f)


def _log_to_mlflow(summary: pd.DataFrame, plot_path: str) -> None:
    try:
        import mlflow
    except ImportError:  # a measuring host without MLflow (a bare GPU image) has no run to log to
        return

    if mlflow.active_run() is None:
        return
    for name, r in summary.iterrows():
        # MLflow metric names allow neither "@" nor "#" (an A/A repeat "x#2" becomes "x_copy2")
        key = name.replace("@", "_at_").replace("/", "_v").replace("#", "_copy")
        for col in ("median_ratio_best_baseline", "worst_ratio_best_baseline", "median_gap_to_estimate"):
            if np.isfinite(r[col]):
                mlflow.log_metric(f"{key}.{col}", float(r[col]))
    if os.path.exists(plot_path):
        mlflow.log_artifact(plot_path)
