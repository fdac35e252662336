"""The table pools: which tables the models may learn from ("train") and which are held out ("test").

Decided once, at ingest, and stored with the tables (the `pool` column of tables.parquet): train tasks draw from
the train pool and test tasks from the test pool (jobs.tasks); the benchmark measures mostly train-pool shards
and some test-pool shards (jobs.shards); the cost model trains on train-pool shards only and reports its
accuracy on tables it never saw on the test-pool shards (costmodel.data). One rule, so no stage can leak held-out
tables into training.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

POOLS = ("train", "test")


def assign(table_ids, seed: int) -> np.ndarray:
    """A seeded shuffle of the sorted ids (independent of row order): the first half (the larger when odd) train,
    the rest test. Returns the pool of each id, in the given order."""
    given = [str(t) for t in table_ids]
    ids = np.array(sorted(given), dtype=object)
    order = np.random.default_rng([seed, 11]).permutation(len(ids))
    cut = (len(ids) + 1) // 2
    train = set(ids[order[:cut]])
    return np.array(["train" if t in train else "test" for t in given], dtype=object)


def of(tables: pd.DataFrame, seed: int = 0) -> np.ndarray:
    """The pool of each table: the stored `pool` column, or (tables files written before it existed) `assign`."""
    if "pool" in tables.columns:
        return tables["pool"].astype(str).to_numpy(dtype=object)
    return assign(tables["table_id"], seed)


def members(tables: pd.DataFrame, pool: str, seed: int = 0) -> list[str]:
    """The sorted table ids of one pool."""
    ids = tables["table_id"].astype(str).to_numpy(dtype=object)
    return sorted(ids[of(tables, seed) == pool])


def split_train_tasks(tables, tasks):
    """(fit, validation) train tasks: the first fifth validates (keeps the best weights), the rest trains. One
    rule for the policy's training (jobs.train_policy) and the outer loop's measured plans (jobs.measure_plans)."""
    from .types import load_tasks

    train = load_tasks(tables, tasks, "train")
    n_val = max(1, len(train) // 5) if len(train) > 1 else 0
    return (train[n_val:], train[:n_val]) if n_val else (train, train)
