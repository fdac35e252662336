"""The sample_shards stage: which device shards the benchmark measures, decided once per run (DIR/shards.parquet).

Every mapped benchmark chunk reads this list instead of recomputing it. The budget:
- two thirds: random shards of train-pool tables (what the cost model trains on), one third: random shards of
  test-pool tables (its accuracy on tables it never saw); each shard stays inside one pool (embshard.pools);
- every train-pool table alone, and every test-pool table of the test shards alone (cheap; the single-table
  reference of the cost-model report needs them);
- the greedy baselines' device shards of the first train tasks, each task's tables placed on half its devices,
  so the cost model sees shards as large as a real placement's.
"""
from __future__ import annotations

import math

import pandas as pd

from .. import pools, schemas, storage
from ..errors import EmbshardError

SHARDS_FILE = "shards.parquet"
PLACEMENT_SHARD_TASKS = 8  # train tasks whose greedy-baseline placements are measured too
MAX_RANDOM_TABLES = 15     # largest random shard


def run(tables: str, tasks: str, out: str, *, num_shards: int, seed: int = 0,
        max_tables: int = MAX_RANDOM_TABLES) -> str:
    """Write OUT/shards.parquet (shards contract) and return its path; an existing list is kept (the list is a
    pure function of the inputs, so a rerun or a retried task sees the same one)."""
    from ..bench.sampler import placement_shards, random_shards
    from ..planners.baselines import GREEDY_BASELINES, make_baseline
    from ..types import load_tasks

    target = storage.join(out, SHARDS_FILE)
    if storage.exists(target):
        return target
    if int(num_shards) < 3:
        raise EmbshardError(f"{num_shards} shards", field="bench_shards", fix="measure at least 3 shards")
    tdf = schemas.read(tables, "tables")
    train_tasks = load_tasks(tables, tasks, "train")
    num_devices = train_tasks[0].num_devices
    n_test = int(num_shards) // 3
    frames = []
    for pool, n in (("train", int(num_shards) - n_test), ("test", n_test)):
        members = pools.members(tdf, pool, seed)
        if members and n > 0:
            df = random_shards(members, n, max_tables=max_tables, seed=seed, num_devices=num_devices)
            frames.append(df.assign(sample_id=f"{pool}-" + df["sample_id"]))
    alone = set(pools.members(tdf, "train", seed))
    for df in frames[1:]:
        alone |= {t for ids in df["table_ids"] for t in ids}
    frames.append(pd.DataFrame({"sample_id": [f"single-{t}" for t in sorted(alone)],
                                "table_ids": [[t] for t in sorted(alone)], "num_devices": num_devices,
                                "origin": "single"}))
    rows = []
    for task in train_tasks[:PLACEMENT_SHARD_TASKS]:
        for name in GREEDY_BASELINES:
            try:
                pl = make_baseline(name, seed=seed).plan(task.tables, max(1, math.ceil(task.num_devices / 2)),
                                                         task.memory_bytes_per_device, task.task_id)
            except EmbshardError:
                continue  # half the devices may not hold the task: the full task still fits (checked by tasks)
            rows.append(pl.to_frame())
    if rows:
        frames.append(placement_shards(pd.concat(rows, ignore_index=True), num_devices))
    shards = pd.concat(frames, ignore_index=True).drop_duplicates("sample_id")
    # The same table set from several baselines is measured once.
    shards = shards[~shards["table_ids"].map(lambda v: tuple(sorted(v))).duplicated()].reset_index(drop=True)
    schemas.write(shards, target, "shards")
    return target
