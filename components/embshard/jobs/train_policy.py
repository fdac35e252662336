"""The train_policy stage: REINFORCE on the estimated MDP, one round at a time (`train_round`).

Estimated MDP (DreamShard): rewards come from the cost model, so thousands of episodes cost no hardware time.
Outer loop (rounds; the DAG shows each step as a task, `embshard train-policy` runs them in one process, both
through embshard.outer_loop): after a round the policy's placements of some training tasks are measured
(jobs.measure_plans, jobs.bench), the cost model is refitted on all measurements (jobs.train_cost: it learns
where the policy goes), and the next round trains on from the last weights against the refitted model.
The AutoShard-style variant (`reward="measured"`) instead rewards each rollout with
the measured cost of its placement: slow, but free of cost-model error; comparing both shows what the estimated
MDP gains or loses.
"""
from __future__ import annotations

import logging
import os
import tempfile
import time

import numpy as np
import torch

from .. import hardware, schemas
from ..bench.runner import MeasureSettings
from ..checks import CURRICULUM_OFF as OFF
from ..checks import curriculum_stages as parse_stages
from ..errors import EmbshardError
from ..heuristics import PROXIES, greedy_assignment
from ..planners.scoring import single_threaded
from ..planners.splitting import piece_task
from ..policy.core import PolicyNet, TrainConfig
from ..policy.curriculum import generate_tasks, train_pool
from ..policy.train import (
    Curriculum,
    best_baseline_cost,
    plot_learning_curve,
    task_contexts,
    train_estimated,
    train_measured,
    validation_ratios,
)
from ..pools import split_train_tasks
from ..registry import COST_CHAMPION_URI
from ..types import Task

log = logging.getLogger(__name__)
MIN_STAGE_ITERATIONS = 10  # fewer updates per curriculum stage (tiny test runs): the curriculum is off
STAGE_TASKS = 16           # generated training tasks per stage
CURRICULUM_VAL_TASKS = 12  # validation tasks with the curriculum (the run's, then >= 3 per stage)


def train_round(tables: str, tasks: str, out: str, *, cost_model_uri: str = COST_CHAMPION_URI,
                iterations: int = 300, round_index: int = 1, init_policy: str | None = None,
                reward: str = "estimated", rollouts_per_task: int = 16, seed: int = 0, register: bool = True,
                alias: str | None = None, settings: MeasureSettings | None = None, description: str = "",
                progress: bool = True, curriculum: str = OFF) -> dict:
    """One round of policy training against one cost model: REINFORCE from `init_policy` (the previous round's
    OUT/round-<r-1>, else a fresh network), the weights saved to OUT/round-<r>, and, when `register`, a new
    embshard-policy version (policy + this cost model). `curriculum`: 'off' or table ranges of growing stages
    (policy.curriculum; estimated rewards only, and only with >= MIN_STAGE_ITERATIONS updates per stage, else
    off): generated training-pool tasks of those shapes train beside the run's, and validation (checkpoint choice)
    adds CURRICULUM_VAL_TASKS of them. Returns {"policy_dir", "final_val_ratio", "cost_model_uri", "run_id",
    "best_step", "curriculum"[, "version", "model_uri"]}."""
    import mlflow

    from .. import registry
    from ..costmodel import load as load_cost_model
    from ..planners.registered import PolicyPythonModel
    from ..policy.model import REGISTERED_NAME, load_policy_files, policy_artifacts, save_policy

    if reward not in ("estimated", "measured"):
        raise EmbshardError(f"unknown reward {reward!r}", field="reward", fix="use 'estimated' or 'measured'")
    registry.use(out)
    fit_tasks, val_tasks = split_train_tasks(tables, tasks)
    cost_model = load_cost_model(cost_model_uri)
    torch.manual_seed(seed + round_index)
    # the container's CPUs, not the node's cores torch counts (a pod throttled by its quota otherwise)
    torch.set_num_threads(min(torch.get_num_threads(), hardware.usable_cpus()))
    check_training(max(1, int(iterations)), 1, rollouts_per_task)
    cfg = TrainConfig(iterations=max(1, int(iterations)), rollouts_per_task=rollouts_per_task, seed=seed)
    if init_policy:
        policy, _ = load_policy_files(os.path.join(init_policy, "policy.pt"), os.path.join(init_policy, "policy.json"))
    else:
        policy = PolicyNet(cfg.hidden)
    stages = parse_stages(curriculum)
    if reward != "estimated" or cfg.iterations < MIN_STAGE_ITERATIONS * len(stages):
        stages = []
    cur = None
    if stages:
        pool = train_pool(tables, seed)
        cur = Curriculum(cost_model, generate_tasks(pool, stages, STAGE_TASKS, seed * 1000 + round_index))
        per_stage = max(3, -(-(CURRICULUM_VAL_TASKS - len(val_tasks)) // len(stages)))
        extra = generate_tasks(pool, stages, per_stage, seed, prefix="val", feasible=_greedy_feasible)
        val_tasks = val_tasks + [t for st in extra for t in st]
    info: dict = {}
    history: list[dict] = []
    start = time.perf_counter()
    with registry.start_run(run_name=f"train-policy-{reward}-round{round_index}") as run_, single_threaded():
        mlflow.log_params({"reward": reward, "iterations": iterations, "round": round_index, "seed": seed,
                           "rollouts_per_task": rollouts_per_task, "lr": cfg.lr, "hidden": cfg.hidden,
                           "train_tasks": len(fit_tasks), "val_tasks": len(val_tasks),
                           "cost_model_uri": cost_model_uri, "init_policy": init_policy or "",
                           "curriculum": ",".join(f"{a}-{b}" for a, b in stages) or OFF})
        # Each task as the learned planner's rollouts see it: tables larger than a device cut to fit (piece_task).
        train_ctx = task_contexts(cost_model, [piece_task(t) for t in fit_tasks])
        val_ctx = task_contexts(cost_model, [piece_task(t) for t in val_tasks])
        if reward == "estimated":
            policy = train_estimated(policy, train_ctx, val_ctx, cfg, history,
                                     step0=(round_index - 1) * cfg.iterations, progress=progress,
                                     curriculum=cur, info=info)
        else:
            measure = _measured_overall(settings or MeasureSettings())
            policy = train_measured(policy, train_ctx, cfg, history, measure, progress)
        for h in history:
            mlflow.log_metrics({k: v for k, v in h.items() if k != "step"}, step=int(h["step"]))
        ratios = validation_ratios(policy, val_ctx, [best_baseline_cost(c, s) for _, s, c in val_ctx])
        final_ratio = float(np.median(ratios))
        groups = _val_groups([tid for tid, _, _ in val_ctx])
        mlflow.log_metrics({"final_val_ratio_to_best_baseline": final_ratio,
                            "train_time_s": time.perf_counter() - start,
                            **{f"final_val_ratio_{g}": float(np.median(ratios[ix])) for g, ix in groups.items()}})
        if info:
            mlflow.log_metrics({"best_checkpoint_step": info["best_step"],
                                "best_checkpoint_val_ratio": info["best_val_ratio"]})
        policy_dir = os.path.join(out, f"round-{round_index}")
        save_policy(policy, policy_dir, {"reward": reward, "cost_model_uri": cost_model_uri})
        result = {"policy_dir": policy_dir, "run_id": run_.info.run_id, "final_val_ratio": final_ratio,
                  "history_len": len(history), "cost_model_uri": cost_model_uri,
                  "best_step": info.get("best_step"), "curriculum": [list(s) for s in stages],
                  "val_tasks": len(val_ctx), "train_time_s": time.perf_counter() - start}
        with tempfile.TemporaryDirectory() as tmp:
            png = os.path.join(tmp, "policy_learning_curve.png")
            plot_learning_curve(history, png, reward)
            mlflow.log_artifact(png)
            if register:
                cm_version = _cost_model_version(cost_model_uri)
                arts = policy_artifacts(policy, cost_model, os.path.join(tmp, "bundle"),
                                        {"reward": reward, "cost_model_uri": cost_model_uri})
                tags = {"cost_model_uri": cost_model_uri, "cost_model_version": cm_version,
                        "feature_version": schemas.FEATURE_VERSION, "reward": reward, "rounds": round_index,
                        "hardware": getattr(cost_model.config, "hardware", ""),
                        "backend": getattr(cost_model.config, "backend", ""),
                        "val_ratio_to_best_baseline": f"{final_ratio:.4f}",
                        # Until the promotion gate judges it (jobs.promote.record_verdict).
                        registry.VERDICT_TAG: registry.PENDING}
                mv = registry.log_and_register(
                    PolicyPythonModel(), arts, REGISTERED_NAME, tags,
                    signature=_signature(policy, cost_model, tables, val_tasks[0]),
                    description=f"Placement policy (REINFORCE, {reward} rewards, round {round_index}{description}) "
                                f"with the cost model {cost_model_uri}; validation cost / best baseline "
                                f"{final_ratio:.3f}.")
                if alias:
                    registry.set_alias(REGISTERED_NAME, alias, mv.version)
                result.update({"version": str(mv.version), "model_uri": f"models:/{REGISTERED_NAME}/{mv.version}"})
    return result


def _greedy_feasible(task: Task) -> bool:
    """Some greedy baseline places the task (validation compares the policy with the best of them)."""
    return any(greedy_assignment(task.tables, p, task.num_devices, task.memory_bytes_per_device)[0] is not None
               for p in PROXIES)


def _val_groups(task_ids: list[str]) -> dict[str, np.ndarray]:
    """Indices of the validation tasks by origin: the run's ('run') and each curriculum stage's ('stage<s>')."""
    groups: dict[str, list[int]] = {}
    for i, tid in enumerate(task_ids):
        key = f"stage{tid.split('-')[1][1:]}" if tid.startswith("val-s") else "run"
        groups.setdefault(key, []).append(i)
    return {k: np.asarray(v) for k, v in groups.items()}


def _measured_overall(settings: MeasureSettings):
    """The measured overall cost (ms) of a placement under `settings`: the reward of measured training."""
    from ..bench import measure_placement

    return lambda placement: float(measure_placement(placement, settings)["total_ms"].max())


def check_training(iterations, rounds, rollouts_per_task) -> None:
    """Settings that would register an untrained (or NaN) policy as a new version are refused: at least one update
    per round, and two rollouts per update (the advantage is each rollout's reward minus the group's mean,
    divided by the group's spread: one rollout has none)."""
    def whole(v) -> int | None:
        try:
            return int(v) if float(v).is_integer() else None
        except (TypeError, ValueError, OverflowError):
            return None

    r = whole(rounds)
    if r is None or not 1 <= r <= 10:
        raise EmbshardError(f"invalid value {rounds}", field="rounds", fix="give an integer from 1 to 10")
    i = whole(iterations)
    if i is None or i < r:
        raise EmbshardError(f"invalid value {iterations}: every round needs at least one update", field="iterations",
                            fix=f"give an integer >= {r} (the rounds; 300 by default)")
    k = whole(rollouts_per_task)
    if k is None or k < 2:
        raise EmbshardError(f"invalid value {rollouts_per_task}", field="rollouts",
                            fix="give an integer >= 2 (each update compares a task's rollouts; 16 by default)")


def _signature(policy, cost_model, tables: str, task: Task):
    """The registered planner's signature, from planning one validation task: tables in (every column optional to
    MLflow, with its type: predict checks the tables contract itself, so a missing column is one line naming it,
    where MLflow's check of a required one printed the whole frame and schema, 13 lines, the cause at the end),
    placements out, devices and memory as params."""
    from .. import registry
    from ..planners.learned import LearnedPlanner
    from ..planners.scoring import placement_costs

    frame = schemas.read(tables, "tables")
    frame = frame[frame["table_id"].isin(list(task.tables.table_ids))].reset_index(drop=True)
    # MLflow hands a predict call without params these defaults: 0 (no devices), which predict refuses, so that a
    # job that forgets them gets an error, not a plan for this validation task's devices and memory.
    # devices_per_host 0: one host (TorchRec's export needs the hosts above 128 GPUs).
    params = {"num_devices": 0, "memory_bytes_per_device": 0, "devices_per_host": 0, "task_id": "task"}
    placement = LearnedPlanner(policy, cost_model).plan_task(task)
    return registry.signature(frame, placement.to_frame(placement_costs(cost_model, placement)), params,
                              required=[])


def _cost_model_version(uri: str) -> str:
    from .. import registry

    if uri.startswith("models:/") and "@" in uri:
        name, alias = uri[len("models:/"):].split("@", 1)
        mv = registry.version_for_alias(name, alias)
        return str(mv.version) if mv is not None else ""
    return uri.rsplit("/", 1)[-1]
