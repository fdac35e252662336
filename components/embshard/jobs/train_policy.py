"""Training the placement policy (`embshard train-policy`): REINFORCE on the estimated MDP, with an outer loop.

Estimated MDP (DreamShard): rewards come from the cost model, so thousands of episodes cost no hardware time.
Outer loop: after each round the policy's placements of some training tasks are measured with the benchmark
stage, the cost model is refitted on all measurements (so it learns where the policy goes), and training goes on
against the refitted model. The AutoShard-style variant (`reward="measured"`) instead rewards each rollout with
the measured cost of its placement: slow, but free of cost-model error; comparing both shows what the estimated
MDP gains or loses.
"""
from __future__ import annotations

import argparse
import logging
import os
import tempfile
import time

import pandas as pd
import torch

from .. import schemas, storage
from ..errors import EmbshardError
from ..registry import COST_CHAMPION_URI
from ..tableset import TableSet
from ..policy.core import PolicyNet, TaskContext, TrainConfig, rollout
from ..policy.train import (best_baseline_cost, plot_learning_curve, task_contexts, train_estimated,
                            train_measured, validation_ratio)
from ..planners.scoring import single_threaded

log = logging.getLogger(__name__)


def run(tables: str, tasks: str, out: str, *, cost_model_uri: str = COST_CHAMPION_URI,
        iterations: int = 300, rounds: int = 1, measure_tasks: int = 4, reward: str = "estimated",
        rollouts_per_task: int = 16, seed: int = 0, alias: str | None = None, costs: str | None = None,
        bench_kw: dict | None = None, register: bool = True, progress: bool = True) -> dict:
    """Train the policy on the train tasks of `tasks`, log to MLflow, register `embshard-policy`.

    rounds > 1 runs the outer loop: measure the policy's placements of `measure_tasks` train tasks into
    `costs` (the benchmark stage's folder), refit the cost model, train again.
    """
    import mlflow

    from .. import registry
    from ..costmodel import load as load_cost_model
    from ..policy.model import REGISTERED_NAME, PolicyPythonModel, policy_artifacts

    if reward not in ("estimated", "measured"):
        raise EmbshardError(f"unknown reward {reward!r}", field="reward", fix="use 'estimated' or 'measured'")
    registry.use(out)
    table_set = TableSet.read(tables)
    task_df = schemas.read(tasks, "tasks")
    train_df = task_df[task_df["split"] == "train"].reset_index(drop=True)
    if train_df.empty:
        raise EmbshardError("no tasks with split 'train'", path=tasks, field="split",
                            fix="sample tasks with `embshard tasks` (it writes train and test tasks)")
    cost_model = load_cost_model(cost_model_uri)
    torch.manual_seed(seed)
    n_val = max(1, len(train_df) // 5) if len(train_df) > 1 else 0
    val_df = train_df.iloc[:n_val] if n_val else train_df
    fit_df = train_df.iloc[n_val:] if n_val else train_df
    cfg = TrainConfig(iterations=max(1, iterations // max(rounds, 1)), rollouts_per_task=rollouts_per_task,
                      seed=seed)
    policy = PolicyNet(cfg.hidden)
    history: list[dict] = []
    bench_kw = dict(bench_kw or {})
    cost_versions = [cost_model_uri]
    start = time.perf_counter()
    with registry.start_run(run_name=f"train-policy-{reward}") as run_, single_threaded():
        mlflow.log_params({"reward": reward, "iterations": iterations, "rounds": rounds, "seed": seed,
                           "rollouts_per_task": rollouts_per_task, "lr": cfg.lr, "hidden": cfg.hidden,
                           "train_tasks": len(fit_df), "val_tasks": len(val_df), "cost_model_uri": cost_model_uri})
        for r in range(max(rounds, 1)):
            train_ctx = task_contexts(cost_model, table_set, fit_df, tasks)
            val_ctx = task_contexts(cost_model, table_set, val_df, tasks)
            if reward == "estimated":
                policy = train_estimated(policy, cost_model, train_ctx, val_ctx, cfg, history,
                                         step0=r * cfg.iterations, progress=progress)
            else:
                policy = train_measured(policy, train_ctx, cfg, history, bench_kw, progress)
            if r < rounds - 1:
                cost_model, uri = _refit_round(policy, cost_model, table_set, fit_df, tables, costs, out,
                                               measure_tasks, r, seed, bench_kw)
                cost_versions.append(uri)
        for h in history:
            mlflow.log_metrics({k: v for k, v in h.items() if k != "step"}, step=int(h["step"]))
        val_ctx = task_contexts(cost_model, table_set, val_df, tasks)
        final_ratio = validation_ratio(policy, val_ctx, [best_baseline_cost(c, s) for _, s, c in val_ctx])
        mlflow.log_metrics({"final_val_ratio_to_best_baseline": final_ratio,
                            "train_time_s": time.perf_counter() - start})
        with tempfile.TemporaryDirectory() as tmp:
            png = os.path.join(tmp, "policy_learning_curve.png")
            plot_learning_curve(history, png, reward)
            mlflow.log_artifact(png)
            result = {"run_id": run_.info.run_id, "final_val_ratio": final_ratio, "history_len": len(history),
                      "cost_model_uri": cost_versions[-1]}
            if register:
                cm_version = _cost_model_version(cost_versions[-1])
                arts = policy_artifacts(policy, cost_model, os.path.join(tmp, "bundle"),
                                        {"reward": reward, "cost_model_uri": cost_versions[-1]})
                tags = {"cost_model_uri": cost_versions[-1], "cost_model_version": cm_version,
                        "feature_version": schemas.FEATURE_VERSION, "reward": reward,
                        "hardware": getattr(cost_model.config, "hardware", ""),
                        "backend": getattr(cost_model.config, "backend", ""),
                        "val_ratio_to_best_baseline": f"{final_ratio:.4f}"}
                mv = registry.log_and_register(
                    PolicyPythonModel(), arts, REGISTERED_NAME, tags,
                    signature=_signature(policy, cost_model, tables, val_df.iloc[0]),
                    description=f"Placement policy (REINFORCE, {reward} rewards, {iterations} iterations, {rounds} "
                                f"round(s)) with the cost model {cost_versions[-1]}; validation cost / best "
                                f"baseline {final_ratio:.3f}.")
                if alias:
                    registry.set_alias(REGISTERED_NAME, alias, mv.version)
                result.update({"version": str(mv.version), "model_uri": f"models:/{REGISTERED_NAME}/{mv.version}"})
    return result


def _signature(policy, cost_model, tables: str, task):
    """The registered planner's signature, from planning one validation task: tables in (the tables contract;
    trace pointers optional), placements out, devices and memory as params."""
    from .. import registry
    from ..planners.learned import LearnedPlanner
    from ..planners.scoring import placement_costs

    frame = schemas.read(tables, "tables")
    frame = frame[frame["table_id"].isin(list(task.table_ids))].reset_index(drop=True)
    params = {"num_devices": int(task.num_devices), "memory_bytes_per_device": int(task.memory_bytes_per_device),
              "task_id": str(task.task_id)}
    planner = LearnedPlanner(policy, cost_model)
    placement = planner.plan(TableSet.from_frame(frame), params["num_devices"], params["memory_bytes_per_device"],
                             params["task_id"])
    optional = {"trace_file", "trace_table_index", "source"}
    return registry.signature(frame, placement.to_frame(placement_costs(cost_model, placement)), params,
                              required=[c for c in frame.columns if c not in optional])


def _cost_model_version(uri: str) -> str:
    from .. import registry

    if uri.startswith("models:/") and "@" in uri:
        name, alias = uri[len("models:/"):].split("@", 1)
        mv = registry.version_for_alias(name, alias)
        return str(mv.version) if mv is not None else ""
    return uri.rsplit("/", 1)[-1]


def _refit_round(policy, cost_model, table_set, fit_df, tables, costs, out, measure_tasks, r, seed, bench_kw):
    """Measure the policy's placements of some train tasks, append them to the costs, refit the cost model."""
    from .bench import run as bench_run
    from ..costmodel import load as load_cost_model
    from .train_cost import run as train_cost
    from ..placement import Placement

    if costs is None:
        raise EmbshardError("the outer loop needs the costs folder", field="costs",
                            fix="pass costs=<DIR/costs> (the benchmark stage's output) or use rounds=1")
    rows = []
    for t in fit_df.head(measure_tasks).itertuples():
        sub = table_set.select(list(t.table_ids))
        ctx = TaskContext.build(cost_model, sub.features(), sub.size_bytes, int(t.num_devices),
                                int(t.memory_bytes_per_device))
        ro = rollout(policy, ctx, 1, "greedy")
        pl = Placement.from_assignment(sub, ro.assignment[0], int(t.num_devices), int(t.memory_bytes_per_device))
        for d, shard in enumerate(pl.device_shards()):
            if shard:
                rows.append({"sample_id": f"policy-r{r}-{t.task_id}-d{d}",
                             "table_ids": [sub.table_ids[s.table] for s in shard],
                             "num_devices": int(t.num_devices), "origin": "placement:learned"})
    shards_path = os.path.join(out, f"policy_shards_round{r}.parquet")
    schemas.write(pd.DataFrame(rows), shards_path, "shards")
    # Measured into a folder of its own, then added to the costs under a round-specific name: the benchmark's
    # chunk files of earlier runs are never overwritten or mistaken for finished work.
    round_dir = os.path.join(out, f"policy_round{r}")
    kw = dict(bench_kw)
    run_root = kw.pop("out", None)
    if run_root is not None:  # the run's communication calibration, so the new costs match the old ones
        from ..bench.comm import CALIBRATION_FILE

        calib = storage.join(run_root, CALIBRATION_FILE)
        if storage.exists(calib):
            storage.write_text(os.path.join(round_dir, CALIBRATION_FILE), storage.read_text(calib))
    for part in bench_run(tables, shards_path, round_dir, **kw):
        with open(part, "rb") as src, storage.atomic_write(
                storage.join(costs, f"policy-r{r}-{os.path.basename(part)}")) as dst:
            dst.write(src.read())
    res = train_cost(costs, tables, os.path.join(out, f"cost_model_round{r}"), seed=seed + r + 1)
    uri = res.get("model_uri") or f"models:/embshard-cost/{res['version']}"
    return load_cost_model(uri), uri


# --- `embshard train-policy` -------------------------------------------------------------------
def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tables", required=True, help="tables.parquet")
    p.add_argument("--tasks", required=True, help="tasks.parquet (its 'train' tasks are used)")
    p.add_argument("--out", required=True, help="run folder (MLflow store defaults to OUT/mlflow.db)")
    p.add_argument("--cost-model", default=COST_CHAMPION_URI, help="cost model URI")
    p.add_argument("--iterations", type=int, default=300, help="REINFORCE updates (all rounds together)")
    p.add_argument("--rounds", type=int, default=1,
                   help="outer-loop rounds: measure the policy's placements, refit the cost model, retrain")
    p.add_argument("--costs", help="costs folder to extend in the outer loop (needed when --rounds > 1)")
    p.add_argument("--measure-tasks", type=int, default=4, help="tasks measured per outer round")
    p.add_argument("--reward", choices=["estimated", "measured"], default="estimated",
                   help="estimated: cost-model rewards (DreamShard); measured: real kernels (AutoShard-style)")
    p.add_argument("--rollouts", type=int, default=16, help="rollouts per task and update (group baseline)")
    p.add_argument("--alias", help="alias to set on the new version (e.g. challenger)")
    p.add_argument("--seed", type=int, default=0)


def main(args) -> int:
    res = run(args.tables, args.tasks, args.out, cost_model_uri=args.cost_model, iterations=args.iterations,
              rounds=args.rounds, measure_tasks=args.measure_tasks, reward=args.reward,
              rollouts_per_task=args.rollouts, seed=args.seed, alias=args.alias, costs=args.costs)
    print(f"policy trained: validation ratio to the best baseline (predicted) {res['final_val_ratio']:.3f}")
    if "version" in res:
        print(f"registered embshard-policy version {res['version']} ({res['model_uri']})"
              + (f", alias {args.alias}" if args.alias else ""))
    return 0
