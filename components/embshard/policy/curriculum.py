"""A curriculum of task shapes for policy training ("trained for scale").

The run's own training tasks have one shape (its tables_per_task, devices and memory). The curriculum adds
generated tasks drawn from the run's *training-pool* tables only (embshard.pools: the test pool is never seen),
in stages of growing size (params.DEFAULT_CURRICULUM: 10-50, 50-200, then 200-1,000 tables; parsed by
params.curriculum_stages). Each generated task draws:

- T tables from the stage's range; when T exceeds the pool, every pool table is used ceil(T / pool) times at most
  (copies get ids like `t0003#2`: the cost model sees the same features, the task is simply larger);
- D devices, log-uniform in [max(2, T/32), min(128, max(2, T/4))]: device counts grow with the tables;
- memory per device, tight (1.1-1.5x the tables' bytes / D) or loose (2-4x), never below 1.05x the largest
  table, so that every task is feasible for a greedy heuristic (validation tasks are re-drawn until one is).

Training mixes them with the run's tasks (`mix` of the draws are run tasks, the rest curriculum tasks: 70% of the
current stage, 30% of an earlier one), so no shape is forgotten. Everything is a pure function of the seed.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from ..tableset import TableSet
from ..types import DeviceTopology, Task

MIN_DEVICES, MAX_DEVICES = 2, 128
TIGHT, LOOSE = (1.1, 1.5), (2.0, 4.0)


def device_range(num_tables: int) -> tuple[int, int]:
    lo = max(MIN_DEVICES, int(np.ceil(num_tables / 32)))
    hi = min(MAX_DEVICES, max(MIN_DEVICES, num_tables // 4))
    return min(lo, hi), hi


def generate_task(pool: TableSet, lo: int, hi: int, rng: np.random.Generator, task_id: str,
                  tight: bool | None = None) -> Task:
    """One task of lo-hi tables from `pool` (see the module's docstring for the shape's distribution)."""
    n = int(rng.integers(lo, hi + 1))
    reps = -(-n // len(pool))
    idx = np.concatenate([rng.permutation(len(pool)) for _ in range(reps)])[:n]
    copy = np.zeros(n, dtype=np.int64)
    seen: dict[int, int] = {}
    for j, i in enumerate(idx):
        copy[j] = seen.get(int(i), 0)
        seen[int(i)] = copy[j] + 1
    sub = pool.subset(idx)
    ids = np.array([t if c == 0 else f"{t}#{c}" for t, c in zip(sub.table_ids, copy)], dtype=object)
    sub = dataclasses.replace(sub, table_ids=ids)
    d_lo, d_hi = device_range(n)
    devices = int(np.clip(round(float(np.exp(rng.uniform(np.log(d_lo), np.log(d_hi))))), d_lo, d_hi))
    if tight is None:
        tight = bool(rng.random() < 0.5)
    factor = float(rng.uniform(*(TIGHT if tight else LOOSE)))
    memory = int(max(factor * sub.size_bytes.sum() / devices, 1.05 * sub.size_bytes.max()))
    return Task(task_id, sub, DeviceTopology(devices, memory), "train")


def generate_tasks(pool: TableSet, stages: list[tuple[int, int]], per_stage: int, seed: int, prefix: str = "cur",
                   feasible=None) -> list[list[Task]]:
    """`per_stage` tasks of each stage (alternately tight and loose memory), deterministic per seed. `feasible`
    (a task -> bool), when given, re-draws a task until it holds (at most 20 tries)."""
    out = []
    for s, (lo, hi) in enumerate(stages):
        rng = np.random.default_rng([int(seed), 25, s])
        tasks = []
        for k in range(per_stage):
            for _ in range(20):
                task = generate_task(pool, lo, hi, rng, f"{prefix}-s{s}-{k:03d}", tight=k % 2 == 0)
                if feasible is None or feasible(task):
                    break
            tasks.append(task)
        out.append(tasks)
    return out


def train_pool(tables, seed: int = 0) -> TableSet:
    """The training-pool tables of a tables file (or frame): the only tables the curriculum draws from."""
    from .. import pools, schemas

    df = tables if hasattr(tables, "columns") else schemas.read(tables, "tables")
    keep = set(pools.members(df, "train", seed))
    return TableSet.from_frame(df[df["table_id"].astype(str).isin(keep)].reset_index(drop=True))


def stage_of(iteration: int, iterations: int, num_stages: int) -> int:
    """The curriculum stage of an iteration: equal shares of the iterations, in order."""
    return min(num_stages - 1, int(iteration) * num_stages // max(1, int(iterations)))


def rollouts_for(num_tables: int, num_devices: int, rollouts: int, work: int) -> int:
    """Rollouts of one update, capped by work (tables x devices x rollouts <= `work`), at least 4 (the group
    baseline needs a spread) and at most `rollouts`."""
    return int(np.clip(work // max(1, num_tables * max(num_devices, 4)), min(4, rollouts), rollouts))
