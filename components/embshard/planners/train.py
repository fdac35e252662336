"""Training the placement policy (`embshard train-policy`): REINFORCE on the estimated MDP, with an outer loop.

Estimated MDP (DreamShard): rewards come from the cost model, so thousands of episodes cost no hardware time.
Outer loop: after each round the policy's placements of some training tasks are measured with the benchmark
stage, the cost model is refitted on all measurements (so it learns where the policy goes), and training goes on
against the refitted model. The AutoShard-style variant (`reward="measured"`) instead rewards each rollout with
the measured cost of its placement: slow, but free of cost-model error; comparing both shows what the estimated
MDP gains or loses.
"""
from __future__ import annotations

import logging
import os
import tempfile
import time

import numpy as np
import pandas as pd
import torch

from .. import schemas, storage
from ..errors import EmbshardError
from ..tableset import TableSet
from .baselines import GREEDY_BASELINES, make_baseline
from .policy import INFEASIBLE_PENALTY, PolicyNet, TaskContext, TrainConfig, reinforce_step, rollout
from .scoring import single_threaded

log = logging.getLogger(__name__)


def task_contexts(cost_model, tables: TableSet, tasks: pd.DataFrame, where: str) -> list[tuple[str, TableSet, TaskContext]]:
    out = []
    for t in tasks.itertuples():
        sub = tables.select(list(t.table_ids), f"{where}:{t.task_id}")
        out.append((t.task_id, sub, TaskContext.build(cost_model, sub.features(), sub.size_bytes,
                                                      int(t.num_devices), int(t.memory_bytes_per_device))))
    return out


def best_baseline_cost(ctx: TaskContext, sub: TableSet) -> float:
    """Predicted overall cost of the best greedy baseline on a task (the bar the policy must clear)."""
    best = np.inf
    for name in GREEDY_BASELINES:
        try:
            p = make_baseline(name).plan(sub, ctx.scorer.num_devices, ctx.memory)
        except EmbshardError:
            continue
        best = min(best, float(ctx.scorer.device_costs(p.device_of_shards()).max()))
    return best


@torch.no_grad()
def validation_ratio(policy: PolicyNet, contexts, baseline_costs: list[float]) -> float:
    """Median over tasks of (greedy policy's predicted cost / best baseline's); infeasible counts as 2."""
    ratios = []
    for (_, _, ctx), base in zip(contexts, baseline_costs):
        ro = rollout(policy, ctx, 1, "greedy")
        ratios.append(ro.overall[0] / base if ro.feasible[0] else 2.0)
    return float(np.median(ratios))


def train_estimated(policy: PolicyNet, cost_model, train_ctx, val_ctx, cfg: TrainConfig, history: list,
                    step0: int = 0, progress: bool = True) -> PolicyNet:
    """REINFORCE on the estimated MDP; keeps the weights with the best validation ratio."""
    from tqdm import tqdm

    gen = torch.Generator().manual_seed(cfg.seed + step0)
    rng = np.random.default_rng(cfg.seed + step0)
    opt = torch.optim.Adam(policy.parameters(), lr=cfg.lr)
    val_base = [best_baseline_cost(ctx, sub) for _, sub, ctx in val_ctx]
    best_ratio = validation_ratio(policy, val_ctx, val_base)
    best_state = {k: v.clone() for k, v in policy.state_dict().items()}
    eval_every = max(1, cfg.iterations // 20)
    bar = tqdm(range(cfg.iterations), desc="policy (estimated MDP)", disable=not progress)
    for it in bar:
        _, _, ctx = train_ctx[int(rng.integers(len(train_ctx)))]
        policy.train()
        stats = reinforce_step(policy, opt, ctx, cfg, gen)
        if (it + 1) % eval_every == 0 or it == cfg.iterations - 1:
            policy.eval()
            ratio = validation_ratio(policy, val_ctx, val_base)
            stats["val_ratio_to_best_baseline"] = ratio
            if ratio < best_ratio:
                best_ratio, best_state = ratio, {k: v.clone() for k, v in policy.state_dict().items()}
            bar.set_postfix(val_ratio=f"{ratio:.3f}", best=f"{best_ratio:.3f}", refresh=False)
        history.append({"step": step0 + it, **stats})
    policy.load_state_dict(best_state)
    return policy.eval()


def train_measured(policy: PolicyNet, train_ctx, cfg: TrainConfig, history: list, bench_kw: dict,
                   progress: bool = True) -> PolicyNet:
    """AutoShard-style: each rollout's reward is its measured overall cost (real kernels), relative to scale."""
    from tqdm import tqdm

    from ..bench import measure_placement
    from ..placement import Placement

    gen = torch.Generator().manual_seed(cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    opt = torch.optim.Adam(policy.parameters(), lr=cfg.lr)
    for it in tqdm(range(cfg.iterations), desc="policy (measured rewards)", disable=not progress):
        _, sub, ctx = train_ctx[int(rng.integers(len(train_ctx)))]
        policy.train()
        ro = rollout(policy, ctx, cfg.rollouts_per_task, "sample", gen)
        measured = np.empty(len(ro.assignment))
        for b, a in enumerate(ro.assignment):
            if not ro.feasible[b]:
                measured[b] = np.nan
                continue
            pl = Placement.from_assignment(sub, a, ctx.scorer.num_devices, ctx.memory, planner="autoshard")
            measured[b] = float(measure_placement(pl, **bench_kw)["total_ms"].max())
        scale = np.nanmedian(measured) if np.isfinite(measured).any() else 1.0
        reward = torch.as_tensor(np.where(np.isfinite(measured), -measured / scale, -INFEASIBLE_PENALTY),
                                 dtype=torch.float32)
        adv = (reward - reward.mean()) / (reward.std() + 1e-6)
        loss = -(adv * ro.log_prob).mean() - cfg.entropy_coef * ro.entropy.mean() / len(ctx.sizes)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        opt.step()
        history.append({"step": it, "loss": float(loss), "measured_best_ms": float(np.nanmin(measured)),
                        "reward_mean": float(reward.mean())})
    return policy.eval()


def run(tables: str, tasks: str, out: str, *, cost_model_uri: str = "models:/embshard-cost@champion",
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
    from .policy_model import REGISTERED_NAME, PolicyPythonModel, policy_artifacts

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
    from .learned import LearnedPlanner
    from .scoring import placement_costs

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
    from .. import bench
    from ..costmodel import load as load_cost_model
    from ..costmodel import run as train_cost
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
    for part in bench.run(tables, shards_path, round_dir, **kw):
        with open(part, "rb") as src, storage.atomic_write(
                storage.join(costs, f"policy-r{r}-{os.path.basename(part)}")) as dst:
            dst.write(src.read())
    res = train_cost(costs, tables, os.path.join(out, f"cost_model_round{r}"), seed=seed + r + 1)
    uri = res.get("model_uri") or f"models:/embshard-cost/{res['version']}"
    return load_cost_model(uri), uri


def plot_learning_curve(history: list[dict], path: str, reward: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    df = pd.DataFrame(history)
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.6))
    if "reward_mean" in df:
        ax[0].plot(df["step"], df["reward_mean"].rolling(10, min_periods=1).mean(), label="mean reward (rolling)")
    if "reward_best" in df:
        ax[0].plot(df["step"], df["reward_best"].rolling(10, min_periods=1).mean(), label="best of group")
    ax[0].set_xlabel("update")
    ax[0].set_ylabel("reward (-cost / task scale)")
    ax[0].legend()
    if "val_ratio_to_best_baseline" in df:
        v = df.dropna(subset=["val_ratio_to_best_baseline"])
        ax[1].plot(v["step"], v["val_ratio_to_best_baseline"], marker="o")
        ax[1].axhline(1.0, color="grey", ls="--", lw=1)
    ax[1].set_xlabel("update")
    ax[1].set_ylabel("greedy policy / best baseline (predicted)")
    fig.suptitle(f"embshard policy training ({reward} rewards)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
