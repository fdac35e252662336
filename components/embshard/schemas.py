"""The Parquet data contracts (docs/contracts.md), checked on every read and write.

One module owns the columns of tables, tasks, costs, placements and evaluation files. `read(path, kind)` and
`write(df, path, kind)` validate types and value ranges and raise EmbshardError naming the file, the column
and the fix; `write` is atomic.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from . import checks, storage
from .errors import EmbshardError, StoreUnreachableError, first_line

NUM_BINS = 17
BIN_COLUMNS = [f"bin_{k:02d}" for k in range(NUM_BINS)]
# Version of the feature definition (features.py); models are tagged with it.
FEATURE_VERSION = "v2-21+ws"  # v2: the model derives working-set inputs (batch, cache)
# The tasks contract's file in a run folder (written by jobs.tasks; jobs.ingest removes a stale one).
TASKS_FILE = "tasks.parquet"


@dataclass(frozen=True)
class Column:
    name: str
    type: pa.DataType
    required: bool = True
    nullable: bool = False
    check: Callable[[pd.Series], pd.Series] | None = None  # True where a value is valid
    rule: str = ""  # what a valid value is, for the error message


def _positive(s: pd.Series) -> pd.Series:
    return s > 0


def _non_negative(s: pd.Series) -> pd.Series:
    return s >= 0


def _device_count(s: pd.Series) -> pd.Series:
    return (s > 0) & (s <= checks.MAX_DEVICES)


DEVICE_RULE = f"an integer from 1 to {checks.MAX_DEVICES:,}"


# A piece of a table on one device (docs/contracts.md, "Shard kinds"); embshard.types re-exports them.
WHOLE, COLUMN, ROW, REPLICATED = "whole", "column", "row", "replicated"
SHARD_KINDS = (WHOLE, COLUMN, ROW, REPLICATED)


def _shard_kind(s: pd.Series) -> pd.Series:
    return s.isin(["", *SHARD_KINDS])


def _finite_non_negative(s: pd.Series) -> pd.Series:
    return np.isfinite(s.astype("float64")) & (s >= 0)


MEMORY_RULE = f"an integer of bytes > 0 and at most {int(checks.MAX_MEMORY_GB * checks.GiB):,} (1 PiB)"


def _memory_bytes(s: pd.Series) -> pd.Series:
    """Memory per device in bytes: > 0 and at most 1 PiB, as --memory-gb (2^62 had planned, then failed writing
    plan.json)."""
    return (s > 0) & (s <= int(checks.MAX_MEMORY_GB * checks.GiB))


def _non_empty_str(s: pd.Series) -> pd.Series:
    return s.astype(str).str.len() > 0


def _non_empty_list(s: pd.Series) -> pd.Series:
    return s.map(lambda v: v is not None and len(v) > 0)


def _valid_id(s: pd.Series) -> pd.Series:
    return ~s.map(checks.bad_id).astype(bool)


def _id_list(s: pd.Series) -> pd.Series:
    """Non-empty lists of valid, distinct ids (a table listed twice would be placed twice)."""
    return s.map(lambda v: v is not None and len(v) > 0 and len(set(v)) == len(v)
                 and not any(checks.bad_id(x) for x in v))


def _dim(s: pd.Series) -> pd.Series:
    return (s > 0) & (s <= checks.MAX_DIM) & (s % checks.DIM_MULTIPLE == 0)


def _pooling(s: pd.Series) -> pd.Series:
    return _finite_non_negative(s) & (s <= checks.MAX_POOLING_FACTOR)


_STR = pa.string()
_F64 = pa.float64()

SCHEMAS: dict[str, list[Column]] = {
    "tables": [
        Column("table_id", _STR, check=_valid_id, rule=f"a unique id of {checks.ID_RULE}"),
        Column("rows", pa.int64(), check=_positive, rule="an integer > 0"),
        Column("dim", pa.int32(), check=_dim, rule=f"{checks.DIM_RULE} (FBGEMM's kernels need multiples of 4)"),
        Column("pooling_factor", _F64, check=_pooling,
               rule=f"a finite number from 0 to {checks.MAX_POOLING_FACTOR:,.0f}"),
        # 4 = fp32, 2 = fp16: the precisions the benchmark measures in (bench.backends) and TorchRec trains.
        Column("bytes_per_element", pa.int32(), check=lambda s: s.isin([2, 4]),
               rule="4 (fp32) or 2 (fp16); other weight types are not supported"),
        Column("size_bytes", pa.int64(), check=lambda s: (s > 0) & (s < checks.MAX_TABLE_BYTES),
               rule="rows * dim * bytes_per_element, > 0 and < 2^62"),
        *[Column(c, _F64, check=_finite_non_negative, rule="a fraction in [0, 1]") for c in BIN_COLUMNS],
        Column("source", _STR),
        Column("trace_file", _STR, required=False, nullable=True),
        Column("trace_table_index", pa.int64(), required=False, nullable=True),
        # Ingested from several files of one trace (ingest.dlrm.trace_files): the mean bag length of trace_file's
        # own table, which the benchmark replays and checks (pooling_factor is all the files').
        Column("trace_pooling_factor", _F64, required=False, nullable=True, check=_pooling,
               rule=f"a finite number from 0 to {checks.MAX_POOLING_FACTOR:,.0f}"),
        # embshard.pools: decided once at ingest; files without it get the same seeded rule on read.
        Column("pool", _STR, required=False, check=lambda s: s.isin(["train", "test"]), rule="'train' or 'test'"),
    ],
    "tasks": [
        Column("task_id", _STR, check=_valid_id, rule=f"a unique id of {checks.ID_RULE}"),
        Column("split", _STR, check=lambda s: s.isin(["train", "test"]), rule="'train' or 'test'"),
        Column("num_devices", pa.int32(), check=_device_count, rule=DEVICE_RULE),
        Column("memory_bytes_per_device", pa.int64(), check=_memory_bytes, rule=MEMORY_RULE),
        Column("table_ids", pa.list_(_STR), check=_id_list,
               rule="a non-empty list of valid table ids, each listed once"),
        # Hosts of that many devices in TorchRec's rank order (table-row-wise cuts stay within one); null or
        # absent: all devices on one host. Dividing num_devices is checked where a task is read (types.load_tasks).
        Column("devices_per_host", pa.int32(), required=False, nullable=True, check=_positive,
               rule="an integer > 0 that divides num_devices, or null for one host"),
    ],
    "costs": [
        Column("sample_id", _STR, check=_non_empty_str, rule="a non-empty id"),
        Column("table_ids", pa.list_(_STR), check=_non_empty_list, rule="a non-empty list of table ids"),
        Column("fwd_compute_ms", _F64, check=_finite_non_negative, rule="a finite number >= 0"),
        Column("bwd_compute_ms", _F64, check=_finite_non_negative, rule="a finite number >= 0"),
        Column("fwd_comm_ms", _F64, check=_finite_non_negative, rule="a finite number >= 0"),
        Column("bwd_comm_ms", _F64, check=_finite_non_negative, rule="a finite number >= 0"),
        Column("hardware", _STR),
        Column("backend", _STR, check=lambda s: s.isin(["fbgemm", "torch"]), rule="'fbgemm' or 'torch'"),
        Column("batch_size", pa.int32(), check=_positive, rule="an integer > 0"),
        Column("iterations", pa.int32(), check=_positive, rule="an integer > 0"),
        Column("measured_at", pa.timestamp("us", tz="UTC")),
        # Extras beyond the minimal contract: how the row was made, so results stay interpretable.
        Column("num_devices", pa.int32(), required=False, check=_device_count, rule=DEVICE_RULE),
        Column("comm_source", _STR, required=False, nullable=True),  # 'measured' | 'model'
        Column("row_scale", _F64, required=False, nullable=True),    # rows scaled to fit memory (1.0 = none)
        Column("cache_bytes", pa.int64(), required=False, nullable=True),  # last-level cache of the hardware
        Column("spread", _F64, required=False, nullable=True),       # IQR / median of compute timings
        Column("origin", _STR, required=False, nullable=True),       # 'random' | 'placement:<planner>' | ...
        Column("chunk", pa.int32(), required=False, nullable=True),
        # The pieces measured (docs/contracts.md, "Shard kinds"), copied from the shard list: -1 = whole.
        Column("col_sizes", pa.list_(pa.int32()), required=False, nullable=True),
        Column("row_offsets", pa.list_(pa.int64()), required=False, nullable=True),
        Column("row_sizes", pa.list_(pa.int64()), required=False, nullable=True),
        Column("replicas", pa.list_(pa.int32()), required=False, nullable=True),  # 1 = a replica (-1/0: not)
        # A replica's communication (bench.comm): the all-reduces of its gradients (in bwd_comm_ms), and what its
        # outputs would have added to the fwd + bwd all-to-all as a whole table (costmodel.data's comm target).
        Column("allreduce_ms", _F64, required=False, nullable=True),
        Column("replica_a2a_ms", _F64, required=False, nullable=True),
    ],
    # Device shards to measure (bench): one row per shard, the tables one device holds.
    "shards": [
        Column("sample_id", _STR, check=_non_empty_str, rule="a non-empty, unique id"),
        Column("table_ids", pa.list_(_STR), check=_non_empty_list, rule="a non-empty list of table ids"),
        Column("num_devices", pa.int32(), check=_device_count, rule=DEVICE_RULE),
        Column("origin", _STR),
        # Optional pieces, parallel to table_ids (docs/contracts.md, "Shard kinds"): col_sizes[i] is the width
        # measured for table_ids[i] (-1 = whole width); rows [row_offsets[i], row_offsets[i] + row_sizes[i])
        # its row range (-1 = all rows); replicas[i] 1 when table_ids[i] is a replica over num_devices devices.
        Column("col_sizes", pa.list_(pa.int32()), required=False, nullable=True),
        Column("row_offsets", pa.list_(pa.int64()), required=False, nullable=True),
        Column("row_sizes", pa.list_(pa.int64()), required=False, nullable=True),
        Column("replicas", pa.list_(pa.int32()), required=False, nullable=True),
    ],
    "placements": [
        Column("task_id", _STR, check=_valid_id, rule=f"an id of {checks.ID_RULE}"),
        Column("table_id", _STR, check=_valid_id, rule=f"a table id of {checks.ID_RULE}"),
        Column("device", pa.int32(), check=_non_negative, rule="an integer >= 0"),
        Column("col_offset", pa.int32(), required=False, nullable=True),
        Column("col_size", pa.int32(), required=False, nullable=True),
        # Shard kinds (docs/contracts.md): 'whole' | 'column' | 'row' | 'replicated'; a row piece's row range.
        Column("kind", _STR, required=False, nullable=True, check=_shard_kind,
               rule=f"one of {', '.join(SHARD_KINDS)} (empty: whole)"),
        Column("row_offset", pa.int64(), required=False, nullable=True),
        Column("row_size", pa.int64(), required=False, nullable=True),
        Column("planner", _STR),
        Column("model_uri", _STR, required=False, nullable=True),
        # cost of this row's device, predicted and measured (a negative or infinite one had reached plan.json's
        # schema check, which named the plan.json being written, not this file)
        Column("predicted_cost_ms", _F64, required=False, nullable=True, check=_finite_non_negative,
               rule="a finite number of ms >= 0"),
        Column("measured_cost_ms", _F64, required=False, nullable=True, check=_finite_non_negative,
               rule="a finite number of ms >= 0"),
        # The devices the plan is for (the same on every row of a task), so that `export` keeps them without a
        # tasks file; files written before these columns have none (then --tasks, or they are inferred).
        Column("num_devices", pa.int32(), required=False, nullable=True),
        Column("memory_bytes_per_device", pa.int64(), required=False, nullable=True, check=_memory_bytes,
               rule=MEMORY_RULE),
        Column("devices_per_host", pa.int32(), required=False, nullable=True),
        # What plan.json says of the whole plan, the same on every row of a task (export.placements.plan_frame):
        # the balanced estimate it is quoted against, and the planner's meta as a JSON object.
        Column("balanced_estimate_ms", _F64, required=False, nullable=True, check=_finite_non_negative,
               rule="a finite number of ms >= 0"),
        Column("plan_meta", _STR, required=False, nullable=True),
        # The table as it was planned (TableSet.content_hashes): an export refuses a plan whose table changed since.
        Column("table_sha256", _STR, required=False, nullable=True),
    ],
}


def arrow_schema(kind: str, df_columns: list[str] | None = None) -> pa.Schema:
    """The Arrow schema of `kind`, restricted to the optional columns present in `df_columns`."""
    cols = SCHEMAS[kind]
    present = set(df_columns) if df_columns is not None else None
    fields = [pa.field(c.name, c.type, nullable=c.nullable or not c.required)
              for c in cols if c.required or present is None or c.name in present]
    return pa.schema(fields)


def validate(df: pd.DataFrame, kind: str, path: str | os.PathLike = "<data>") -> pd.DataFrame:
    """Check columns, types and value ranges; return the frame with contract columns first."""
    where = os.fspath(path)
    if df is None or len(df) == 0:
        raise EmbshardError(f"no rows in this {kind} file", path=where,
                            fix=f"give a {kind} file with at least one row")
    cols = SCHEMAS[kind]
    out = df.copy()
    for c in cols:
        if c.name not in out.columns:
            if c.required:
                raise EmbshardError("missing column", path=where, field=c.name,
                                    fix=f"add column '{c.name}' ({c.rule or c.type})")
            continue
        s = out[c.name]
        if not c.nullable and s.isna().any() and not pa.types.is_list(c.type):
            bad = s[s.isna()].index[0]
            raise EmbshardError(f"empty/NaN value in {_row(df, bad, kind)}", path=where, field=c.name,
                                fix=f"every value must be {c.rule or c.type}")
        if pa.types.is_list(c.type):  # a text ('user,item') would be coerced to a list of its letters
            text = s[s.map(lambda v: isinstance(v, str))]
            if len(text):
                raise EmbshardError(f"text {_show(text.iloc[0])} in {_row(df, text.index[0], kind)}, not a list",
                                    path=where, field=c.name, fix=f"write {c.name} as a list column (e.g. "
                                    f"df['{c.name}'] = [['a', 'b'], ...]), not as one string")
        try:
            out[c.name] = _coerce(s, c.type)
        except (ValueError, TypeError, pa.ArrowInvalid, pa.ArrowTypeError) as exc:
            raise EmbshardError(f"wrong type ({first_line(exc, 80)})", path=where,
                                field=c.name, fix=f"values must be {c.rule or c.type}") from None
        if c.check is not None:
            nonnull = out[c.name].dropna() if c.nullable or not c.required else out[c.name]
            ok = c.check(nonnull)
            if not bool(np.all(ok)):
                bad_idx = nonnull.index[~np.asarray(ok, dtype=bool)][0]
                raise EmbshardError(f"invalid value {_show(nonnull.loc[bad_idx])} in {_row(df, bad_idx, kind)}",
                                    path=where, field=c.name, fix=f"every value must be {c.rule}")
    key = ROW_KEYS.get(kind)
    if key is not None and out[key].duplicated().any():
        dup = out.loc[out[key].duplicated(), key].iloc[0]
        raise EmbshardError(f"duplicate value {_show(dup)}", path=where, field=key,
                            fix=f"make every '{key}' unique")
    if kind == "tables":
        _check_tables(out, where)
    if kind in ("shards", "costs"):
        _check_pieces(out, where)
    names = [c.name for c in cols if c.name in out.columns]
    extra = [c for c in out.columns if c not in names]
    return out[names + extra].reset_index(drop=True)


ROW_KEYS = {"tables": "table_id", "tasks": "task_id", "costs": "sample_id", "shards": "sample_id"}


def _row(df: pd.DataFrame, i, kind: str) -> str:
    """'row i', with the row's id when the frame has its kind's id column ('row 1 (table_id 't0001')'): a row
    number alone is hard to find in a frame a program wrote (a trace's tables are numbered by nothing the user
    sees)."""
    key = ROW_KEYS.get(kind)
    value = df[key].get(i) if key is not None and key in df.columns else None
    return f"row {i}" + (f" ({key} {_show(value)})" if isinstance(value, str) and value else "")


def _show(value) -> str:
    """A value for a message: numbers plainly (never np.float64(...)), text quoted, lists short."""
    if isinstance(value, (list, tuple, np.ndarray)):
        return "[" + ", ".join(_show(v) for v in list(value)[:5]) + (", ...]" if len(value) > 5 else "]")
    if isinstance(value, (str, bytes)):
        return repr(str(value)[:60])
    return checks.number(value)


def _check_tables(df: pd.DataFrame, where: str) -> None:
    # In floats first: the int64 product wraps around for absurd rows and could then match a wrong size_bytes.
    approx = df["rows"].astype(float) * df["dim"].astype(float) * df["bytes_per_element"].astype(float)
    if (approx >= checks.MAX_TABLE_BYTES).any():
        i = approx[approx >= checks.MAX_TABLE_BYTES].index[0]
        raise EmbshardError(f"rows*dim*bytes_per_element is {approx.loc[i]:.3g} bytes in {_row(df, i, 'tables')}, "
                            "over 2^62", path=where, field="rows",
                            fix="give hash-table sizes (rows), or re-ingest the tables")
    expected = df["rows"].astype("int64") * df["dim"].astype("int64") * df["bytes_per_element"].astype("int64")
    bad = expected != df["size_bytes"]
    if bad.any():
        i = bad[bad].index[0]
        raise EmbshardError(f"size_bytes {df.loc[i, 'size_bytes']} != rows*dim*bytes_per_element "
                            f"{expected.loc[i]} in {_row(df, i, 'tables')}", path=where, field="size_bytes",
                            fix="recompute size_bytes or re-ingest the tables")
    sums = df[BIN_COLUMNS].sum(axis=1)
    off = (sums - 1.0).abs() > 1e-3
    if off.any():
        i = off[off].index[0]
        raise EmbshardError(f"access bins sum to {sums.loc[i]:.4f}, not 1, in {_row(df, i, 'tables')}", path=where,
                            field="bin_00..bin_16", fix="bins are fractions of unique indices and must sum to 1")


PIECE_COLUMNS = ("col_sizes", "row_offsets", "row_sizes", "replicas")


def _check_pieces(df: pd.DataFrame, where: str) -> None:
    """The optional piece lists of shards/costs rows: parallel to table_ids; col_sizes -1 or a positive
    multiple of 4; row_offsets -1 or >= 0 and row_sizes -1 or > 0, both given or both -1. (Whether a range or
    width fits its table is checked where the tables are known: bench.sampler.piece_lists.)"""
    present = [c for c in PIECE_COLUMNS if c in df.columns]
    for i in range(len(df)):
        n = len(df["table_ids"].iloc[i])
        got = {c: df[c].iloc[i] for c in present}
        for c, v in got.items():
            if v is not None and len(v) != n:
                raise EmbshardError(f"{len(v)} entries for {n} tables in row {i}", path=where, field=c,
                                    fix=f"give one {c} entry per table id (-1 = whole)")
        for c_ in (got.get("col_sizes") or []):
            if c_ != -1 and (c_ <= 0 or c_ % checks.DIM_MULTIPLE):
                raise EmbshardError(f"column width {c_} in row {i}", path=where, field="col_sizes",
                                    fix=f"use -1 (whole width) or a positive multiple of {checks.DIM_MULTIPLE}")
        offs, sizes = got.get("row_offsets"), got.get("row_sizes")
        for k in range(n):
            o = -1 if offs is None else int(offs[k])
            z = -1 if sizes is None else int(sizes[k])
            if z != -1 and z <= 0:
                raise EmbshardError(f"row range size {z} in row {i}", path=where, field="row_sizes",
                                    fix="use -1 (all rows) or a size > 0")
            if o < -1 or (o == -1) != (z == -1):
                raise EmbshardError(f"row range offset {o} with size {z} in row {i}", path=where,
                                    field="row_offsets", fix="give an offset >= 0 with every size > 0, -1 with -1")
            r = -1 if got.get("replicas") is None else int(got["replicas"][k])
            c_k = -1 if got.get("col_sizes") is None else int(got["col_sizes"][k])
            if r not in (-1, 0, 1) or (r == 1 and (z != -1 or c_k != -1)):
                raise EmbshardError(f"replica flag {r} (column {c_k}, rows {z}) in row {i}", path=where,
                                    field="replicas", fix="use 1 for a replica of the whole table, else 0 or -1")


def _coerce(s: pd.Series, typ: pa.DataType) -> pd.Series:
    if pa.types.is_list(typ):
        conv = str if pa.types.is_string(typ.value_type) else int  # list<int32> (shards.col_sizes)
        return s.map(lambda v: None if v is None or (isinstance(v, float) and np.isnan(v))
                     else [conv(x) for x in v])
    if pa.types.is_timestamp(typ):
        return pd.to_datetime(s, utc=True)
    if pa.types.is_string(typ):
        return s.map(lambda v: None if v is None or (isinstance(v, float) and np.isnan(v)) else str(v)).astype(object)
    if pa.types.is_integer(typ):
        if s.dtype.kind == "b":  # True would count as 1 (a CSV's 'true')
            raise TypeError("boolean, not a number")
        if s.isna().any():
            return s.astype("Int64")
        if s.dtype.kind == "f" and (not np.all(np.isfinite(s)) or not np.all(s == np.round(s))):
            raise ValueError("not an integer")
        if s.dtype.kind in "OUS" or str(s.dtype).startswith("string"):
            s = pd.to_numeric(s)  # raises ValueError on text
            if s.dtype.kind == "f" and not np.all(s == np.round(s)):
                raise ValueError("not an integer")
        return s.astype("int64")
    if pa.types.is_floating(typ):
        if s.dtype.kind in "OUS" or str(s.dtype).startswith("string"):
            return pd.to_numeric(s).astype("float64")
        if s.dtype.kind == "b":
            raise TypeError("boolean, not a number")
        return s.astype("float64")
    return s


def to_arrow(df: pd.DataFrame, kind: str) -> pa.Table:
    schema = arrow_schema(kind, list(df.columns))
    extra = [c for c in df.columns if c not in schema.names]
    table = pa.Table.from_pandas(df[schema.names], schema=schema, preserve_index=False)
    for c in extra:  # extra columns travel along, with inferred types
        table = table.append_column(c, pa.array(df[c].tolist()))
    return table


def write(df: pd.DataFrame, path: str | os.PathLike, kind: str) -> pd.DataFrame:
    """Validate and atomically write a contract file. Returns the validated frame."""
    checked = validate(df, kind, path)
    table = to_arrow(checked, kind)
    with storage.atomic_write(path) as f:
        pq.write_table(table, f)
    return checked


def read(path: str | os.PathLike, kind: str) -> pd.DataFrame:
    """Read and validate a contract file; a folder reads all its part-*.parquet files (costs)."""
    where = os.fspath(path)
    fs, p = storage.resolve_input(where)
    try:
        info = fs.get_file_info(p)
    except OSError as exc:  # a bucket that does not answer, no credentials: not a traceback (and worth a retry)
        raise StoreUnreachableError(f"cannot reach it ({first_line(exc, 140)})", path=where,
                                    fix="check the bucket, the credentials (AWS_*) and the endpoint, or give a local "
                                        "file") from None
    if info.type == pafs.FileType.NotFound:
        raise EmbshardError("file not found", path=where, fix=f"check the path, or run the stage that writes {kind}")
    if info.type == pafs.FileType.Directory and kind != "costs":
        raise EmbshardError("is a folder, not a file", path=where,
                            fix=f"give the {kind} Parquet file itself (e.g. {os.path.join(where, kind + '.parquet')})")
    if info.type == pafs.FileType.Directory:
        parts = storage.list_files(where, ".parquet")
        if not parts:
            raise EmbshardError("no .parquet files in this folder", path=where,
                                fix=f"run the stage that writes {kind} first")
        frames = [_read_one(part) for part in parts]
        required = [c.name for c in SCHEMAS[kind] if c.required]
        for part, frame in zip(parts, frames):  # a part without a column: name the part, not the folder
            missing = [c for c in required if c not in frame.columns]
            if missing:
                raise EmbshardError("missing column", path=part, field=missing[0],
                                    fix="re-run the stage that writes it (its chunk is measured again)")
        df = pd.concat(frames, ignore_index=True)
    else:
        checks.input_file(where, fix=f"give the {kind} Parquet file")  # a FIFO would block; permission denied
        if kind == "tables" and os.path.splitext(where)[1].lower() in SPEC_SUFFIXES:
            raise _spec_not_tables(where)
        df = _read_one(where, kind)
    if kind == "tables" and spec_columns(df.columns):
        raise _spec_not_tables(where)
    return validate(df, kind, where)


def unreadable(path: str | os.PathLike, kind: str) -> str | None:
    """Why a contract file cannot be read as `kind` (corrupt, truncated, a column missing, bad values), or None
    when it reads: a stage resuming its own earlier output checks it before trusting it."""
    try:
        read(path, kind)
    except StoreUnreachableError:
        raise  # the store, not the file: a finished chunk is not measured again for a network blip
    except EmbshardError as exc:
        return str(exc)
    return None


# a tables contract is Parquet: files named so can only be table specs
SPEC_SUFFIXES = (".csv", ".tsv", ".yaml", ".yml")


def spec_columns(names) -> bool:
    """Whether a frame's columns are a table spec's (TorchRec's names: ingest.spec) rather than the tables
    contract's."""
    names = set(names)
    return "num_embeddings" in names and "table_id" not in names


def _spec_not_tables(where: str) -> EmbshardError:
    """A table spec (TorchRec's names, CSV/YAML/Parquet) given where a tables.parquet is read."""
    return EmbshardError("a table spec, not a tables file", path=where,
                         fix=f"ingest it first: embshard ingest --source spec --input {where} --out DIR, then give "
                             "DIR/tables.parquet (embshard place, predict and export read a spec directly)")


def _read_one(where: str, kind: str = "") -> pd.DataFrame:
    fs, p = storage.resolve(where)
    try:
        with fs.open_input_file(p) as f:
            return pq.read_table(f).to_pandas()
    except PermissionError as exc:
        raise EmbshardError(f"permission denied ({exc.strerror or exc})", path=where,
                            fix="make it readable (chmod u+r) or run as a user who may read it") from None
    except (pa.ArrowInvalid, OSError) as exc:
        if "magic bytes not found" in str(exc) and str(where).lower().endswith((".pt", ".pt.gz")):
            raise EmbshardError("a DLRM trace, not a Parquet file", path=where,
                                fix=f"ingest it first: embshard ingest --source dlrm --input {where} --out DIR, then "
                                    "give DIR/tables.parquet") from None
        if "magic bytes not found" in str(exc) and kind == "tables" and not str(where).lower().endswith(
                (".parquet", ".pq")):
            # e.g. a spec named .txt, .json or .csv.gz: spec files are told apart from Parquet by their name
            raise EmbshardError("not a Parquet file", path=where,
                                fix="give a tables.parquet, or a table spec named *.csv, *.tsv, *.yaml or *.yml "
                                    "(or Parquet with TorchRec's column names)") from None
        if "magic bytes not found" in str(exc):  # a .parquet that is not Parquet at all, or cut short
            raise EmbshardError("not a Parquet file (no Parquet footer at its end)", path=where,
                                fix="give the Parquet file (a JSON, CSV or text file is not one); if it is one, it "
                                    "was cut short: re-run the stage that writes it") from None
        if "://" in str(where) and not str(where).startswith("file://") and not isinstance(exc, pa.ArrowInvalid):
            # a remote file that stopped answering mid-read: the store, not the file
            raise StoreUnreachableError(f"cannot read it ({first_line(exc, 140)})", path=where,
                                        fix="check the bucket, the credentials (AWS_*) and the endpoint") from None
        raise EmbshardError(f"not a readable Parquet file ({first_line(exc, 100)})", path=where,
                            fix="re-run the stage that writes it; the file is corrupt or truncated") from None
