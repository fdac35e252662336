"""The sample_shards stage: which device shards the benchmark measures, decided once per run (DIR/shards.parquet).

Every mapped benchmark chunk reads this list instead of recomputing it. The budget:
- two thirds from train-pool tables (what the cost model trains on), one third from test-pool tables (its accuracy
  on tables it never saw); each shard stays inside one pool (embshard.pools);
- in each pool, half random shards of 1-15 tables and half plan shards (plan_shards): device shards
  of greedy plans of 20-200-table tasks on 2-16 devices, half of them one search step away, 1-60 tables each:
  the devices the planners and the search actually compare;
- split pieces (docs/contracts.md, "Shard kinds") where plans put them, within the same budget: a quarter of the
  random shards hold one table as a row range or a column slice (bench.sampler.split_shards: the hot, large
  tables most often), a quarter of the plans split their heaviest table over the devices (plan_shards), and
  any plan's pieces are kept as they are (col_sizes, row_offsets, row_sizes);
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
SHARDS_INPUTS_FILE = "shards.inputs.json"  # what the list was drawn from (run: reused only for the same inputs)
MAX_RANDOM_TABLES = 15     # largest random shard
# Plan shards: synthetic tasks the size of the quality suites', so the cost model trains on devices as crowded as
# the ones it must rank (a 200-table task on 4 devices puts ~50 tables on each).
PLAN_TASK_TABLES = (20, 200)
PLAN_DEVICES = (2, 4, 8, 16)
MAX_PLAN_SHARD_TABLES = 60
SHARDS_PER_PLAN = 2       # device shards kept per plan: more plans, less of the same plan
NEIGHBOUR_SHARE = 0.5     # plans moved one search step (1-3 tables off the most loaded device) before sampling
SPLIT_SHARE = 0.25        # plans whose heaviest table is split over the devices before sampling
REPLICA_SHARE = 0.15      # plans whose hottest small table is replicated on every device before sampling
REPLICA_MAX_BYTES = 64 * 2**20  # tables up to this size are replicated (the planner replicates small hot ones)
_REPLICA_STREAM = 0x5EB1  # the rng stream of the replica draws


def _piece_proxy(plan, table_proxy: np.ndarray) -> np.ndarray:
    """A planner proxy per piece: the table's, times the piece's share of its rows or columns."""
    t = plan.tables
    out = []
    for p in plan.shards:
        share = 1.0
        if p.col_size is not None:
            share *= p.col_size / float(t.dims[p.table])
        if p.row_size is not None:
            share *= p.row_size / float(t.rows[p.table])
        out.append(float(table_proxy[p.table]) * share)
    return np.asarray(out)


def _replicate_hottest(plan):
    """`plan` with its hottest small whole table (most lookup work, pooling x dim, among those of at most
    REPLICA_MAX_BYTES) replicated on every device, as the learned planner replicates one; None when there is none
    or its copies do not fit every device's memory."""
    from ..placement import Placement
    from ..types import REPLICATED, Shard

    t, nd = plan.tables, plan.num_devices
    cands = [j for j, s in enumerate(plan.shards)
             if s.kind == "whole" and int(t.size_bytes[s.table]) <= REPLICA_MAX_BYTES]
    if nd < 2 or not cands:
        return None
    j = max(cands, key=lambda j: float(t.pooling_factor[plan.shards[j].table] * t.dims[plan.shards[j].table]))
    s = plan.shards[j]
    used = np.bincount(plan.device_of_shards(), weights=plan.shard_bytes().astype(np.float64), minlength=nd)
    size = float(t.size_bytes[s.table])
    if any(used[d] + size > plan.memory_bytes_per_device for d in range(nd) if d != s.device):
        return None
    shards = [p for k, p in enumerate(plan.shards) if k != j] + [Shard(s.table, d, kind=REPLICATED)
                                                               for d in range(nd)]
    return Placement(t, nd, plan.memory_bytes_per_device, shards, planner=plan.planner, task_id=plan.task_id)


def _split_heaviest(plan, table_proxy: np.ndarray, rng: np.random.Generator):
    """`plan` with its heaviest table (by the proxy) split in k pieces on k distinct devices, the least loaded
    first: k equal row ranges (k a power of two up to the devices) or, for tables of dim >= 8, k column slices
    (multiples of 4). None when the memory no longer fits or nothing can be split."""
    from ..placement import Placement
    from ..types import Shard

    t, nd = plan.tables, plan.num_devices
    proxy = _piece_proxy(plan, table_proxy)
    k_shard = int(np.argmax(proxy))
    s = plan.shards[k_shard]
    if s.kind != "whole":
        return None
    i, rows, dim = s.table, int(t.rows[s.table]), int(t.dims[s.table])
    ways = [k for k in (2, 4, 8, 16) if k <= nd]
    if not ways:
        return None
    k = int(rng.choice(ways))
    others = [p for j, p in enumerate(plan.shards) if j != k_shard]
    load = np.bincount([p.device for p in others], weights=np.delete(proxy, k_shard), minlength=nd)
    devs = [int(d) for d in np.argsort(load, kind="stable")[:k]]
    if dim // 4 >= k and rng.random() < 0.5:
        units = np.diff(np.linspace(0, dim // 4, k + 1).astype(int)) * 4
        offs = np.concatenate([[0], np.cumsum(units)[:-1]])
        new = [Shard(i, d, col_offset=int(o), col_size=int(w)) for d, o, w in zip(devs, offs, units)]
    elif rows >= k:
        bounds = [j * rows // k for j in range(k + 1)]
        new = [Shard(i, d, row_offset=bounds[j], row_size=bounds[j + 1] - bounds[j]) for j, d in enumerate(devs)]
    else:
        return None
    out = Placement(t, nd, plan.memory_bytes_per_device, others + new, planner=plan.planner, task_id=plan.task_id)
    if (out.memory_per_device() > plan.memory_bytes_per_device).any():
        return None
    return out


def run(tables: str, tasks: str, out: str, *, num_shards: int, seed: int = 0,
        max_tables: int = MAX_RANDOM_TABLES) -> str:
    """Write OUT/shards.parquet (shards contract) and return its path. An existing list drawn from the same
    inputs is kept (the list is a pure function of them, so a rerun or a retried task sees the same one); one drawn
    from other tables, tasks or options (the root re-ingested, say) is drawn again, never reused: its pools would
    no longer be this run's (OUT/shards.inputs.json holds what it was drawn from)."""
    import json
    import logging

    from ..bench.fingerprint import tables_hash
    from ..bench.sampler import piece_key, random_shards, split_shards
    from ..types import load_tasks

    if int(num_shards) < 3:
        raise EmbshardError(f"{num_shards} shards", field="bench_shards", fix="measure at least 3 shards")
    tdf = schemas.read(tables, "tables")
    table_set = TableSet.from_frame(tdf, checked=True)
    train_tasks = load_tasks(table_set, tasks, "train")
    target, inputs_file = storage.join(out, SHARDS_FILE), storage.join(out, SHARDS_INPUTS_FILE)
    pool_column = [str(p) for p in tdf["pool"]] if "pool" in tdf.columns else None
    inputs = {"tables_sha256": tables_hash(table_set), "pools": pool_column,
              "tasks": [[t.task_id, t.num_devices, t.memory_bytes_per_device, list(map(str, t.tables.table_ids))]
                        for t in train_tasks],
              "num_shards": int(num_shards), "seed": int(seed), "max_tables": int(max_tables)}
    if storage.exists(target):
        try:
            same = json.loads(storage.read_text(inputs_file)) == inputs
        except (OSError, ValueError, UnicodeDecodeError):
            same = False
        if same:
            return target
        logging.getLogger(__name__).warning("%s was drawn from other tables, tasks or options: drawing it again",
                                            target)
    num_devices = train_tasks[0].num_devices
    n_test = int(num_shards) // 3
    frames = []
    for pool, n in (("train", int(num_shards) - n_test), ("test", n_test)):
        members = pools.members(tdf, pool, seed)
        if not members or n <= 0:
            continue
        n_plan = n // 2
        df = random_shards(members, n - n_plan, max_tables=max_tables, seed=seed, num_devices=num_devices)
        df = split_shards(df, table_set, seed=2 * seed + (pool == "test"))
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
    shards = shards[~shards.apply(piece_key, axis=1).duplicated()].reset_index(drop=True)
    schemas.write(shards, target, "shards")
    storage.write_text(inputs_file, json.dumps(inputs) + "\n")  # after the list: a kill between leaves a redraw
    return target


def plan_shards(tables: TableSet, n: int, *, memory_bytes_per_device: int, seed: int = 0,
                task_tables: tuple[int, int] = PLAN_TASK_TABLES, devices: Sequence[int] = PLAN_DEVICES,
                max_shard_tables: int = MAX_PLAN_SHARD_TABLES) -> pd.DataFrame:
    """`n` device shards of placements as planners make them, drawn from `tables` (one pool).

    Each plan: a task of `task_tables` random tables on one of `devices` (those that leave <= `max_shard_tables`
    per device on average), placed by a random greedy baseline; with probability NEIGHBOUR_SHARE it is moved one
    step the way local search moves (1-3 tables from the device with the largest proxy load to others, memory
    kept; replicas never move). Before that, with probability SPLIT_SHARE, the plan's heaviest table (by the
    planner's proxy) is split as a splitting planner would (_split_heaviest), and with probability REPLICA_SHARE
    its hottest small table is replicated on every device (_replicate_hottest). Any plan's pieces are kept by kind
    (col_sizes, row_offsets, row_sizes; -1 = whole; replicas: 1). Up to SHARDS_PER_PLAN of its device shards are
    kept, moved devices first; a set of pieces is kept once.
    origin: 'plan:<planner>[+split][+replica][+move]'.
    """
    from ..bench.sampler import device_shard_row, piece_key
    from ..planners.base import inner_plans
    from ..planners.baselines import GREEDY_BASELINES, PROXIES, make_baseline
    from ..types import REPLICATED

    if len(tables) == 0:
        raise EmbshardError("empty table pool", field="table_ids", fix="give at least one table to sample from")
    if n <= 0:
        raise EmbshardError(f"{n} plan shards asked", field="shards", fix="ask for at least one shard")
    rng = np.random.default_rng(seed)
    lo, hi = min(task_tables[0], len(tables)), min(task_tables[1], len(tables))
    rows: list[dict] = []
    seen: set[tuple] = set()
    for attempt in range(50 * n):
        if len(rows) >= n:
            break
        k = int(rng.integers(lo, hi + 1))
        counts = [d for d in devices if d <= k and k <= d * max_shard_tables] or [min(max(devices), k)]
        nd = int(rng.choice(counts))
        sub = tables.subset(np.sort(rng.choice(len(tables), size=k, replace=False)))
        name = GREEDY_BASELINES[int(rng.integers(len(GREEDY_BASELINES)))]
        try:
            with inner_plans():  # shapes to measure, not a user's plan: no warnings
                plan = make_baseline(name, seed=seed).plan(sub, nd, memory_bytes_per_device, f"plan-{attempt}")
        except EmbshardError:
            continue  # these tables do not fit these devices: draw another task
        origin = f"plan:{name}"
        if nd > 1 and rng.random() < SPLIT_SHARE:
            split = _split_heaviest(plan, PROXIES[name.removesuffix("_greedy")](sub), rng)
            if split is not None:
                plan, origin = split, origin + "+split"
        # (its own stream: the other draws, and so the plans sampled without replicas, stay as they were)
        if nd > 1 and np.random.default_rng([seed, attempt, _REPLICA_STREAM]).random() < REPLICA_SHARE:
            replicated = _replicate_hottest(plan)
            if replicated is not None:
                plan, origin = replicated, origin + "+replica"
        pieces = plan.shards
        assign = plan.device_of_shards()
        moved: list[int] = []
        if nd > 1 and rng.random() < NEIGHBOUR_SHARE:
            proxy = _piece_proxy(plan, PROXIES[name.removesuffix("_greedy")](sub))
            load = np.bincount(assign, weights=proxy, minlength=nd)
            src = int(np.argmax(load))
            on_src = np.flatnonzero((assign == src) & np.array([p.kind != REPLICATED for p in pieces]))
            trial = assign.copy()
            for t in rng.choice(on_src, size=min(len(on_src), int(rng.integers(1, 4))), replace=False):
                trial[t] = int(rng.choice([d for d in range(nd) if d != src]))
            used = np.bincount(trial, weights=plan.shard_bytes().astype(np.float64), minlength=nd)
            if (used <= memory_bytes_per_device).all():
                assign, origin = trial, origin + "+move"
                moved = [src] + sorted(set(trial[on_src].tolist()) - {src})
        order = moved + [int(d) for d in rng.permutation(nd) if int(d) not in moved]
        kept = 0
        for dev in order:
            on = [pieces[k] for k in np.flatnonzero(assign == dev)]
            if not on or len(on) > max_shard_tables:
                continue
            row = device_shard_row(sub.table_ids, on, nd, sample_id=f"plan-s{seed}-{len(rows):06d}",
                                   origin=origin)
            key = piece_key(row)
            if key in seen:
                continue
            seen.add(key)
            rows.append(row)
            kept += 1
            if kept >= SHARDS_PER_PLAN or len(rows) >= n:
                break
    if not rows:
        raise EmbshardError("no plan fits the devices' memory", field="memory_gb",
                            fix="give more memory per device or smaller tables")
    return schemas.validate(pd.DataFrame(rows), "shards", "<plan shards>")
