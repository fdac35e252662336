"""`embshard train-policy`: REINFORCE on the estimated MDP (or measured rewards), register embshard-policy."""
from __future__ import annotations

import argparse


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tables", required=True, help="tables.parquet")
    p.add_argument("--tasks", required=True, help="tasks.parquet (its 'train' tasks are used)")
    p.add_argument("--out", required=True, help="run folder (MLflow store defaults to OUT/mlflow.db)")
    p.add_argument("--cost-model", default="models:/embshard-cost@champion", help="cost model URI")
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
    from .train import run

    res = run(args.tables, args.tasks, args.out, cost_model_uri=args.cost_model, iterations=args.iterations,
              rounds=args.rounds, measure_tasks=args.measure_tasks, reward=args.reward,
              rollouts_per_task=args.rollouts, seed=args.seed, alias=args.alias, costs=args.costs)
    print(f"policy trained: validation ratio to the best baseline (predicted) {res['final_val_ratio']:.3f}")
    if "version" in res:
        print(f"registered embshard-policy version {res['version']} ({res['model_uri']})"
              + (f", alias {args.alias}" if args.alias else ""))
    return 0
