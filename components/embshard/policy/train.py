"""Training loops of the placement policy: REINFORCE on the estimated MDP (DreamShard: rewards from the cost
model) or on measured rewards (AutoShard-style: real kernels), validation against the best greedy baseline, and
the learning-curve plot. The update itself is policy.core.reinforce_step.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np
import pandas as pd
import torch

from ..heuristics import PROXIES, greedy_assignment
from ..placement import Placement
from ..tableset import TableSet
from ..types import Task
from .core import PolicyNet, TaskContext, TrainConfig, reinforce_step, rollout


def task_contexts(cost_model, tasks: list[Task]) -> list[tuple[str, TableSet, TaskContext]]:
    """(task id, tables, rollout context) of each task, under `cost_model`."""
    return [(t.task_id, t.tables, TaskContext.build(cost_model, t.tables.features(), t.tables.size_bytes,
                                                    t.num_devices, t.memory_bytes_per_device)) for t in tasks]


def best_baseline_cost(ctx: TaskContext, sub: TableSet) -> float:
    """Predicted overall cost of the best greedy baseline on a task (the bar the policy must clear)."""
    best = np.inf
    for proxy in PROXIES:  # the greedy baselines (planners.baselines wraps the same heuristic)
        assignment, _, _ = greedy_assignment(sub, proxy, ctx.scorer.num_devices, ctx.memory)
        if assignment is not None:
            best = min(best, float(ctx.scorer.device_costs(assignment).max()))
    return best


@torch.no_grad()
def validation_ratios(policy: PolicyNet, contexts, baseline_costs: list[float]) -> np.ndarray:
    """Per task: the greedy policy's predicted cost / the best baseline's; infeasible counts as 2."""
    ratios = []
    for (_, _, ctx), base in zip(contexts, baseline_costs):
        ro = rollout(policy, ctx, 1, "greedy")
        ratios.append(ro.overall[0] / base if ro.feasible[0] else 2.0)
    return np.asarray(ratios, dtype=np.float64)


def validation_ratio(policy: PolicyNet, contexts, baseline_costs: list[float]) -> float:
    """Median over tasks of (greedy policy's predicted cost / best baseline's); infeasible counts as 2."""
    return float(np.median(validation_ratios(policy, contexts, baseline_costs)))


@dataclass
class Curriculum:
    """The draws of curriculum training (policy.curriculum): generated tasks per stage (contexts built when first
    drawn), the share `mix` of draws that are the run's own tasks, and the work cap of one update."""

    cost_model: object
    stage_tasks: list          # per stage: list of Task
    mix: float = 0.25
    work: int = 16 * 2000      # tables x devices x rollouts of one update at most
    _cache: dict = field(default_factory=dict)

    def context(self, stage: int, k: int) -> TaskContext:
        if (stage, k) not in self._cache:
            t = self.stage_tasks[stage][k]
            self._cache[(stage, k)] = TaskContext.build(self.cost_model, t.tables.features(), t.tables.size_bytes,
                                                        t.num_devices, t.memory_bytes_per_device)
        return self._cache[(stage, k)]

    def draw(self, it: int, iterations: int, rng: np.random.Generator, train_ctx) -> tuple[TaskContext, int, int]:
        """(context, current stage, stage drawn: -1 for a run task) of update `it`."""
        from .curriculum import stage_of

        current = stage_of(it, iterations, len(self.stage_tasks))
        if rng.random() < self.mix:
            return train_ctx[int(rng.integers(len(train_ctx)))][2], current, -1
        stage = current if current == 0 or rng.random() < 0.7 else int(rng.integers(current))
        return self.context(stage, int(rng.integers(len(self.stage_tasks[stage])))), current, stage


def train_estimated(policy: PolicyNet, train_ctx, val_ctx, cfg: TrainConfig, history: list,
                    step0: int = 0, progress: bool = True, curriculum: Curriculum | None = None,
                    info: dict | None = None) -> PolicyNet:
    """REINFORCE on the estimated MDP; keeps the weights with the best validation ratio (a checkpoint every
    iterations/20 updates, the untrained start included), not the last. `curriculum`: draw tasks from its
    stages (with rollouts capped by work) instead of only `train_ctx`. `info` gets the chosen checkpoint's step
    and ratio."""
    from tqdm import tqdm

    from .curriculum import rollouts_for

    gen = torch.Generator().manual_seed(cfg.seed + step0)
    rng = np.random.default_rng(cfg.seed + step0)
    opt = torch.optim.Adam(policy.parameters(), lr=cfg.lr)
    val_base = [best_baseline_cost(ctx, sub) for _, sub, ctx in val_ctx]
    best_ratio = validation_ratio(policy, val_ctx, val_base)
    best_state = {k: v.clone() for k, v in policy.state_dict().items()}
    best_step = step0 - 1  # the start
    eval_every = max(1, cfg.iterations // 20)
    bar = tqdm(range(cfg.iterations), desc="policy (estimated MDP)", disable=not progress)
    for it in bar:
        policy.train()
        if curriculum is None:
            _, _, ctx = train_ctx[int(rng.integers(len(train_ctx)))]
            stats = reinforce_step(policy, opt, ctx, cfg, gen)
        else:
            ctx, current, drawn = curriculum.draw(it, cfg.iterations, rng, train_ctx)
            n, d = len(ctx.sizes), ctx.scorer.num_devices
            step_cfg = replace(cfg, rollouts_per_task=rollouts_for(n, d, cfg.rollouts_per_task, curriculum.work))
            stats = reinforce_step(policy, opt, ctx, step_cfg, gen)
            stats.update({"curriculum_stage": float(current), "task_stage": float(drawn), "task_tables": float(n),
                          "task_devices": float(d), "rollouts": float(step_cfg.rollouts_per_task)})
        if (it + 1) % eval_every == 0 or it == cfg.iterations - 1:
            policy.eval()
            ratio = validation_ratio(policy, val_ctx, val_base)
            stats["val_ratio_to_best_baseline"] = ratio
            if ratio < best_ratio:
                best_ratio, best_state = ratio, {k: v.clone() for k, v in policy.state_dict().items()}
                best_step = step0 + it
            stats["val_best_ratio"] = best_ratio
            bar.set_postfix(val_ratio=f"{ratio:.3f}", best=f"{best_ratio:.3f}", refresh=False)
        history.append({"step": step0 + it, **stats})
    policy.load_state_dict(best_state)
    if info is not None:
        info.update({"best_step": best_step, "best_val_ratio": best_ratio})
    return policy.eval()


def train_measured(policy: PolicyNet, train_ctx, cfg: TrainConfig, history: list,
                   measure: Callable[[Placement], float], progress: bool = True) -> PolicyNet:
    """AutoShard-style: each rollout's reward is its measured overall cost (real kernels), relative to scale.
    `measure(placement)` is the measured overall cost in ms (the job passes the benchmark's, with its settings)."""
    from tqdm import tqdm

    gen = torch.Generator().manual_seed(cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    opt = torch.optim.Adam(policy.parameters(), lr=cfg.lr)
    for it in tqdm(range(cfg.iterations), desc="policy (measured rewards)", disable=not progress):
        _, sub, ctx = train_ctx[int(rng.integers(len(train_ctx)))]

        def measured(ro, sub=sub, ctx=ctx) -> np.ndarray:
            out = np.full(len(ro.assignment), np.nan)
            for b, a in enumerate(ro.assignment):
                if ro.feasible[b]:
                    pl = Placement.from_assignment(sub, a, ctx.scorer.num_devices, ctx.memory, planner="autoshard")
                    out[b] = float(measure(pl))
            return out

        policy.train()
        stats = reinforce_step(policy, opt, ctx, cfg, gen, costs=measured)
        history.append({"step": it, **stats})
    return policy.eval()


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
    ax[0].legend(loc="lower left")
    if "curriculum_stage" in df:  # the curriculum's current stage, on its own axis
        st = ax[0].twinx()
        st.step(df["step"], df["curriculum_stage"], where="post", color="grey", lw=1, alpha=0.6)
        st.set_ylabel("curriculum stage")
    if "val_ratio_to_best_baseline" in df:
        v = df.dropna(subset=["val_ratio_to_best_baseline"])
        ax[1].plot(v["step"], v["val_ratio_to_best_baseline"], marker="o", label="checkpoint")
        if len(v):
            best = v.loc[v["val_ratio_to_best_baseline"].idxmin()]
            ax[1].plot([best["step"]], [best["val_ratio_to_best_baseline"]], marker="*", ms=14, ls="",
                       color="tab:red", label="best checkpoint")
        ax[1].axhline(1.0, color="grey", ls="--", lw=1)
        ax[1].legend()
    ax[1].set_xlabel("update")
    ax[1].set_ylabel("greedy policy / best baseline (predicted)")
    fig.suptitle(f"embshard policy training ({reward} rewards)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
