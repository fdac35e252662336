"""The sample_shards stage: which device shards the benchmark measures, decided once per run (DIR/shards.parquet).

Every mapped benchmark chunk reads this list instead of recomputing it. The budget:
- two thirds from train-pool tables (what the cost model trains on), one third from test-pool tables (its accuracy
  on tables it never saw); each shard stays inside one pool (embshard.pools);
- in each pool, half random shards of 1-15 tables and half plan shards (bench.sampler.plan_shards): device shards
  of greedy plans of 20-200-table tasks on 2-16 devices, half of them one search step away, 1-60 tables each:
  the devices the planners and the search actually compare;
- every train-pool table alone, and every test-pool table of the test shards alone (cheap; the single-table
  reference of the cost-model report needs them).
"""
from __future__ import annotations

import pandas as pd

from .. import pools, schemas, storage
from ..errors import EmbshardError

SHARDS_FILE = "shards.parquet"
MAX_RANDOM_TABLES = 15     # largest random shard


def run(tables: str, tasks: str, out: str, *, num_shards: int, seed: int = 0,
        max_tables: int = MAX_RANDOM_TABLES) -> str:
    """Write OUT/shards.parquet (shards contract) and return its path; an existing list is kept (the list is a
    pure function of the inputs, so a rerun or a retried task sees the same one)."""
    from ..bench.sampler import plan_shards, random_shards
    from ..tableset import TableSet
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
