"""Shard lists for GPU measurements: the pipeline's benchmark protocol with shards of 1-60 tables, plus A/A copies.

`python -m benchmarks.gpu_shards --root DIR --random 450 --aa-shards 32 --aa-rounds 5`
(DIR holds tables.parquet and tasks.parquet from `embshard ingest` / `embshard tasks`)

- DIR/shards.parquet: the benchmark stage's list (embshard.stages.bench_shards: every train-pool table alone and
  the greedy baselines' device shards of train tasks, each shard inside one cost-model table pool), its random
  part replaced by `--random` shards of 1..60 tables (two thirds from the seen pool, one third unseen).
- DIR/aa_shards.parquet: `--aa-shards` other random shards, each listed `--aa-rounds` times (sample ids
  aa-r<round>-<k>): `embshard bench` measures every copy from scratch (op built, weights filled, inputs made)
  in its seeded shuffled order, so the copies are an A/A test of the ruler.
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

    from embshard import schemas, stages
    from embshard.bench.sampler import random_shards
    from embshard.costmodel.data import table_pools
    from embshard.tableset import TableSet

    base = stages.bench_shards(a.root, {"bench_shards": 3, "seed": a.seed})
    base = schemas.read(base, "shards")
    base = base[~base["sample_id"].str.match(r"^(seen|unseen)-random")]
    tables = TableSet.read(os.path.join(a.root, "tables.parquet"))
    tasks = schemas.read(os.path.join(a.root, "tasks.parquet"), "tasks")
    train = tasks[tasks["split"] == "train"]
    pool = sorted({t for ids in train["table_ids"] for t in ids})
    D = int(train["num_devices"].iloc[0])
    seen, unseen = table_pools(tables.table_ids, seed=a.seed)
    n_unseen = a.random // 3
    frames = [base]
    for name, ids, n in (("seen", seen, a.random - n_unseen), ("unseen", unseen, n_unseen)):
        members = [t for t in pool if t in ids]
        df = random_shards(members, n, max_tables=a.max_tables, seed=a.seed, num_devices=D)
        frames.append(df.assign(sample_id=f"{name}-" + df["sample_id"]))
    shards = pd.concat(frames, ignore_index=True).drop_duplicates("sample_id").reset_index(drop=True)
    schemas.write(shards, os.path.join(a.root, "shards.parquet"), "shards")
    aa = random_shards(pool, a.aa_shards, max_tables=a.max_tables, seed=a.seed + 1000, num_devices=D)
    copies = pd.concat([aa.assign(sample_id=[f"aa-r{r}-{k:03d}" for k in range(len(aa))], origin="aa")
                        for r in range(a.aa_rounds)], ignore_index=True)
    schemas.write(copies, os.path.join(a.root, "aa_shards.parquet"), "shards")
    print(f"{len(shards)} shards ({shards['origin'].value_counts().to_dict()}), "
          f"{len(copies)} A/A copies of {len(aa)} shards")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
