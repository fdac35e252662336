"""Which device shards to measure: random shards and every device shard of given placements. (Shards of plans as
planners make them are made by the job that samples, jobs.shards.plan_shards: the measuring layer does not plan.)

A shard is the set of tables one device holds. Shard lists are frames of the "shards" contract
(sample_id, table_ids, num_devices, origin[, col_sizes, row_offsets, row_sizes]); `load_shards` builds one
from the CLI's spec. `split_shards` makes some of a list's shards hold a split piece (docs/contracts.md, "Shard
kinds").
Sample ids are deterministic (seed and position), so a rerun or another pod sees exactly the same list.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd

from .. import schemas
from ..errors import EmbshardError


def random_shards(table_ids: Sequence[str], n: int, min_tables: int = 1, max_tables: int = 15, seed: int = 0,
                  num_devices: int = 4) -> pd.DataFrame:
    """`n` random shards of `min_tables..max_tables` distinct tables (size uniform) drawn from `table_ids`."""
    pool = np.asarray(sorted(set(map(str, table_ids))), dtype=object)
    if len(pool) == 0:
        raise EmbshardError("empty table pool", field="table_ids", fix="give at least one table to sample from")
    if n <= 0:
        raise EmbshardError(f"{n} random shards asked", field="shards", fix="ask for at least one shard")
    if min_tables < 1 or max_tables < min_tables:
        raise EmbshardError(f"bad shard size range {min_tables}..{max_tables}", field="max_tables",
                            fix="use 1 <= min_tables <= max_tables")
    hi = min(max_tables, len(pool))
    lo = min(min_tables, hi)
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        k = int(rng.integers(lo, hi + 1))
        picked = rng.choice(len(pool), size=k, replace=False)
        rows.append({"sample_id": f"random-s{seed}-{i:06d}", "table_ids": [str(t) for t in pool[picked]],
                     "num_devices": int(num_devices), "origin": "random"})
    return schemas.validate(pd.DataFrame(rows), "shards", "<random shards>")


# Split pieces among sampled shards (docs/contracts.md, "Shard kinds"): the share of shards with one table split,
# the row-range counts drawn, and the most column slices.
SPLIT_SHARE = 0.25
ROW_WAYS = (2, 4, 8, 16)
MAX_COLUMN_WAYS = 8
_SPLIT_STREAM = 0x5B117  # a stream of its own: the tables drawn stay those of the seed without splits


def draw_piece(rng: np.random.Generator, rows: int, dim: int) -> tuple[int | None, int, int | None] | None:
    """One piece of a table (rows x dim), as a splitting plan makes them: half the time a row range (one of k
    equal ranges, k in ROW_WAYS), else a column slice of a random k-way split into widths that are multiples of 4
    (2 <= k <= MAX_COLUMN_WAYS). Returns (col_size, row_offset, row_size) (None sizes: whole), or None when the
    table cannot be split (one row and one 4-wide unit)."""
    units = int(dim) // 4
    row_ways = [k for k in ROW_WAYS if k <= rows]
    kinds = (["row"] if row_ways else []) + (["column"] if units >= 2 else [])
    if not kinds:
        return None
    if kinds[int(rng.integers(len(kinds)))] == "row":
        k = int(rng.choice(row_ways))
        j = int(rng.integers(k))
        off = j * int(rows) // k
        return None, off, (j + 1) * int(rows) // k - off
    k = int(rng.integers(2, min(MAX_COLUMN_WAYS, units) + 1))
    cuts = np.sort(rng.choice(np.arange(1, units), size=k - 1, replace=False))
    widths = np.diff(np.concatenate([[0], cuts, [units]])) * 4
    return int(widths[int(rng.integers(k))]), 0, None


def split_shards(df: pd.DataFrame, tables, share: float = SPLIT_SHARE, seed: int = 0) -> pd.DataFrame:
    """`df` (shards) with a `share` of its rows holding one split piece instead of a whole table: a table of the
    shard drawn with probability proportional to pooling_factor x dim (lookup work: the hot, large tables plans
    split) becomes one piece (draw_piece). Same number of shards, same tables; deterministic for a seed. Adds
    col_sizes / row_offsets / row_sizes (-1 = whole) to every row."""
    rng = np.random.default_rng([int(seed), _SPLIT_STREAM])
    pos = {str(t): i for i, t in enumerate(tables.table_ids)}
    cols, offs, sizes = [], [], []
    for ids in df["table_ids"]:
        n = len(ids)
        c, o, z = [-1] * n, [-1] * n, [-1] * n
        if rng.random() < share:
            idx = [pos[str(t)] for t in ids]
            w = np.asarray(tables.pooling_factor, float)[idx] * np.asarray(tables.dims, float)[idx]
            w = w / w.sum() if w.sum() > 0 else np.full(n, 1.0 / n)
            k = int(rng.choice(n, p=w))
            piece = draw_piece(rng, int(tables.rows[idx[k]]), int(tables.dims[idx[k]]))
            if piece is not None:
                col, off, size = piece
                if col is not None:
                    c[k] = col
                if size is not None:
                    o[k], z[k] = off, size
        cols.append(c)
        offs.append(o)
        sizes.append(z)
    out = df.copy()
    out["col_sizes"], out["row_offsets"], out["row_sizes"] = cols, offs, sizes
    return schemas.validate(out, "shards", "<split shards>")


def device_shard_row(table_ids, pieces: list, num_devices: int, **fields) -> dict:
    """A shards row for the pieces one device holds (Shards of one task over `table_ids`), sorted by table and
    offset: their tables and, per entry, col_size, row_offset and row_size (-1 whole); `replicas` only when one
    is a replica (rows without stay as they were). `fields` (sample_id, origin, ...) go in too."""
    from ..types import REPLICATED

    on = sorted(pieces, key=lambda p: (str(table_ids[p.table]), p.col_offset, p.row_offset))
    first = {k: fields.pop(k) for k in ("sample_id",) if k in fields}  # the columns in sample_shards' order
    row = {**first, "table_ids": [str(table_ids[p.table]) for p in on], "num_devices": int(num_devices), **fields,
           "col_sizes": [-1 if p.col_size is None else int(p.col_size) for p in on],
           "row_offsets": [-1 if p.row_size is None else int(p.row_offset) for p in on],
           "row_sizes": [-1 if p.row_size is None else int(p.row_size) for p in on]}
    if any(p.kind == REPLICATED for p in on):
        row["replicas"] = [int(p.kind == REPLICATED) for p in on]
    return row


def piece_key(row) -> tuple:
    """What a shard measures, order-free: (table id, col_size, row_offset, row_size) per entry (-1: whole)."""
    n = len(row["table_ids"])

    def get(c):
        v = row.get(c) if hasattr(row, "get") else None
        return [-1] * n if v is None or isinstance(v, float) else [int(x) for x in v]

    keys = zip(map(str, row["table_ids"]), get("col_sizes"), get("row_offsets"), get("row_sizes"))
    reps = [max(r, 0) for r in get("replicas")]
    if any(reps):  # a replica is another shard than its whole table (keys without replicas stay as they were)
        return tuple(sorted((*k, r) for k, r in zip(keys, reps)))
    return tuple(sorted(keys))


def placement_shards(placements_df: pd.DataFrame, num_devices: int | Mapping[str, int] | None = None) -> pd.DataFrame:
    """Every non-empty device shard of the placements in `placements_df` (placements contract).

    `num_devices`: one count for all tasks, a {task_id: count} map, or None to use max(device)+1 per task.
    Column-wise slices (col_size set) are kept in `col_sizes`, row ranges (row_size set) in `row_offsets` and
    `row_sizes` (-1 = whole), replicas in `replicas` (1 on every device's row).
    """
    df = schemas.validate(placements_df, "placements", "<placements>")
    has_cols = "col_size" in df.columns and df["col_size"].notna().any()
    has_rows = "row_size" in df.columns and df["row_size"].notna().any()
    has_reps = "kind" in df.columns and (df["kind"] == "replicated").any()
    rows = []
    for (task, planner), g in df.groupby(["task_id", "planner"], sort=True):
        if num_devices is None:
            nd = int(g["device"].max()) + 1
        elif isinstance(num_devices, Mapping):
            if task not in num_devices:
                raise EmbshardError(f"no device count for task {task!r}", field="num_devices",
                                    fix="give --tasks with every task of the placements, or --num-devices")
            nd = int(num_devices[task])
        else:
            nd = int(num_devices)
        if int(g["device"].max()) >= nd:
            raise EmbshardError(f"task {task!r} uses device {int(g['device'].max())} of only {nd}",
                                field="device", fix="check num_devices for this task")
        for dev, gd in g.groupby("device", sort=True):
            row = {"sample_id": f"placement-{planner}-{task}-d{int(dev)}",
                   "table_ids": [str(t) for t in gd["table_id"]], "num_devices": nd,
                   "origin": f"placement:{planner}"}
            if has_cols:
                row["col_sizes"] = [-1 if pd.isna(c) else int(c) for c in gd["col_size"]]
            if has_rows:
                sizes = [-1 if pd.isna(z) else int(z) for z in gd["row_size"]]
                offs = gd["row_offset"] if "row_offset" in gd.columns else [0] * len(sizes)
                row["row_sizes"] = sizes
                row["row_offsets"] = [-1 if z < 0 else (0 if pd.isna(o) else int(o)) for o, z in zip(offs, sizes)]
            if has_reps:
                row["replicas"] = [int(k == "replicated") for k in gd["kind"]]
            rows.append(row)
    return schemas.validate(pd.DataFrame(rows), "shards", "<placement shards>")


def piece_lists(shard_df: pd.DataFrame, i: int) -> tuple[list | None, list | None]:
    """(col_sizes, row_ranges) of shard row i as bench.runner.measure_shard takes them: None entries (from
    -1) are whole; None lists when the frame has no such column."""
    row = shard_df.iloc[i]
    cols = row["col_sizes"] if "col_sizes" in shard_df.columns else None
    offs = row["row_offsets"] if "row_offsets" in shard_df.columns else None
    sizes = row["row_sizes"] if "row_sizes" in shard_df.columns else None
    col_list = None if cols is None else [None if int(c) < 0 else int(c) for c in cols]
    ranges = None
    if sizes is not None:
        offs = offs if offs is not None else [-1] * len(sizes)
        ranges = [None if int(z) < 0 else (max(int(o), 0), int(z)) for o, z in zip(offs, sizes)]
        if all(r is None for r in ranges):
            ranges = None
    return col_list, ranges


def replica_list(shard_df: pd.DataFrame, i: int) -> list[int] | None:
    """`replicas` of shard row i as bench.runner.measure_shard takes them (num_devices for a replica, else 0),
    None when it holds none."""
    if "replicas" not in shard_df.columns:
        return None
    row = shard_df.iloc[i]
    v = row["replicas"]
    if v is None or isinstance(v, float) or not any(int(x) == 1 for x in v):
        return None
    return [int(row["num_devices"]) if int(x) == 1 else 0 for x in v]


def check_pieces(tables, members: list, pieces: list, shard_df: pd.DataFrame, where: str) -> None:
    """Every piece fits its table: a column width <= dim, a row range inside 0..rows. Errors name `where`
    (the shards file) and the field."""
    for i, (m, (cols, ranges)) in enumerate(zip(members, pieces)):
        sid = str(shard_df.iloc[i]["sample_id"])
        for k, t in enumerate(m):
            tid, dim, rows = str(tables.table_ids[t]), int(tables.dims[t]), int(tables.rows[t])
            if cols is not None and cols[k] is not None and cols[k] > dim:
                raise EmbshardError(f"column width {cols[k]} of table {tid} (dim {dim}) in shard {sid}",
                                    path=where, field="col_sizes",
                                    fix="give widths <= the table's dim, or -1 for the whole width")
            if ranges is not None and ranges[k] is not None and sum(ranges[k]) > rows:
                o, z = ranges[k]
                raise EmbshardError(f"row range [{o}, {o + z}) outside table {tid} of {rows} rows in shard {sid}",
                                    path=where, field="row_offsets",
                                    fix="give ranges inside 0..rows, or -1 for all rows")


def _known(ids, table_ids: Sequence[str], where: str) -> None:
    """Ids of a tasks or placements file that the tables file lacks: blamed on that file, not on the shards."""
    known = set(map(str, table_ids))
    missing = sorted({str(t) for t in ids} - known)
    if missing:
        raise EmbshardError(f"{len(missing)} table ids are not in the tables file, e.g. {missing[:3]}", path=where,
                            field="table_ids", fix="give the tables file these were made from, or re-run that stage")


def load_shards(spec, *, table_ids: Sequence[str], tasks: str | None = None, placements: str | None = None,
                num_devices: int = 4, seed: int = 0, max_tables: int = 15) -> pd.DataFrame:
    """The shard list of a bench run.

    spec: None, "random:N" (N random shards from the train pool: the train tasks' tables of `tasks`, else all
    tables), a path to a shards Parquet file, a shards DataFrame, or a list of table-id lists.
    `placements` (a placements Parquet path) adds every device shard of those placements.
    """
    frames = []
    if isinstance(spec, pd.DataFrame):
        frames.append(schemas.validate(spec, "shards", "<shards>"))
    elif isinstance(spec, str) and spec.startswith("random:"):
        try:
            n = int(spec.split(":", 1)[1])
        except ValueError:
            raise EmbshardError(f"bad shard spec {spec!r}", field="shards",
                                fix="write random:N, e.g. random:200") from None
        pool = list(table_ids)
        if tasks is not None:
            t = schemas.read(tasks, "tasks")
            train = t[t["split"] == "train"]
            if len(train) == 0:
                raise EmbshardError("no train tasks", path=tasks, field="split", fix="give tasks with a train split")
            pool = sorted({x for ids in train["table_ids"] for x in ids})
            _known(pool, table_ids, tasks)
        frames.append(random_shards(pool, n, max_tables=max_tables, seed=seed, num_devices=num_devices))
    elif isinstance(spec, str):
        frames.append(schemas.read(spec, "shards"))
    elif spec is not None:
        lists = [[str(t) for t in s] for s in spec]
        frames.append(schemas.validate(pd.DataFrame({
            "sample_id": [f"shard-{i:06d}" for i in range(len(lists))], "table_ids": lists,
            "num_devices": num_devices, "origin": "given"}), "shards", "<shards>"))
    if placements is not None:
        nd: int | Mapping[str, int] | None = None
        if tasks is not None:
            t = schemas.read(tasks, "tasks")
            nd = dict(zip(t["task_id"], t["num_devices"].astype(int)))
        pdf = schemas.read(placements, "placements")
        _known(pdf["table_id"], table_ids, placements)
        frames.append(placement_shards(pdf, nd))
    if not frames:
        raise EmbshardError("no shards to measure", field="shards",
                            fix="give --shards (a file or random:N) and/or --placements")
    out = pd.concat(frames, ignore_index=True)
    for col in schemas.PIECE_COLUMNS:
        if col in out.columns:
            out[col] = out[col].map(lambda v: None if v is None or (isinstance(v, float) and math.isnan(v))
                                    else list(v))
    return schemas.validate(out, "shards", "<shards>")
