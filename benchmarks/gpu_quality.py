"""The split suite's plans measured on a GPU (issue 24: "the same suite measured there, beside the CPU numbers").

A borrowed GPU machine has torch and (carried) FBGEMM but no MLflow, TorchRec or trained models, so the work is
cut in two, with the plans travelling as Parquet:

    python -m benchmarks.gpu_quality plan --run runs/local --out .gpu/quality        # here (CPU): every planner
    python -m benchmarks.gpu_quality measure --root .gpu/quality --out DIR \\
        --device cuda --batch-size 65536 --deadline-s 420                           # there: the ruler
    python -m benchmarks.gpu_quality measure --root .gpu/quality --out DIR2 --device cpu --batch-size 2048 \
        --calibration-dir runs/local/calibration --round-processes                    # here: the CPU counterpart
    python -m benchmarks.gpu_quality report --gpu DIR... [--cpu DIR2...] --out PAGE.md   # here: the page

Beside plans searched with a cost model trained on the GPU's own measurements (the CPU-trained one prices the
CPU's balance of lookups and all-to-all; split_runs/run3-branches/gpu-quality-nvidia-h100.md), in one device call
that also measures cut pieces for the next such model:

    python -m benchmarks.gpu_quality plan --run runs/local --out .gpu/quality \
        --cost-model gpu-whole=benchmarks/data/gpu-h100/costmodel-whole                  # adds learned@gpu-whole
    EMBSHARD_GPU_TASKS=task-04,task-01,task-00 bash .gpu/gpu_device_run.sh 570 setup splitcosts:150 quality
    embshard train-cost --costs splitcosts_gpu.parquet \
        --tables benchmarks/data/gpu-h100-split/tables.parquet --out /tmp/gpu-cost --no-register  # here, after
    python -m benchmarks.gpu_quality predict --root .gpu/quality --measured DIR \
        --model cpu=policy gpu=/tmp/gpu-cost/model --run runs/local --out PAGE.md      # each model's ranking

The two calls of 2026-11-27 (results/gpu-quality-nvidia-h100-slices.md) did this with a model trained on the GPU's
split-piece costs, and compared slice floors (`learned/128B`: the learned planner cutting no slice narrower than 128
bytes per row):

    python -m benchmarks.gpu_quality plan --run runs/local --out .gpu/quality2 --cost-model gpu-split=DIR/model \
        --slice-floors 128 --refined learned@gpu-split --planners learned torchrec_full torchrec_table_wise \
        lookup_greedy dim_greedy
    EMBSHARD_GPU_ROOT=.gpu/quality2 EMBSHARD_GPU_TASKS=task-01 bash .gpu/gpu_device_run.sh 350 setup quality

The main quality suite's tasks (quality.full_config: unseen synthetic tables, the Criteo-like and MLPerf-like
lists) the same way, each suite's first task before any suite's second (results/gpu-quality-main-nvidia-h100.md;
a task too long for the call's time left is skipped, as the 100-200-table ones were there):

    python -m benchmarks.gpu_quality plan --run runs/local --out .gpu/qmain --suite main --planners no_branches \
        policy_only torchrec_full torchrec_table_wise dim_greedy size_greedy lookup_greedy size_lookup_greedy
    EMBSHARD_GPU_ROOT=.gpu/qmain bash .gpu/gpu_device_run.sh 555 setup quality
    python -m benchmarks.gpu_quality report --suite main --gpu DIR... --cpu DIR2 --out PAGE.md

- plan: each selected task of the split suite (benchmarks.quality.split_config; --suite main: the main suite's)
  is planned by the split suite's planners (or `--planners`) with the run's models; the refined entry's
  (`--refined`, default learned) refinement candidates (embshard.refine.select: the first choice, its cut
  variants, the heuristics, TorchRec's table-wise plan; K=4) are kept too, unmeasured, and measured as
  `ENTRY+refine4`.
- measure: on the hardware at hand, the candidates are measured and the winner picked exactly as `embshard place
  --refine 4` does there (refine.measure_candidates), so `learned+refine4` is refined on the GPU itself; then every
  plan, the refined one included, is measured by the evaluation (embshard.evaluation.run: R paired rounds, the
  balanced estimate's shards in every round, dim_greedy measured twice for the A/A floor). Tasks go in priority
  order; a task that the time left (--deadline-s, from the rate measured so far) cannot hold is skipped and
  listed. Results are written after every task, so a call cut short keeps what it finished.
- report: per task, each planner's measured cost, its paired ratio to TorchRec's full plan and to the best greedy
  baseline with intervals, the gap to the balanced estimate, and the A/A floor; with --cpu the same plans measured
  on this CPU beside them.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import pandas as pd

HERE = os.path.dirname(os.path.abspath(__file__))
# (suite name in quality.split_config, device counts): the order of priority (the smallest first: its measured
# rate budgets the rest).
TASKS = [("MLPerf-like D=8-32", [8, 16]), ("hot table T=40 D=8-32", [16, 8, 32]),
         ("MLPerf-like D=16 on 4 hosts x 4", [16]), ("MLPerf-like D=8-32", [32])]
# no_branches: the learned planner without the split search's branches, measured beside it (paired, in the report)
PLANNERS = ["learned", "no_branches", "torchrec_full", "torchrec_table_wise", "lookup_greedy", "size_lookup_greedy",
            "dim_greedy"]
REFINED, K = "learned+refine4", 4
LEARNED = ("learned", "no_branches")  # the planners that load the run's policy
PAIRED = ("no_branches", "learned")  # every plan's paired ratio to these is in the report
AA = "dim_greedy"


def _selected_tasks(suite_set: str, out: str) -> list[tuple[str, str, pd.DataFrame, str]]:
    """(suite name, its tables.parquet, a one-task tasks frame, label) of each task to plan, in priority order.
    `split`: TASKS of the split suite. `main`: every task of the main quality suite (quality.full_config), the
    suites taken in turn (each suite's first task, then each one's second, ...), so that a device call cut short
    reaches each suite's first task early (a task too long for the time left is skipped)."""
    from benchmarks.quality import HELDOUT_SEED, _suite_files, full_config, split_config
    from embshard import schemas

    cfg = split_config() if suite_set == "split" else full_config()
    synthetic = pd.DataFrame()
    if any(s.source == "synthetic" for s in cfg.suites):
        from embshard.ingest.synthetic import generate_tables

        synthetic = generate_tables(cfg.population, seed=HELDOUT_SEED)
    folders: dict[str, tuple[str, pd.DataFrame]] = {}

    def suite_tasks(name: str) -> tuple[str, pd.DataFrame]:
        if name not in folders:
            suite = next(s for s in cfg.suites if s.name == name)
            tables_path, tasks_path = _suite_files(suite, cfg, os.path.join(out, "suites", f"{len(folders):02d}"),
                                                   synthetic)
            folders[name] = (tables_path, schemas.read(tasks_path, "tasks"))
        return folders[name]

    if suite_set == "split":
        picked = []
        for name, devices in TASKS:
            tables_path, tasks = suite_tasks(name)
            picked += [(name, tables_path, tasks[tasks["num_devices"] == D].reset_index(drop=True),
                        f"{name} / D={D}") for D in devices]
        return picked
    per_suite = []
    for suite in cfg.suites:
        tables_path, tasks = suite_tasks(suite.name)
        per_suite.append([(suite.name, tables_path, tasks.iloc[[i]].reset_index(drop=True),
                           f"{suite.name} / {tasks['task_id'].iloc[i]} D={int(tasks['num_devices'].iloc[i])}")
                          for i in range(len(tasks))])
    return [ts[i] for i in range(max(map(len, per_suite))) for ts in per_suite if i < len(ts)]


def _task_dirs(root: str) -> list[str]:
    with open(os.path.join(root, "order.json"), encoding="utf-8") as f:
        return [os.path.join(root, d) for d in json.load(f)]


def _labelled(spec: str, option: str) -> tuple[str, str]:
    """(LABEL, WHERE) of a LABEL=WHERE argument; a one-line exit otherwise."""
    label, _, where = spec.partition("=")
    if not label or not where:
        raise SystemExit(f"gpu_quality: {option} wants LABEL=PATH, got {spec!r}")
    return label, where


def plan(run: str, out: str, torchrec_timeout_s: float = 20.0, limit: int | None = None,
         cost_models: list[str] | None = None, slice_floors: list[int] | None = None,
         planners: list[str] | None = None, refined: str = "learned", suite_set: str = "split") -> None:
    """Plan the selected tasks (the first `limit` of them) here and write ROOT/<task>/{tables,tasks,plans,
    candidates}.parquet. `cost_models`: LABEL=PATH (a model folder of `embshard train-cost --out` or a model URI)
    each adds the entry `learned@LABEL`, the learned planner searching with that model instead of the one its
    policy was trained against (e.g. a model trained on the GPU's own measurements; the policy only proposes),
    measured beside the others. `slice_floors`: each learned entry (`learned`, `learned@LABEL`) is planned again
    with each of these split-search slice floors (bytes per row; the planner's own is its cost model's hardware's,
    splitting.speed_slice_bytes) as `ENTRY/NB`. `planners`: the entries besides the learned ones (default PLANNERS;
    fewer plans, a shorter device call). `refined`: the learned entry whose refinement candidates are kept (e.g.
    `learned@gpu`, the planner searching with a GPU-trained model, refined on the GPU as `place --refine` would).
    `suite_set`: `split` (TASKS) or `main` (every task of the main quality suite, _selected_tasks)."""
    from benchmarks import pipeline_stages
    from benchmarks.common import progress
    from embshard import costmodel, refine, schemas
    from embshard.planners import get_planner
    from embshard.types import load_tasks

    info = pipeline_stages.reuse(run)
    searched_with = {}  # entry -> the cost model it searches with
    for spec in cost_models or []:
        label, where = _labelled(spec, "--cost-model")
        searched_with[f"{LEARNED[0]}@{label}"] = costmodel.load(where)
    floored = {f"{e}/{n}B": (e, int(n)) for e in [LEARNED[0], *searched_with] for n in slice_floors or []}
    # `learned` always: its refinement candidates are what `measure` refines
    entries = list(dict.fromkeys([LEARNED[0], *(PLANNERS if planners is None else planners), *searched_with,
                                  *floored]))
    if refined not in entries:
        raise SystemExit(f"gpu_quality: --refined {refined!r} is not one of the planned entries ({', '.join(entries)})")
    os.makedirs(out, exist_ok=True)
    order = []
    for name, tables_path, one, tag in _selected_tasks(suite_set, out)[:limit]:
        sub = os.path.join(out, f"task-{len(order):02d}")
        os.makedirs(sub, exist_ok=True)
        schemas.write(schemas.read(tables_path, "tables"), os.path.join(sub, "tables.parquet"), "tables")
        schemas.write(one, os.path.join(sub, "tasks.parquet"), "tasks")
        task = load_tasks(os.path.join(sub, "tables.parquet"), os.path.join(sub, "tasks.parquet"), "test")[0]
        D = task.num_devices
        frames, cand_frames, cand_rows = [], [], []
        for p in entries:
            base, floor = floored.get(p, (p, None))
            kw = {"model_uri": info.policy_uri} if base in LEARNED or base in searched_with else (
                {"timeout_s": torchrec_timeout_s} if p.startswith("torchrec") else {})
            planner = get_planner(base.split("@")[0], **kw)
            if base in searched_with:
                planner.cost_model = searched_with[base]
            if floor is not None:
                planner.min_slice_bytes = floor
            if p == refined:
                refine.explore(planner)  # its cut variants become candidates, as under --refine
            t0 = time.perf_counter()
            pl = planner.plan_task(task)
            secs = time.perf_counter() - t0
            frames.append(pl.to_frame().assign(entry=p, planning_time_s=secs))
            if p == refined:
                picked = refine.select(refine.candidates(pl, planner.cost_model, torchrec=True), K)
                for j, c in enumerate(picked):
                    cand_frames.append(c.placement.to_frame().assign(entry=f"cand{j}"))
                    cand_rows.append({"entry": f"cand{j}", "label": c.label, "origin": c.origin,
                                      "predicted_ms": c.predicted_ms})
            progress(f"gpu_quality plan: {tag}: {p} in {secs:.1f} s")
        pd.concat(frames, ignore_index=True).to_parquet(os.path.join(sub, "plans.parquet"), index=False)
        pd.concat(cand_frames, ignore_index=True).to_parquet(os.path.join(sub, "candidates.parquet"),
                                                             index=False)
        pd.DataFrame(cand_rows).to_parquet(os.path.join(sub, "candidate_info.parquet"), index=False)
        with open(os.path.join(sub, "task.json"), "w", encoding="utf-8") as f:
            json.dump({"suite": name, "num_devices": D, "label": tag, "policy_uri": info.policy_uri,
                       "cpu_batch_size": int(info.batch_size), "cost_models": cost_models or [],
                       "slice_floors": slice_floors or [], "refined": refined}, f)
        order.append(os.path.basename(sub))
    with open(os.path.join(out, "order.json"), "w", encoding="utf-8") as f:
        json.dump(order, f)


class SavedPlan:
    """A plan made elsewhere, as a planner for the evaluation (it only hands back its placement)."""

    def __init__(self, placement, name: str):
        self.placement, self.name = placement, name

    def plan_task(self, task):
        if task.task_id != self.placement.task_id:
            raise ValueError(f"{self.name}: a plan of {self.placement.task_id}, asked for {task.task_id}")
        return self.placement


def _placements(path: str, tables, task) -> dict:
    import dataclasses

    from embshard.export.placements import placement_from_frame

    df = pd.read_parquet(path)
    out = {}
    for entry, rows in df.groupby("entry", sort=False):
        pl = placement_from_frame(rows, tables, task.num_devices, task.memory_bytes_per_device)
        out[str(entry)] = dataclasses.replace(pl, topology=task.devices, task_id=task.task_id)
    return out


def measure(root: str, out: str, device: str, batch_size: int, rounds: int, deadline_s: float,
            only: list[str] | None = None, calibration_dir: str | None = None, round_processes: bool = False) -> None:
    from embshard import evaluation, refine
    from embshard.bench.backends import hardware, resolve_device
    from embshard.bench.runner import MeasureSettings
    from embshard.ruler import Entry, distinct_shards
    from embshard.types import load_tasks

    t_start = time.perf_counter()
    # One communication calibration for every task (a CPU run: the pipeline run's; a GPU has its fixed formula).
    settings = MeasureSettings(device=device, batch_size=batch_size, calibration_dir=calibration_dir,
                               round_processes=round_processes)  # CPU: each round in a fresh process (ruler.py)
    hw = hardware(resolve_device(device))
    os.makedirs(out, exist_ok=True)
    evals, ratios, refines, skipped = [], [], [], []
    measured, spent = 0, 0.0  # shard measurements and their seconds so far: the rate that budgets a task
    dirs = _task_dirs(root)
    if only:  # the named tasks, in the order given (the first sets the rate that budgets the rest)
        dirs = [os.path.join(root, t) for t in only]
    for sub in dirs:
        with open(os.path.join(sub, "task.json"), encoding="utf-8") as f:
            info = json.load(f)
        tables_path, tasks_path = os.path.join(sub, "tables.parquet"), os.path.join(sub, "tasks.parquet")
        task = load_tasks(tables_path, tasks_path, "test")[0]
        plans = _placements(os.path.join(sub, "plans.parquet"), task.tables, task)
        cands = _placements(os.path.join(sub, "candidates.parquet"), task.tables, task)
        cinfo = pd.read_parquet(os.path.join(sub, "candidate_info.parquet"))
        picked = [refine.Candidate(r.label, r.origin, cands[r.entry], float(r.predicted_ms))
                  for r in cinfo.itertuples(index=False)]
        n_eval = distinct_shards([Entry(k, p) for k, p in plans.items()]) + task.num_devices  # + the A/A copy
        # + the balanced estimate's shards (each table alone, all fused), measured in every round (paired x BE)
        need = (distinct_shards([Entry(c.label, c.placement) for c in picked]) + n_eval + len(task.tables) + 1) \
            * rounds
        left = deadline_s - (time.perf_counter() - t_start)
        if measured and need * spent / measured > left:
            skipped.append({"task": info["label"], "shard_measurements": need,
                            "estimated_s": need * spent / measured, "left_s": left})
            print(f"skip {info['label']}: ~{need * spent / measured:.0f} s needed, {left:.0f} s left", flush=True)
            continue
        t0 = time.perf_counter()
        try:
            res = refine.measure_candidates(picked, rounds=rounds, settings=settings, seed=1)
            won = refine.winner_placement(res, K)
            given = {p: SavedPlan(pl, p) for p, pl in plans.items()}
            refined = f"{info.get('refined', LEARNED[0])}+refine{K}"  # REFINED unless plan --refined said otherwise
            given[refined] = SavedPlan(won, refined)
            planners = [*plans, refined, AA]
            ev = evaluation.run(tables_path, tasks_path, os.path.join(sub, f"eval-{device.split(':')[0]}"),
                                planners=planners, given=given, rounds=rounds, settings=settings, progress=False,
                                estimate_in_rounds=True)
        except Exception as exc:  # one task's failure (e.g. out of memory) must not cost the others
            import traceback

            traceback.print_exc()
            skipped.append({"task": info["label"], "shard_measurements": need, "estimated_s": np.nan,
                            "left_s": f"failed: {type(exc).__name__}: {str(exc)[:200]}"})
            continue
        refines.append(res.table.assign(task=info["label"], suite=info["suite"], hardware=hw))
        secs = time.perf_counter() - t0
        measured += need
        spent += secs
        frame = ev["frame"].assign(task=info["label"], suite=info["suite"], hardware=hw, batch_size=batch_size,
                                   wall_s=secs)
        evals.append(frame)
        ratios.append(ev["ratio_frame"].assign(task=info["label"], suite=info["suite"], hardware=hw))
        pd.concat(evals, ignore_index=True).to_parquet(os.path.join(out, "evaluation.parquet"), index=False)
        pd.concat(ratios, ignore_index=True).to_parquet(os.path.join(out, "ratios.parquet"), index=False)
        pd.concat(refines, ignore_index=True).to_parquet(os.path.join(out, "refine.parquet"), index=False)
        row = frame.set_index("planner")
        print(f"{info['label']}: {secs:.0f} s ({need} shard measurements); measured ms: "
              + ", ".join(f"{p} {row.loc[p, 'measured_cost_ms']:.3f}" for p in planners if p in row.index)
              + f"; refine winner {res.winner.label}", flush=True)
    pd.DataFrame(skipped, columns=["task", "shard_measurements", "estimated_s", "left_s"]).astype(
        {"left_s": str}).to_parquet(os.path.join(out, "skipped.parquet"), index=False)
    print(f"done in {time.perf_counter() - t_start:.0f} s on {hw}", flush=True)


def _verdicts(out_dirs: list[str]) -> pd.DataFrame:
    """One row per (task, planner) over the measure calls' folders: measured ms, gap to BE, ratio to TorchRec full
    [CI], to the best greedy baseline [CI], to each of PAIRED [CI] (paired per round), and the task's A/A floor."""
    from embshard import stats

    ev = pd.concat([pd.read_parquet(os.path.join(d, "evaluation.parquet")) for d in out_dirs], ignore_index=True)
    rf = pd.concat([pd.read_parquet(os.path.join(d, "ratios.parquet")) for d in out_dirs], ignore_index=True)
    rows = []
    for task, g in ev.groupby("task", sort=False):
        r = rf[rf["task"] == task]
        floor = stats.aa_floor(r.drop(columns=["task", "suite", "hardware"]), AA)
        rounds = {p: g[g["planner"] == p]["round_costs_ms"] for p in PAIRED}
        for row in g.itertuples(index=False):
            if row.planner == f"{AA}#2":
                continue
            paired = {}
            for p, other in rounds.items():
                m = (stats.median_ci(np.asarray(row.round_costs_ms) / np.asarray(other.iloc[0]))
                     if len(other) and row.planner != p else (np.nan,) * 3)
                paired.update({f"vs {p}": m[0], f"vs {p} lo": m[1], f"vs {p} hi": m[2]})
            full = r[(r["planner"] == row.planner) & (r["versus"] == "torchrec_full")]
            rows.append({"task": task, "planner": row.planner, "measured_ms": row.measured_cost_ms,
                         # paired (the estimate measured in the rounds) where the folder has it
                         "x_BE": (row.estimate_ratio if np.isfinite(getattr(row, "estimate_ratio", np.nan))
                                  else row.measured_cost_ms / row.balanced_estimate_ms),
                         "vs_torchrec_full": full["median_ratio"].iloc[0] if len(full) else np.nan,
                         "vs_tr_lo": full["ci_low"].iloc[0] if len(full) else np.nan,
                         "vs_tr_hi": full["ci_high"].iloc[0] if len(full) else np.nan,
                         "vs_best_greedy": row.ratio_to_best_baseline, "vs_bg_lo": row.ratio_ci_low,
                         "vs_bg_hi": row.ratio_ci_high, **paired, "aa": floor[0], "aa_lo": floor[1], "aa_hi": floor[2],
                         "hardware": row.hardware, "batch_size": row.batch_size})
    return pd.DataFrame(rows)


def report(gpu: list[str], cpu: list[str] | None, out: str) -> None:
    from benchmarks.common import md_table, write_text

    def ci(m, lo, hi):
        return "–" if not np.isfinite(m) else f"{m:.3f} [{lo:.3f}, {hi:.3f}]"

    g = _verdicts(gpu)
    c = _verdicts(cpu) if cpu else None
    cpu_line = "" if c is None else (
        f" Beside it, the same plans measured on {c['hardware'].iloc[0]} at batch {int(c['batch_size'].iloc[0])} "
        "(the batch the cost model was trained on), with the refinement run there.")
    lines = [f"# The split suite on a GPU ({g['hardware'].iloc[0]})", "",
             "Generated by `python -m benchmarks.gpu_quality report` (the module docstring says how the plans "
             f"travel). Each task's plans measured on {g['hardware'].iloc[0]} with FBGEMM's CUDA kernels at batch "
             f"{int(g['batch_size'].iloc[0])} (CUDA events), 5 paired ruler rounds; `learned+refine4` is refined by "
             f"measuring its 4 candidates there.{cpu_line} Ratios are paired per round, with 95% intervals; BE is the "
             "balanced estimate (every table fused on one device, over D; x BE is the median of per-round ratios "
             "where its shards were measured in the rounds, as `measure` now does). A ratio whose interval overlaps "
             "the A/A floor is no difference.", ""]
    # The GPU's tasks in their measured order, then any that only the CPU measured (a GPU call ran out of time).
    tasks = list(dict.fromkeys([*g["task"], *(c["task"] if c is not None else [])]))
    # no_branches always; `learned` where an entry searched with another cost model (learned@LABEL) is there
    shown = [p for p in PAIRED if p != LEARNED[0] or g["planner"].str.startswith(f"{LEARNED[0]}@").any()]
    for task in tasks:
        t = g[g["task"] == task]
        tc = c[c["task"] == task] if c is not None else g.iloc[:0]
        rows = []
        for name in dict.fromkeys([*t["planner"], *tc["planner"]]):
            row = {"planner": name}
            m = t[t["planner"] == name]
            if len(m):
                r = m.iloc[0]
                row.update({"GPU ms": r.measured_ms, "GPU x BE": r.x_BE,
                            "GPU vs TorchRec full [95%]": ci(r.vs_torchrec_full, r.vs_tr_lo, r.vs_tr_hi),
                            "GPU vs best greedy [95%]": ci(r.vs_best_greedy, r.vs_bg_lo, r.vs_bg_hi)})
                row.update({f"GPU vs {p} [95%]": ci(r[f"vs {p}"], r[f"vs {p} lo"], r[f"vs {p} hi"])
                            for p in shown})
            m = tc[tc["planner"] == name]
            if len(m):
                x = m.iloc[0]
                row.update({"CPU x BE": x["x_BE"],
                            "CPU vs TorchRec full [95%]": ci(x["vs_torchrec_full"], x["vs_tr_lo"], x["vs_tr_hi"])})
                row.update({f"CPU vs {p} [95%]": ci(x[f"vs {p}"], x[f"vs {p} lo"], x[f"vs {p} hi"]) for p in shown})
            rows.append(row)
        floors = [f"on the {hw}: {ci(*f[['aa', 'aa_lo', 'aa_hi']].iloc[0])}" for hw, f in (("GPU", t), ("CPU", tc))
                  if len(f)]
        lines += [f"## {task}", "", f"A/A floor ({AA} vs itself) " + "; ".join(floors)
                  + ("" if len(t) else " (not measured on the GPU: the device call's time ran out)"), "",
                  md_table(pd.DataFrame(rows).fillna("–")), ""]
    write_text(out, "\n".join(lines))


def _paired(rf: pd.DataFrame, task: str, planner: str, versus: str) -> tuple[float, float, float]:
    """(median, low, high) of `planner`'s paired per-round ratio to `versus` on `task` (NaNs if not measured)."""
    r = rf[(rf["task"] == task) & (rf["planner"] == planner) & (rf["versus"] == versus)]
    return (float(r["median_ratio"].iloc[0]), float(r["ci_low"].iloc[0]), float(r["ci_high"].iloc[0])) if len(r) \
        else (np.nan, np.nan, np.nan)


def main_rows(out_dirs: list[str]) -> pd.DataFrame:
    """One row per task of the main suite's measure folders: the learned entries' paired ratios to the task's best
    greedy plan and to TorchRec's two plans, each with its interval and its verdict against the task's A/A floor."""
    from embshard import stats

    ev = pd.concat([pd.read_parquet(os.path.join(d, "evaluation.parquet")) for d in out_dirs], ignore_index=True)
    rf = pd.concat([pd.read_parquet(os.path.join(d, "ratios.parquet")) for d in out_dirs], ignore_index=True)
    # a task measured by two calls (one run again): the later folder's measurement
    ev = ev.drop_duplicates(["task", "planner"], keep="last")
    rf = rf.drop_duplicates(["task", "planner", "versus"], keep="last")
    rows = []
    for task, g in ev.groupby("task", sort=False):
        aa = stats.aa_floor(rf[rf["task"] == task].drop(columns=["task", "suite", "hardware"]), AA)
        by = g.set_index("planner")
        row = {"suite": g["suite"].iloc[0], "task": task, "best greedy": by["best_baseline"].iloc[0],
               "aa": aa}
        for p in ("learned", "learned+refine4", "policy_only"):
            if p not in by.index:
                continue
            r = by.loc[p]
            row[f"{p} / best greedy"] = (r.ratio_to_best_baseline, r.ratio_ci_low, r.ratio_ci_high)
            for versus in ("torchrec_table_wise", "torchrec_full"):
                row[f"{p} / {versus}"] = _paired(rf, task, p, versus)
            row[f"{p} x BE"] = r.estimate_ratio
        rows.append(row)
    return pd.DataFrame(rows)


def report_main(gpu: list[str], cpu: list[str] | None, out: str) -> None:
    """The main quality suite's page: per task, the learned plan, its refinement on that hardware and the policy
    alone against the best greedy plan and TorchRec's, on the GPU and (same plans) on this CPU, with verdicts."""
    from benchmarks.common import md_table, write_text
    from embshard import stats

    def ci(v):
        m, lo, hi = v if isinstance(v, tuple) else (np.nan,) * 3
        return "–" if not np.isfinite(m) else f"{m:.3f} [{lo:.3f}, {hi:.3f}]"

    def verdict(v, aa):
        return "–" if not isinstance(v, tuple) else stats.floor_verdict(v[1], v[2], aa[1], aa[2])

    g = main_rows(gpu)
    frames = [("GPU", g)]
    if cpu:  # the GPU's task order, then any task only the CPU measured
        c = main_rows(cpu)
        order = {t: i for i, t in enumerate(dict.fromkeys([*g["task"], *c["task"]]))}
        frames.append(("CPU", c.sort_values("task", key=lambda t: t.map(order), kind="stable")))
    hw = pd.read_parquet(os.path.join(gpu[0], "evaluation.parquet"))["hardware"].iloc[0]
    lines = [f"# The main quality suite on a GPU ({hw})", "",
             "Generated by `python -m benchmarks.gpu_quality report --suite main` (the module docstring says how the "
             "plans travel). The main suite's tasks (quality.md: unseen synthetic tables, the Criteo-like and "
             "MLPerf-DLRM-like lists), planned on the dev machine, measured there with FBGEMM's CUDA kernels (CUDA "
             "events), 5 paired ruler rounds, the all-to-all by the NVLink formula; `learned+refine4` refined by "
             "measuring its 4 candidates on that hardware. Ratios are paired per round with 95% intervals; a verdict "
             "is `faster`/`slower` only where the interval clears 1 and the task's A/A floor (dim_greedy vs "
             "itself). Best greedy: the best of the four greedy heuristics on that task, chosen by measurement.", ""]
    verdict_rows = []
    for where, f in frames:
        table = []
        for d in f.to_dict("records"):
            aa = d["aa"]
            table.append({"task": d["task"], "A/A floor": ci(aa), "best greedy": d["best greedy"],
                          "learned / best greedy": ci(d.get("learned / best greedy")),
                          "verdict": verdict(d.get("learned / best greedy"), aa),
                          "refined / best greedy": ci(d.get("learned+refine4 / best greedy")),
                          "refined verdict": verdict(d.get("learned+refine4 / best greedy"), aa),
                          "policy_only / best greedy": ci(d.get("policy_only / best greedy")),
                          "learned / TorchRec table-wise": ci(d.get("learned / torchrec_table_wise")),
                          "learned / TorchRec full": ci(d.get("learned / torchrec_full")),
                          "learned x BE": d.get("learned x BE", np.nan)})
        t = pd.DataFrame(table)
        for p in ("verdict", "refined verdict"):
            verdict_rows.append({"hardware": where, "entry": "learned" if p == "verdict" else "learned+refine4",
                                 **{v: int((t[p] == v).sum()) for v in ("faster", "no difference", "slower")}})
        lines += [f"## On the {where}" + ("" if where == "GPU" else " (the same plans, batch 2,048)"), "",
                  md_table(t.drop(columns=["learned x BE"]) if where == "CPU" else t), ""]
    lines += ["## Verdicts against the best greedy plan (tasks)", "", md_table(pd.DataFrame(verdict_rows)), ""]
    skipped = pd.concat([pd.read_parquet(os.path.join(d, "skipped.parquet")) for d in gpu], ignore_index=True)
    left = [t for t in dict.fromkeys(skipped["task"]) if t not in set(g["task"])]
    if left:
        lines += ["Planned but not measured on the GPU (the device time ran out): " + "; ".join(left) + ".", ""]
    write_text(out, "\n".join(lines))


def predict(root: str, measured: list[str], models: list[str], run: str | None, out: str) -> None:
    """Every distinct plan and refinement candidate that `measured` (measure calls' folders) holds: its measured
    cost there and the slowest device each cost model predicts, with each model's per-task rank correlation
    (Spearman) to the measurements: how well it would have chosen on that machine. `models`: LABEL=PATH (a
    `train-cost --out` model folder or a model URI), or LABEL=policy for the cost model the run's policy plans with."""
    from scipy.stats import spearmanr

    from benchmarks.common import md_table, write_text
    from embshard import costmodel
    from embshard.planners.scoring import placement_costs
    from embshard.ruler import Entry, shard_keys
    from embshard.types import load_tasks

    estimators = {}
    for spec in models:
        label, where = _labelled(spec, "--model")
        if where == "policy":
            from benchmarks import pipeline_stages
            from embshard.planners import get_planner

            if not run:
                raise SystemExit("gpu_quality predict: LABEL=policy needs --run")
            estimators[label] = get_planner("learned", model_uri=pipeline_stages.reuse(run).policy_uri).cost_model
        else:
            estimators[label] = costmodel.load(where)
    ev = pd.concat([pd.read_parquet(os.path.join(d, "evaluation.parquet")) for d in measured], ignore_index=True)
    rf = pd.concat([pd.read_parquet(os.path.join(d, "refine.parquet")) for d in measured], ignore_index=True)
    hw = ev["hardware"].iloc[0]
    rows, summary = [], []
    for sub in _task_dirs(root):
        with open(os.path.join(sub, "task.json"), encoding="utf-8") as f:
            label = json.load(f)["label"]
        if not (ev["task"] == label).any():
            continue
        task = load_tasks(os.path.join(sub, "tables.parquet"), os.path.join(sub, "tasks.parquet"), "test")[0]
        plans = _placements(os.path.join(sub, "plans.parquet"), task.tables, task)
        cands = _placements(os.path.join(sub, "candidates.parquet"), task.tables, task)
        cinfo = pd.read_parquet(os.path.join(sub, "candidate_info.parquet")).set_index("label")["entry"]
        measured_here = [(f"plan {r.planner}", plans[r.planner], r.measured_cost_ms)
                         for r in ev[ev["task"] == label].itertuples() if r.planner in plans]
        measured_here += [(f"candidate {r.candidate}", cands[cinfo[r.candidate]], r.measured_cost_ms)
                          for r in rf[rf["task"] == label].itertuples()]
        seen, task_rows = set(), []
        for what, placement, ms in measured_here:  # one row per distinct plan (up to device order), measured first
            key = tuple(sorted(map(str, shard_keys(Entry(what, placement)))))
            if key in seen:
                continue
            seen.add(key)
            row = {"task": label, "plan": what, "measured_ms": ms}
            row.update({f"{m} predicted ms": float(np.max(placement_costs(est, placement)))
                        for m, est in estimators.items()})
            task_rows.append(row)
        frame = pd.DataFrame(task_rows)
        summary.append({"task": label, "distinct plans": len(frame), **{
            f"{m}: Spearman": spearmanr(frame["measured_ms"], frame[f"{m} predicted ms"])[0] for m in estimators}})
        rows += task_rows
    lines = [f"# Cost models against measured plans ({hw})", "",
             "Generated by `python -m benchmarks.gpu_quality predict`. Each distinct plan and refinement candidate "
             f"measured on {hw} (its first measurement), and the slowest device each cost model predicts for it. "
             "Spearman: the rank correlation of a model's predictions with the measurements within a task (1: it "
             "orders the plans as the machine does).", "",
             "Models: " + ", ".join(f"`{s}`" for s in models), "", md_table(pd.DataFrame(summary)), "",
             md_table(pd.DataFrame(rows).sort_values(["task", "measured_ms"], kind="stable")), ""]
    write_text(out, "\n".join(lines))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("plan")
    p.add_argument("--run", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--limit", type=int, default=None, help="plan only the first N tasks (in priority order)")
    p.add_argument("--suite", default="split", choices=["split", "main"], dest="suite_set",
                   help="split: the split suite's tasks (default); main: the main quality suite's, suites in turn")
    p.add_argument("--cost-model", nargs="+", default=None, dest="cost_models",
                   help="LABEL=PATH (a train-cost --out model folder or a model URI): adds the entry learned@LABEL, "
                        "the learned planner searching with that model, e.g. one trained on the GPU's measurements")
    p.add_argument("--slice-floors", nargs="+", type=int, default=None,
                   help="bytes per row: each learned entry planned again with each split-search slice floor (ENTRY/NB)")
    p.add_argument("--refined", default="learned",
                   help="the learned entry whose refinement candidates are measured (default learned)")
    p.add_argument("--planners", nargs="+", default=None,
                   help=f"the entries besides the learned ones (default: {' '.join(PLANNERS)})")
    m = sub.add_parser("measure")
    m.add_argument("--root", required=True)
    m.add_argument("--out", required=True)
    m.add_argument("--device", default="cuda")
    m.add_argument("--batch-size", type=int, default=65536)
    m.add_argument("--rounds", type=int, default=5)
    m.add_argument("--deadline-s", type=float, default=420.0)
    m.add_argument("--tasks", default=None,
                   help="comma-separated task folders (task-00,...) to measure, in this order; default all")
    m.add_argument("--calibration-dir", default=os.environ.get("EMBSHARD_CALIBRATION_DIR"),
                   help="the run's comm_calibration.json folder (default EMBSHARD_CALIBRATION_DIR)")
    m.add_argument("--round-processes", action="store_true",
                   help="CPU: each ruler round in a fresh process, as the suites measure (ruler.py)")
    r = sub.add_parser("report")
    r.add_argument("--gpu", required=True, nargs="+", help="the measure calls' --out folders on the GPU")
    r.add_argument("--cpu", default=None, nargs="+", help="the same on this CPU")
    r.add_argument("--out", required=True)
    r.add_argument("--suite", default="split", choices=["split", "main"], dest="suite_set",
                   help="the plans' suite (plan --suite): main gives a page of verdicts against the best greedy plan")
    q = sub.add_parser("predict")
    q.add_argument("--root", required=True, help="the plan folder the measured plans came from")
    q.add_argument("--measured", required=True, nargs="+", help="the measure calls' --out folders")
    q.add_argument("--model", required=True, nargs="+", dest="models",
                   help="LABEL=PATH (a train-cost --out model folder or a model URI) or LABEL=policy")
    q.add_argument("--run", default=None, help="the pipeline run whose policy LABEL=policy means")
    q.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    if a.cmd == "plan":
        plan(a.run, a.out, limit=a.limit, cost_models=a.cost_models, slice_floors=a.slice_floors,
             planners=a.planners, refined=a.refined, suite_set=a.suite_set)
    elif a.cmd == "measure":
        measure(a.root, a.out, a.device, a.batch_size, a.rounds, a.deadline_s,
                a.tasks.split(",") if a.tasks else None, a.calibration_dir, a.round_processes)
    elif a.cmd == "predict":
        predict(a.root, a.measured, a.models, a.run, a.out)
    elif a.suite_set == "main":
        report_main(a.gpu, a.cpu, a.out)
    else:
        report(a.gpu, a.cpu, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
