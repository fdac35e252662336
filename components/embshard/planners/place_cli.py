"""`embshard place`: tables in, devices + memory in, a placement out (plan.json + placements.parquet)."""
from __future__ import annotations

import argparse

GiB = 2**30


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tables", required=True, help="tables.parquet (all its tables are placed unless --task-id)")
    p.add_argument("--tasks", help="tasks.parquet, with --task-id: place that task's tables")
    p.add_argument("--task-id", help="the task to place (its devices/memory are used unless given)")
    p.add_argument("--devices", type=int, help="number of devices")
    p.add_argument("--memory-gb", type=float, help="memory per device, GiB")
    p.add_argument("--planner", default="learned", help="learned (default, from the registry) or a baseline: "
                   "random, round_robin, dim_greedy, size_greedy, lookup_greedy, size_lookup_greedy, "
                   "torchrec_table_wise, torchrec_full")
    p.add_argument("--model", default="models:/embshard-policy@champion", help="learned planner's model URI")
    p.add_argument("--cost-model", default=None,
                   help="cost model for predicted costs of non-learned planners (default: embshard-cost@champion "
                        "if registered)")
    p.add_argument("--search-evaluations", type=int, default=None,
                   help="work budget of the learned planner's search, in scored moves/swaps (default: by task "
                        "size); the plan is the same on every machine")
    p.add_argument("--time-budget-s", type=float, default=None,
                   help="safety cap on the learned planner's search time (default 60 s); a plan that hits it "
                        "depends on the machine's speed, and the report says so")
    p.add_argument("--out", required=True, help="output folder")


def main(args) -> int:
    from .. import checks
    from ..errors import EmbshardError
    from .place import place

    if (args.devices is None or args.memory_gb is None) and not args.task_id:
        raise EmbshardError("--devices and --memory-gb are required without --task-id", field="devices",
                            fix="give --devices N --memory-gb M")
    # Given values are checked as given: 0 is an error, never "use the task's value".
    devices = None if args.devices is None else checks.devices(args.devices, field="devices")
    memory = None if args.memory_gb is None else checks.memory_bytes(args.memory_gb, field="memory_gb")
    if args.time_budget_s is not None:
        checks.positive_finite(args.time_budget_s, field="time_budget_s", upper=86_400)
    if args.search_evaluations is not None and not 0 <= args.search_evaluations <= 10**10:
        raise EmbshardError(f"invalid value {args.search_evaluations}", field="search_evaluations",
                            fix="give an integer from 0 (no search) to 10^10")
    result = place(args.tables, args.out, devices=devices, memory_bytes=memory,
                   planner=args.planner, model_uri=args.model, cost_model_uri=args.cost_model,
                   tasks=args.tasks, task_id=args.task_id, time_budget_s=args.time_budget_s,
                   search_evaluations=args.search_evaluations)
    print(result["report"])
    print(f"wrote {result['plan_json']}, {result['placements']} and {result['plot']}")
    return 0
