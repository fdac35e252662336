"""The outer policy loop, in one place: the DAG's round tasks (embshard.stages) and `embshard train-policy` (all
rounds in one process) run these same steps, so the two cannot drift.

Round 1 trains the policy against the given cost model. Each later round r: measure the previous round's plans
(jobs.measure_plans lists their device shards, jobs.bench measures them into POLICY/measured-round-<r>/costs with
the run's communication calibration), refit the cost model on the benchmark's costs and every round's measured
plans (jobs.train_cost, ensemble of `members`, the calibration of `calibration_dir`) into
COST_MODEL/round-<r>, then train round r from round r-1's weights against the refit. Only the last round
registers (and sets `alias`).

This module sits with the stages, above the jobs: it composes jobs, which never import one another.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from .bench.runner import MeasureSettings
from .errors import EmbshardError
from .params import CURRICULUM_OFF, DEFAULT_PARAMS
from .params import curriculum_stages as parse_stages
from .registry import COST_CHAMPION_URI
from .run_layout import _join

DEFAULT_MEMBERS = int(DEFAULT_PARAMS["cost_members"])  # the DAG's cost-model ensemble size, for the CLI too
DEFAULT_CURRICULUM = str(DEFAULT_PARAMS["policy_curriculum"])  # the DAG's, for the CLI too


@dataclass(frozen=True)
class LoopLayout:
    """Where the loop writes: the policy's rounds (POLICY/round-<r>, written by jobs.train_policy) and measured
    plans (POLICY/measured-round-<r>), the cost model of round 1 (COST_MODEL) and its refits
    (COST_MODEL/round-<r>)."""
    policy: str
    cost_model: str

    def measured(self, round_index: int) -> str:
        return _join(self.policy, f"measured-round-{round_index}")

    def cost_model_of(self, round_index: int) -> str:
        return self.cost_model if round_index == 1 else _join(self.cost_model, f"round-{round_index}")

    def costs_of_rounds(self, benchmark_costs: str, last_round: int) -> list[str]:
        """The benchmark's costs, then the measured policy plans of rounds 2..last_round."""
        return [benchmark_costs, *(_join(self.measured(r), "costs") for r in range(2, last_round + 1))]


def train_policy_round(tables: str, tasks: str, layout: LoopLayout, *, cost_model_uri: str, iterations: int,
                       rounds: int, round_index: int, init_policy: str | None, seed: int,
                       reward: str = "estimated", rollouts_per_task: int = 16, alias: str | None = None,
                       settings: MeasureSettings | None = None, register: bool = True,
                       progress: bool = True, curriculum: str = CURRICULUM_OFF) -> dict:
    """Round `round_index` of `rounds`: iterations // rounds REINFORCE updates from `init_policy`; the last round
    registers (when `register`)."""
    from .jobs.train_policy import train_round

    return train_round(tables, tasks, layout.policy, cost_model_uri=cost_model_uri,
                       iterations=max(1, int(iterations) // int(rounds)), round_index=round_index,
                       init_policy=init_policy, reward=reward, rollouts_per_task=rollouts_per_task, seed=seed,
                       register=register and round_index == rounds, alias=alias, settings=settings,
                       description=f" of {rounds}", progress=progress, curriculum=curriculum)


def measure_round(tables: str, tasks: str, layout: LoopLayout, *, policy_dir: str, cost_model_uri: str,
                  round_index: int, num_tasks: int, settings: MeasureSettings, seed: int) -> str:
    """The measuring step before round `round_index`: the last policy's plans listed, then measured; returns
    their costs folder."""
    from .jobs.bench import run as bench_run
    from .jobs.measure_plans import run as measure_plans

    out = layout.measured(round_index)
    shards = measure_plans(tables, tasks, policy_dir, cost_model_uri, out, num_tasks=num_tasks,
                           round_index=round_index, settings=settings)
    # The run's calibration was copied beside the shards: OUT is this measurement's calibration folder. The folder
    # is this round's own: an earlier try's measurements of other plans (the round before retrained) are replaced.
    bench_run(tables, shards, out, settings=settings.replace(seed=int(seed), calibration_dir=out), progress=False,
              replace_changed=True)
    return _join(out, "costs")


def fit_cost_model(tables: str, benchmark_costs: str, layout: LoopLayout, *, round_index: int, seed: int,
                   members: int, calibration_dir: str | None) -> dict:
    """Round 1: the cost model from the benchmark's costs; round r > 1 (the refit): from the benchmark's costs
    and the measured plans of every round so far."""
    from .jobs.train_cost import run as train_cost

    return train_cost(layout.costs_of_rounds(benchmark_costs, round_index), tables,
                      layout.cost_model_of(round_index), seed=int(seed) + round_index - 1, members=int(members),
                      calibration_dir=calibration_dir)


def run(tables: str, tasks: str, out: str, *, cost_model_uri: str = COST_CHAMPION_URI, iterations: int = 300,
        rounds: int = 1, measure_tasks: int = 4, reward: str = "estimated", rollouts_per_task: int = 16,
        seed: int = 0, alias: str | None = None, costs: str | None = None,
        settings: MeasureSettings | None = None, members: int = DEFAULT_MEMBERS, register: bool = True,
        progress: bool = True, curriculum: str = CURRICULUM_OFF) -> dict:
    """The whole loop in one process (`embshard train-policy`): round 1 against `cost_model_uri`, then for each
    later round the same measure, refit and train steps as the DAG's tasks. Writes OUT/round-<r>,
    OUT/measured-round-<r> and OUT/cost_model/round-<r>. `costs`: the benchmark's costs folder (needed when
    rounds > 1); the communication calibration is settings.calibration_dir, by default the folder above
    `costs` (the benchmark's run folder). Returns the last round's result."""
    from .jobs.train_policy import check_training

    check_training(iterations, rounds, rollouts_per_task)
    parse_stages(curriculum)  # a bad curriculum is refused before any work
    rounds = int(rounds)
    if rounds > 1 and costs is None:
        raise EmbshardError("the outer loop needs the costs folder", field="costs",
                            fix="pass costs=<DIR/costs> (the benchmark stage's output) or use rounds=1")
    settings = settings or MeasureSettings()
    if settings.calibration_dir is None and costs is not None:
        settings = settings.replace(calibration_dir=str(costs).rstrip("/").rsplit("/", 1)[0])
    layout = LoopLayout(policy=out, cost_model=_join(out, "cost_model"))
    res: dict = {}
    for r in range(1, rounds + 1):
        if r > 1:
            assert costs is not None  # rounds > 1 needs it, checked above
            measure_round(tables, tasks, layout, policy_dir=res["policy_dir"], cost_model_uri=cost_model_uri,
                          round_index=r, num_tasks=measure_tasks, settings=settings, seed=seed)
            cost_model_uri = fit_cost_model(tables, costs, layout, round_index=r, seed=seed, members=members,
                                            calibration_dir=settings.calibration_dir)["model_uri"]
        res = train_policy_round(tables, tasks, layout, cost_model_uri=cost_model_uri, iterations=iterations,
                                 rounds=rounds, round_index=r, init_policy=res.get("policy_dir"), seed=seed,
                                 reward=reward, rollouts_per_task=rollouts_per_task, alias=alias,
                                 settings=settings, register=register, progress=progress,
                                 curriculum=curriculum)
    return res


# --- `embshard train-policy` -------------------------------------------------------------------
# What `embshard train-policy` writes and reads: its --out is checked before any work (cli.check_output).
OUTPUT = {"kind": "folder", "inputs": ("tables", "tasks", "costs")}


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tables", required=True, help="tables.parquet")
    p.add_argument("--tasks", required=True, help="tasks.parquet (its 'train' tasks are used)")
    p.add_argument("--out", required=True, help="run folder (MLflow store defaults to OUT/mlflow.db)")
    p.add_argument("--cost-model", default=COST_CHAMPION_URI, help=f"cost model URI (default {COST_CHAMPION_URI})")
    p.add_argument("--iterations", type=int, default=300, help="REINFORCE updates (all rounds together; default 300)")
    p.add_argument("--rounds", type=int, default=1,
                   help="outer-loop rounds: measure the policy's placements, refit the cost model, retrain "
                        "(default 1)")
    p.add_argument("--costs", help="costs folder to extend in the outer loop (needed when --rounds > 1)")
    p.add_argument("--measure-tasks", type=int, default=4, help="tasks measured per outer round (default 4)")
    p.add_argument("--cost-members", type=int, default=DEFAULT_MEMBERS,
                   help=f"ensemble members of each refitted cost model (default {DEFAULT_MEMBERS}, as the DAG)")
    p.add_argument("--calibration-dir", default=None,
                   help="folder of the run's comm_calibration.json (default: the folder above --costs)")
    p.add_argument("--device", default="cpu", help="where the outer loop measures: cpu, cuda[:N] or auto")
    p.add_argument("--reward", choices=["estimated", "measured"], default="estimated",
                   help="estimated: cost-model rewards (DreamShard); measured: real kernels (AutoShard-style)")
    p.add_argument("--rollouts", type=int, default=16, help="rollouts per task and update (group baseline; default 16)")
    p.add_argument("--curriculum", default=DEFAULT_CURRICULUM,
                   help="task shapes the policy also trains on, in growing stages of table ranges (generated from "
                        "the training pool: devices and tight or loose memory scale with the tables), or 'off'; "
                        f"off below 10 updates per stage and round (default {DEFAULT_CURRICULUM})")
    p.add_argument("--alias", help="alias to set on the new version (e.g. challenger)")
    p.add_argument("--seed", type=int, default=0)


def main(args) -> int:
    from .bench.comm import given_calibration_dir

    settings = MeasureSettings(device=args.device, calibration_dir=given_calibration_dir(args.calibration_dir))
    res = run(args.tables, args.tasks, args.out, cost_model_uri=args.cost_model, iterations=args.iterations,
              rounds=args.rounds, measure_tasks=args.measure_tasks, reward=args.reward,
              rollouts_per_task=args.rollouts, seed=args.seed, alias=args.alias, costs=args.costs,
              settings=settings, members=args.cost_members, curriculum=args.curriculum)
    print(f"policy trained: validation ratio to the best baseline (predicted) {res['final_val_ratio']:.3f}")
    if "version" in res:
        print(f"registered embshard-policy version {res['version']} ({res['model_uri']})"
              + (f", alias {args.alias}" if args.alias else ""))
    return 0
