"""The tasks stage (`embshard tasks`): sample train tasks from the train pool and test tasks from the test pool.

The pools are the tables' `pool` column (embshard.pools, decided at ingest: the test pool is never seen in
training; docs/method.md, "Data and splits"). Each task draws T tables from one pool (T fixed or a
range), a device count D (one value or a list to draw from) and a per-device memory cap. A table larger than a
device is fine: the planners cut it. A task that cannot fit (total bytes over D x memory, or pieces that do not
pack even cut row-wise) is an error that says which task and how much memory would make every task fit; no task is
silently dropped.
"""
from __future__ import annotations

import argparse
import os
from typing import Any

import numpy as np

from ..checks import GiB, size_text


def parse_range(text: str | int | tuple, field: str) -> tuple[int, int]:
    """'20' -> (20, 20); '20-60' or (20, 60) -> (20, 60)."""
    from ..errors import EmbshardError

    if isinstance(text, (tuple, list)) and len(text) == 2:
        lo, hi = int(text[0]), int(text[1])
    else:
        parts = str(text).replace(":", "-").split("-")
        try:
            lo = int(parts[0])
            hi = int(parts[1]) if len(parts) == 2 else lo
            if len(parts) > 2:
                raise ValueError
        except ValueError:
            raise EmbshardError(f"invalid value {text!r}", field=field, fix="give N or LO-HI, e.g. 20 or 20-60") \
                from None
    if lo <= 0 or hi < lo:
        raise EmbshardError(f"invalid range {lo}-{hi}", field=field, fix="give 0 < LO <= HI")
    return lo, hi


def parse_list(text, field: str, cast=int) -> list:
    """'4,8' -> [4, 8]; an int/float or a list passes through. Values must be > 0."""
    from ..errors import EmbshardError

    items = text if isinstance(text, (list, tuple)) else str(text).split(",")
    if not isinstance(text, (list, tuple)) and len(items) > 1 and items[-1].strip() == "":
        items = items[:-1]  # one trailing comma ('4,8,') is common and means nothing
    if any(str(v).strip() == "" for v in items) and len(items) > 1:  # '4,,8': a value left out, not a list of two
        raise EmbshardError(f"invalid value {text!r}: an empty item", field=field,
                            fix="give a number or a list like 4,8, without empty items")
    try:
        vals = [cast(v) for v in items if str(v).strip() != ""]
    except argparse.ArgumentTypeError as exc:  # gib_text's own words ("the unit is GiB, not GB")
        raise EmbshardError(str(exc), field=field, fix="give a number or a list like 16,32 (GiB)") from None
    except ValueError:
        raise EmbshardError(f"invalid value {text!r}", field=field, fix="give a number or a list like 4,8") from None
    if not vals or any(not np.isfinite(v) or v <= 0 for v in vals):
        raise EmbshardError(f"invalid value {text!r}", field=field, fix="give positive numbers, e.g. 4 or 4,8")
    return vals


def sample_tasks(tables_df, num_tasks: int, tables_per_task, devices, memory_gb, seed: int,
                 where: str = "<tables>", devices_per_host: int | None = None):
    """A validated tasks frame: `num_tasks` tasks from each pool (ids train-0000.., test-0000..); every task on
    hosts of `devices_per_host` devices when given (None: one host, no devices_per_host column)."""
    import pandas as pd

    from .. import checks, pools, schemas
    from ..errors import EmbshardError, InfeasiblePlacementError

    if int(num_tasks) <= 0:
        raise EmbshardError("must be > 0", field="num_tasks", fix="ask for at least one task per split")
    if int(num_tasks) > checks.MAX_TASKS:
        raise EmbshardError(f"{int(num_tasks):,} tasks per split is over the maximum", field="num_tasks",
                            fix=f"ask for at most {checks.MAX_TASKS:,} tasks per split")
    seed = checks.seed(seed)
    lo, hi = parse_range(tables_per_task, "tables_per_task")

    dev_choices = [checks.devices(d) for d in parse_list(devices, "devices", int)]
    # GiB as a number or with its unit, as --memory-gb of place takes it ('16GiB,32GiB' had been refused)
    mem_choices = [checks.memory_gb(m) for m in parse_list(memory_gb, "memory_gb",
                                                            lambda v: v if isinstance(v, (int, float))
                                                            else checks.gib_text(v))]
    if devices_per_host is not None:  # every device count must split into whole hosts (DeviceTopology.on_hosts)
        from ..types import DeviceTopology

        for d in dev_choices:
            DeviceTopology.on_hosts(d, 1, int(devices_per_host))
    if len(tables_df) < 2:
        raise EmbshardError(f"only {len(tables_df)} table: cannot split into train and test pools", path=where,
                            field="table_id", fix="ingest at least 2 tables")
    train, test = (pools.members(tables_df, p, seed) for p in pools.POOLS)
    size = dict(zip(tables_df["table_id"].astype(str), tables_df["size_bytes"].astype(np.int64)))
    rng = np.random.default_rng([seed, 12])
    rows: list[dict[str, Any]] = []
    for split, pool in (("train", train), ("test", test)):
        if hi > len(pool):
            raise EmbshardError(f"a task of {hi} tables cannot be drawn from the {len(pool)} tables of the "
                                f"{split} pool", path=where, field="tables_per_task",
                                fix=f"use --tables-per-task <= {len(pool)} (the pipeline's --param "
                                    "tables_per_task), or ingest more tables")
        pool_arr = np.array(pool, dtype=object)
        for k in range(int(num_tasks)):
            t = int(rng.integers(lo, hi + 1))
            ids = sorted(pool_arr[rng.choice(len(pool_arr), size=t, replace=False)])
            d = int(dev_choices[rng.integers(len(dev_choices))])
            mem = int(mem_choices[rng.integers(len(mem_choices))] * GiB)
            rows.append({"task_id": f"{split}-{k:04d}", "split": split, "num_devices": d,
                         "memory_bytes_per_device": mem, "table_ids": ids})
    # Feasibility: report the first task that cannot fit and the memory that would make every task fit. A table
    # larger than a device is cut, as every planner cuts it (planners.splitting): a task fits when its bytes do
    # and its cut pieces pack.
    need = []  # per task: the per-device memory it needs at least (its bytes spread over its devices)
    for r in rows:
        sizes = np.array([size[i] for i in r["table_ids"]], dtype=np.int64)
        need.append(-(-int(sizes.sum()) // r["num_devices"]))
    over = [i for i, r in enumerate(rows) if need[i] > r["memory_bytes_per_device"]
            or not _packs_cut(tables_df, r, size)]
    if over:
        i = over[0]
        r = rows[i]
        task_sizes = {t: size[t] for t in r["table_ids"]}
        cap = r["memory_bytes_per_device"]
        if need[i] > cap:
            why = (f"its {len(task_sizes)} tables need {size_text(sum(task_sizes.values()))} > {r['num_devices']} "
                   f"devices x {size_text(cap)}")
        else:
            why = f"its tables do not pack into {r['num_devices']} x {size_text(cap)} even cut row-wise"
        enough = max(max(need), max(max(size[t] for t in rows[k]["table_ids"]) for k in over)) / GiB
        # the names of `embshard tasks` and of the pipeline's params (its ingest stage samples the tasks here)
        raise InfeasiblePlacementError(
            f"task {r['task_id']} cannot fit: {why}", path=where, field="memory_gb",
            fix=f"give memory_gb (--memory-gb) >= {np.ceil(enough * 100) / 100:.2f} (fits every sampled task), "
                f"more devices, or fewer tables_per_task")
    df = pd.DataFrame(rows)
    if devices_per_host is not None:
        df["devices_per_host"] = np.int32(devices_per_host)
    return schemas.validate(df, "tasks", where)


def _packs_cut(tables_df, task: dict, size: dict) -> bool:
    """Whether a task whose bytes fit its devices also packs: whole where every table fits a device (the planners
    spread them; told from `size`, table -> bytes, without touching the frame: up to 20,000 tasks are checked),
    else with the cuts the planners make (planners.splitting.split_to_fit)."""
    if max(size[t] for t in task["table_ids"]) <= task["memory_bytes_per_device"]:
        return True
    from ..errors import InfeasiblePlacementError
    from ..planners.splitting import split_to_fit
    from ..tableset import TableSet
    from ..types import DeviceTopology

    sub = tables_df[tables_df["table_id"].astype(str).isin(task["table_ids"])]
    try:
        # checked: `tables_df` was read against the tables contract (up to 20,000 tasks come here)
        split_to_fit(TableSet.from_frame(sub, checked=True),
                     DeviceTopology(task["num_devices"], task["memory_bytes_per_device"]), task["task_id"])
    except InfeasiblePlacementError:
        return False
    return True


def run(tables: str, out: str, num_tasks: int, tables_per_task=20, devices=4, memory_gb=16.0,
        seed: int = 0, devices_per_host: int | None = None) -> str:
    """Sample tasks from tables.parquet into `<out>/tasks.parquet`; returns that path.

    tables_per_task: an int, "20-60" or (20, 60); devices: an int, "4,8" or a list to draw from per task;
    memory_gb: per-device memory in GiB (2**30 bytes), one value or a list to draw from.
    """
    from .. import schemas, storage

    df = schemas.read(tables, "tables")
    tasks = sample_tasks(df, num_tasks, tables_per_task, devices, memory_gb, seed, where=os.fspath(tables),
                         devices_per_host=devices_per_host)
    path = storage.join(out, schemas.TASKS_FILE)
    schemas.write(tasks, path, "tasks")
    return path


# What `embshard tasks` writes and reads: its --out is checked before any work (cli.check_output).
OUTPUT = {"kind": "folder", "writes": ("tasks.parquet",), "inputs": ("tables",)}


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tables", required=True, help="tables.parquet (from embshard ingest)")
    p.add_argument("--out", required=True, help="output folder; writes OUT/tasks.parquet")
    p.add_argument("--num-tasks", type=int, required=True, help="tasks per split (train and test), at most 10,000")
    p.add_argument("--tables-per-task", default="20", help="tables per task: N or a range LO-HI (default 20)")
    p.add_argument("--devices", default="4", help="devices per task: N or a list to draw from, e.g. 4,8 (default 4)")
    p.add_argument("--memory-gb", default="16", help="memory per device in GiB (a list draws per task; default 16)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the sampling (default 0); also of the pool split for a tables file written before "
                        "its pool column (newer files keep the pools ingest chose)")
    p.add_argument("--devices-per-host", type=int, default=None, metavar="L",
                   help="every task on hosts of L devices (each --devices value must be a multiple of L), so "
                        "planners may cut table-row-wise within a host (default: one host)")


def main(args: argparse.Namespace) -> int:
    from .. import schemas

    path = run(args.tables, args.out, args.num_tasks, args.tables_per_task, args.devices, args.memory_gb,
               args.seed, args.devices_per_host)
    df = schemas.read(path, "tasks")
    n = df["table_ids"].map(len)
    print(f"wrote {path}: {int((df['split'] == 'train').sum())} train + {int((df['split'] == 'test').sum())} "
          f"test tasks, {n.min()}..{n.max()} tables, devices {sorted(df['num_devices'].unique().tolist())}")
    return 0
