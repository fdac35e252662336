"""The sample_shards stage: which device shards the benchmark measures, decided once per run (DIR/shards.parquet).

Every mapped benchmark chunk reads this list instead of recomputing it. The budget:
- two thirds from train-pool tables (what the cost model trains on), one third from test-pool tables (its accuracy
  on tables it never saw); each shard stays inside one pool (embshard.pools);
- in each pool, half random shards of 1-15 tables and half plan shards (plan_shards): device shards
  of greedy plans of 20-200-table tasks on 2-16 devices, half of them one search step away, 1-60 tables each:
  the devices the planners and the search actually compare;
- every train-pool table alone, and every test-pool table of the test shards alone (cheap; the single-table
  reference of the cost-model report needs them).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd

from .. import pools, schemas, storage
from ..errors import EmbshardError
from ..tableset import TableSet

SHARDS_FILE = "shards.parquet"
MAX_RANDOM_TABLES = 15     # largest random shard
# Plan shards: synthetic tasks the size of the quality suites', so the cost model trains on devices as crowded as
# the ones it must rank (a 200-table task on 4 devices puts ~50 tables on each).
PLAN_TASK_TABLES = (20, 200)
PLAN_DEVICES = (2, 4, 8, 16)
MAX_PLAN_SHARD_TABLES = 60
SHARDS_PER_PLAN = 2       # device shards kept per plan: more plans, less of the same plan
NEIGHBOUR_SHARE = 0.5     # plans moved one search step (1-3 tables off the most loaded device) before sampling


def run(tables: str, tasks: str, out: str, *, num_shards: int, seed: int = 0,
        max_tables: int = MAX_RANDOM_TABLES) -> str:
    """Write OUT/shards.parquet (shards contract) and return its path; an existing list is kept (the list is a
    pure function of the inputs, so a rerun or a retried task sees the same one)."""
    from ..bench.sampler import random_shards
    from ..types import load_tasks

    target = storage.join(out, SHARDS_FILE)
    if storage.exists(target):
        return target
    if int(num_shards) < 3:
        raise EmbshardError(f"{num_shards} shards", field="bench_shards", fix="measure at least 3 shards")
    tdf = schemas.read(tables, "tables")
    table_set = TableSet.from_frame(tdf)
    train_tasks = load_tasks(table_set, tasks, "train")
    num_devices = train_tasks[0].num_devices
    n_test = int(num_shards) // 3
    frames = []
    for pool, n in (("train", int(num_shards) - n_test), ("test", n_test)):
        members = pools.members(tdf, pool, seed)
        if not members or n <= 0:
            continue
        n_plan = n // 2
        df = random_shards(members, n - n_plan, max_tables=max_tables, seed=seed, num_devices=num_devices)
        parts = [df]
        if n_plan:
            parts.append(plan_shards(table_set.select(members), n_plan, seed=seed,
                                     memory_bytes_per_device=train_tasks[0].memory_bytes_per_device))
        df = pd.concat(parts, ignore_index=True)
        frames.append(df.assign(sample_id=f"{pool}-" + df["sample_id"]))
    alone = set(pools.members(tdf, "train", seed))
    for df in frames[1:]:
        alone |= {t for ids in df["table_ids"] for t in ids}
    frames.append(pd.DataFrame({"sample_id": [f"single-{t}" for t in sorted(alone)],
                                "table_ids": [[t] for t in sorted(alone)], "num_devices": num_devices,
                                "origin": "single"}))
    shards = pd.concat(frames, ignore_index=True).drop_duplicates("sample_id")
    # The same table set drawn twice is measured once.
    shards = shards[~shards["table_ids"].map(lambda v: tuple(sorted(v))).duplicated()].reset_index(drop=True)
    schemas.write(shards, target, "shards")
    return target


def plan_shards(tables: TableSet, n: int, *, memory_bytes_per_device: int, seed: int = 0,
                task_tables: tuple[int, int] = PLAN_TASK_TABLES, devices: Sequence[int] = PLAN_DEVICES,
                max_shard_tables: int = MAX_PLAN_SHARD_TABLES) -> pd.DataFrame:
    """`n` device shards of placements as planners make them, drawn from `tables` (one pool).

    Each plan: a task of `task_tables` random tables on one of `devices` (those that leave <= `max_shard_tables`
    per device on average), placed by a random greedy baseline; with probability NEIGHBOUR_SHARE it is moved one
    step the way local search moves (1-3 tables from the device with the largest proxy load to others, memory
    kept). Up to SHARDS_PER_PLAN of its device shards are kept, moved devices first; a table set is kept once.
    origin: 'plan:<planner>' or 'plan:<planner>+move'.
    """
    from ..planners.baselines import GREEDY_BASELINES, PROXIES, make_baseline

    if len(tables) == 0:
        raise EmbshardError("empty table pool", field="table_ids", fix="give at least one table to sample from")
    if n <= 0:
        raise EmbshardError(f"{n} plan shards asked", field="shards", fix="ask for at least one shard")
    rng = np.random.default_rng(seed)
    lo, hi = min(task_tables[0], len(tables)), min(task_tables[1], len(tables))
    rows: list[dict] = []
    seen: set[tuple[str, ...]] = set()
    for attempt in range(50 * n):
        if len(rows) >= n:
            break
        k = int(rng.integers(lo, hi + 1))
        counts = [d for d in devices if d <= k and k <= d * max_shard_tables] or [min(max(devices), k)]
        nd = int(rng.choice(counts))
        sub = tables.subset(np.sort(rng.choice(len(tables), size=k, replace=False)))
        name = GREEDY_BASELINES[int(rng.integers(len(GREEDY_BASELINES)))]
        try:
            plan = make_baseline(name, seed=seed).plan(sub, nd, memory_bytes_per_device, f"plan-{attempt}")
        except EmbshardError:
            continue  # these tables do not fit these devices: draw another task
        assign = plan.device_of_shards()
        origin, moved = f"plan:{name}", []
        if nd > 1 and rng.random() < NEIGHBOUR_SHARE:
            load = np.bincount(assign, weights=PROXIES[name.removesuffix("_greedy")](sub), minlength=nd)
            src = int(np.argmax(load))
            on_src = np.flatnonzero(assign == src)
            trial = assign.copy()
            for t in rng.choice(on_src, size=min(len(on_src), int(rng.integers(1, 4))), replace=False):
                trial[t] = int(rng.choice([d for d in range(nd) if d != src]))
            used = np.bincount(trial, weights=sub.size_bytes.astype(np.float64), minlength=nd)
            if (used <= memory_bytes_per_device).all():
                assign, origin = trial, origin + "+move"
                moved = [src] + sorted(set(trial[on_src].tolist()) - {src})
        order = moved + [int(d) for d in rng.permutation(nd) if int(d) not in moved]
        kept = 0
        for dev in order:
            ids = sorted(str(t) for t in sub.table_ids[assign == dev])
            if not ids or len(ids) > max_shard_tables or tuple(ids) in seen:
                continue
            seen.add(tuple(ids))
            rows.append({"sample_id": f"plan-s{seed}-{len(rows):06d}", "table_ids": ids, "num_devices": nd,
                         "origin": origin})
            kept += 1
            if kept >= SHARDS_PER_PLAN or len(rows) >= n:
                break
    if not rows:
        raise EmbshardError("no plan fits the devices' memory", field="memory_gb",
                            fix="give more memory per device or smaller tables")
    return schemas.validate(pd.DataFrame(rows), "shards", "<plan shards>")
