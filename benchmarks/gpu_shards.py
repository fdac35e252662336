"""Shard lists for GPU measurements: the pipeline's shard protocol with shards of 1-60 tables, plus A/A copies.

`python -m benchmarks.gpu_shards --root DIR --random 450 --aa-shards 32 --aa-rounds 5`
(DIR holds tables.parquet and tasks.parquet from `embshard ingest` / `embshard tasks`)

- DIR/shards.parquet: the sample_shards stage's list (embshard.jobs.shards: inside each table pool, two thirds
  train pool and one third test pool, half random shards of 1..`--max-tables` tables and half device shards of
  greedy plans and their search neighbours; tables alone), `--random` shards in all.
- DIR/aa_shards.parquet: `--aa-shards` other random train-pool shards, each listed `--aa-rounds` times (sample ids
  aa-r<round>-<k>): `embshard bench` measures every copy from scratch (op built, weights filled, inputs made)
  in its seeded shuffled order, so the copies are an A/A test of the ruler.

benchmarks/data/gpu-h100 was measured with the earlier protocol (its tables' `pool` column records the split
that was used).
"""
from __future__ import annotations

import argparse
import os

import pandas as pd


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--random", type=int, default=450)
    ap.add_argument("--max-tables", type=int, default=60)
    ap.add_argument("--aa-shards", type=int, default=32)
    ap.add_argument("--aa-rounds", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)

    from embshard import pools, schemas
    from embshard.bench.sampler import random_shards
    from embshard.jobs.shards import run as sample_shards
    from embshard.types import load_tasks

    tables = os.path.join(a.root, "tables.parquet")
    path = sample_shards(tables, os.path.join(a.root, "tasks.parquet"), a.root, num_shards=a.random,
                         seed=a.seed, max_tables=a.max_tables)
    shards = schemas.read(path, "shards")
    D = load_tasks(tables, os.path.join(a.root, "tasks.parquet"), "train")[0].num_devices
    pool = pools.members(schemas.read(tables, "tables"), "train", a.seed)
    aa = random_shards(pool, a.aa_shards, max_tables=a.max_tables, seed=a.seed + 1000, num_devices=D)
    copies = pd.concat([aa.assign(sample_id=[f"aa-r{r}-{k:03d}" for k in range(len(aa))], origin="aa")
                        for r in range(a.aa_rounds)], ignore_index=True)
    schemas.write(copies, os.path.join(a.root, "aa_shards.parquet"), "shards")
    print(f"{len(shards)} shards ({shards['origin'].value_counts().to_dict()}), "
          f"{len(copies)} A/A copies of {len(aa)} shards")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
