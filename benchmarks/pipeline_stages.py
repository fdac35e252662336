"""The models the harness evaluates: train them with one real Airflow run of the pipeline, or reuse a run folder.

`train(out, params)` runs `embshard.pipeline.run` (dag.test(): every task through Airflow's task runner) and
reads each stage's wall time from that run's task instances in Airflow's own database. `reuse(run_dir)` finds
the newest finished run under a `make run` folder (e.g. runs/local) and reads the same facts from it.
"""
from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass, field

import pandas as pd

from .common import md_table, progress

OUTER_LOOP_STEPS = ("measure_policy_plans", "refit_cost_model", "train_policy")
STAGE_ORDER = ["check_params", "ingest", "sample_shards", "benchmark", "train_cost_model", "train_policy",
               *[f"{step}_r{r}" for r in (2, 3) for step in OUTER_LOOP_STEPS],
               "evaluate_and_promote", "export_placements"]
# The embedded pipeline as the full harness runs it: the defaults, sized to leave the harness time for the rest.
FULL_PARAMS = {"num_tables": 240, "num_tasks": 8, "tables_per_task": "20-60", "devices": 4, "memory_gb": 128.0,
               "bench_shards": 300, "bench_chunks": 2, "bench_batch_size": 1024, "eval_tasks": 3,
               "eval_planners": ["dim_greedy", "size_greedy", "lookup_greedy", "size_lookup_greedy"]}
# The configuration tests/test_pipeline_e2e.py runs end to end (smaller than embshard.pipeline.QUICK_PARAMS; no
# large multi-hot tables, as there). The gate's baseline is size_greedy, as there: the quick run checks the
# mechanics, export included, and a tiny planner judged against the strong greedies on one task is left undecided
# now and then (CI once: no champion, export skipped, a red harness test).
QUICK_PARAMS = {"num_tables": 40, "hot_large_fraction": 0.0, "num_tasks": 2, "tables_per_task": "6-10", "devices": 2,
                "memory_gb": 256.0, "bench_shards": 16, "bench_chunks": 2, "bench_batch_size": 256,
                "policy_iterations": 10, "cost_members": 2, "eval_tasks": 1, "eval_planners": ["size_greedy"]}


@dataclass
class RunInfo:
    root: str                   # the run's data root (tables.parquet, costs/, state/, cost_model/ ...)
    run_id: str
    tracking_uri: str
    policy_uri: str             # the learned planner the harness evaluates
    cost_model_uri: str
    batch_size: int             # the benchmark batch the cost model was trained on
    trained_here: bool
    params: dict = field(default_factory=dict)
    stages: pd.DataFrame | None = None
    dag_seconds: float | None = None
    state: dict = field(default_factory=dict)


def train(out: str, params: dict) -> RunInfo:
    """One real Airflow run of the pipeline under `out` (its own Airflow DB, MLflow store and data root)."""
    from embshard import pipeline

    progress(f"pipeline: training the models with one Airflow run under {out} ({_short(params)})")
    res = pipeline.run(out, params)
    progress(f"pipeline: {res['state']} in {res['seconds']:.0f} s (run {res['run_id']})")
    return _info(res["root"], res["run_id"], trained_here=True, params=params, dag_seconds=res["seconds"])


def reuse(run_dir: str) -> RunInfo:
    """The newest successful run under `run_dir` (a `make run` / `embshard pipeline --out` folder)."""
    from embshard import pipeline
    from embshard.errors import EmbshardError

    run_dir = os.path.abspath(run_dir)
    if not os.path.isdir(run_dir):
        raise EmbshardError("no such run folder", path=run_dir, field="run", fix="give the --out of `make run`")
    # That run's Airflow home, data root and MLflow store win over the caller's environment (set before any
    # airflow import: Airflow reads its home once).
    if os.path.isdir(os.path.join(run_dir, "airflow")):
        os.environ["AIRFLOW_HOME"] = os.path.join(run_dir, "airflow")
    if os.path.isdir(os.path.join(run_dir, "data")):
        os.environ["EMBSHARD_DATA_ROOT"] = os.path.join(run_dir, "data")
    if os.path.exists(os.path.join(run_dir, "mlflow.db")):
        os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{os.path.join(run_dir, 'mlflow.db')}"
    pipeline.setup_environment(run_dir)
    data_root = os.environ["EMBSHARD_DATA_ROOT"]
    done = sorted(glob.glob(os.path.join(data_root, "*", "state", "policy.json")), key=os.path.getmtime)
    if not done:
        raise EmbshardError("no finished pipeline run in this folder (no state/policy.json)", path=data_root,
                            field="run", fix="run `make run` (or `embshard pipeline --out DIR`) first")
    root = os.path.dirname(os.path.dirname(done[-1]))
    progress(f"pipeline: reusing the trained models of {root}")
    info = _info(root, None, trained_here=False, params={}, dag_seconds=None)
    # The planner a user gets now: the registry's champion, which `embshard champion --set` may have moved since
    # the run (the run's state records the champion as it left it).
    from embshard import registry

    champion = registry.pinned(registry.POLICY_CHAMPION_URI)
    if champion.startswith(f"models:/{registry.POLICY_MODEL}/") and champion != info.policy_uri:
        progress(f"pipeline: the registry's champion is {champion} (set after that run): measuring it")
        info.policy_uri = champion
        info.cost_model_uri = registry.version_tag(champion, "cost_model_uri") or info.cost_model_uri
    return info


def _info(root: str, run_id: str | None, *, trained_here: bool, params: dict, dag_seconds: float | None) -> RunInfo:
    from embshard import schemas

    state = {}
    for name in ("ingest", "cost_model", "policy", "promotion", "export"):
        p = os.path.join(root, "state", f"{name}.json")
        if os.path.exists(p):
            with open(p, encoding="utf-8") as f:
                state[name] = json.load(f)
    costs = schemas.read(os.path.join(root, "costs"), "costs")
    batch = int(costs["batch_size"].value_counts().index[0])
    promo = state.get("promotion", {})
    # The planner a user gets: the champion after this run (the candidate when it was promoted).
    version = promo.get("champion_version_after") or state["policy"]["version"]
    stages, run_id, dag_s = stage_times(root, run_id)
    return RunInfo(root=root, run_id=run_id or os.path.basename(root),
                   tracking_uri=os.environ.get("MLFLOW_TRACKING_URI", ""),
                   policy_uri=f"models:/embshard-policy/{version}", cost_model_uri=state["policy"]["cost_model_uri"],
                   batch_size=batch, trained_here=trained_here, params=params, stages=stages,
                   dag_seconds=dag_seconds if dag_seconds is not None else dag_s, state=state)


def stage_times(root: str, run_id: str | None) -> tuple[pd.DataFrame | None, str | None, float | None]:
    """Per stage: mapped task count, wall seconds (first start to last end), summed task seconds, state.

    Read from Airflow's task instances of the DAG run whose run root is `root` (None when it is not found)."""
    from airflow.models.dagrun import DagRun
    from airflow.models.taskinstance import TaskInstance
    from airflow.utils.session import create_session
    from sqlalchemy import select

    from embshard import stages

    with create_session() as s:
        runs = s.scalars(select(DagRun).where(DagRun.dag_id == "embshard_pipeline")).all()
        match = [r for r in runs if (run_id is not None and r.run_id == run_id)
                 or os.path.basename(stages.run_root("", r.run_id)) == os.path.basename(root)]
        if not match:
            return None, run_id, None
        dr = match[-1]
        tis = s.scalars(select(TaskInstance).where(TaskInstance.dag_id == "embshard_pipeline",
                                                   TaskInstance.run_id == dr.run_id)).all()
        rows = [{"stage": ti.task_id, "map_index": ti.map_index, "start": ti.start_date, "end": ti.end_date,
                 "seconds": ti.duration, "state": str(ti.state)} for ti in tis]
        dag_s = ((dr.end_date - dr.start_date).total_seconds() if dr.end_date and dr.start_date else None)
        run_id = dr.run_id
    df = pd.DataFrame(rows)
    if df.empty:
        return None, run_id, dag_s
    out = []
    for name in [*STAGE_ORDER, *sorted(set(df["stage"]) - set(STAGE_ORDER))]:
        sub = df[df["stage"] == name]
        if sub.empty:
            continue
        wall = (sub["end"].max() - sub["start"].min()).total_seconds() if sub["end"].notna().all() else float("nan")
        out.append({"stage": name, "tasks": len(sub), "wall_s": wall, "task_s_sum": float(sub["seconds"].sum()),
                    "state": ",".join(sorted(set(sub["state"])))})
    table = pd.DataFrame(out)
    total = table["wall_s"].sum()
    table["share"] = table["wall_s"] / total if total > 0 else float("nan")
    return table, run_id, dag_s


def markdown(info: RunInfo, hw_line: str) -> str:
    lines = ["# Pipeline: time of each stage", "",
             f"Hardware: {hw_line}", "",
             f"One `make run`-style Airflow run (dag.test(), local runner, every task through Airflow's task runner); "
             f"{'trained by this harness' if info.trained_here else 'reused (--run)'}: `{info.run_id}`.", ""]
    if info.params:
        lines += ["Parameters (the rest are `embshard.stages.DEFAULT_PARAMS`): "
                  + ", ".join(f"`{k}={v}`" for k, v in info.params.items()), ""]
    if info.stages is None:
        lines.append("The Airflow task instances of this run were not found (its Airflow database is elsewhere).")
        return "\n".join(lines)
    lines += [md_table(info.stages, {"wall_s": 1, "task_s_sum": 1, "share": 3}), "",
              "`wall_s`: first task start to last task end of the stage; `task_s_sum`: the summed durations of its "
              "(mapped) task instances; `share`: of the summed stage wall times."]
    if info.dag_seconds:
        lines += ["", f"Whole DAG run: {info.dag_seconds:.0f} s (scheduling overhead of dag.test() included)."]
    promo = info.state.get("promotion")
    if promo:
        # export_placements is skipped while no version is champion: say so beside its row, not only in Airflow
        lines += ["", f"Gate: candidate version {promo.get('candidate_version')} `{promo.get('verdict')}` "
                      f"({promo.get('reason', '')}); `export_placements` runs only when a version is champion."]
    return "\n".join(lines)


def _short(params: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in params.items())
