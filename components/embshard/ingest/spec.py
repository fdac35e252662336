"""Table-spec files: a user's description of a real model's tables, without traces.

One row per table with TorchRec's names: `name`, `num_embeddings`, `embedding_dim`, `pooling_factor`, and
optionally `data_type` (fp32/fp16) and the access skew: `zipf_alpha`, or the 17 bins `bin_00`..`bin_16`.
CSV, Parquet or YAML (a list of mappings, or a mapping with a `tables:` list). In a CSV, lines starting with `#`
are comments (a `#` inside a value is part of the value). Every column must be one of the known names and appear
once, and no CSV row may have more values than the header: a typo (`zipf_alfa`, `dtype`) or a shifted row would
otherwise silently change precision or skew.

Skew per row: the bins if given, else the row's zipf_alpha, else DEFAULT_ZIPF_ALPHA. Bins from a zipf_alpha are
computed from a sampled batch of BINS_BATCH_SIZE samples, exactly as for synthetic tables; `source` records
which skew a row got (`spec:<file>;skew=bins|zipf-<a>|default-zipf-1.0`).
"""
from __future__ import annotations

import logging
import os

import numpy as np
import pandas as pd

from .. import checks, schemas
from ..errors import EmbshardError, first_line
from . import bins_cache
from .dlrm import DATA_TYPES

log = logging.getLogger(__name__)

# Default skew where a spec gives none: Zipf alpha 1.0, the classic "web" popularity law, between the
# near-uniform (0) and very skewed (1.4) ends of the synthetic population.
DEFAULT_ZIPF_ALPHA = 1.0
REQUIRED = ["name", "num_embeddings", "embedding_dim", "pooling_factor"]
KNOWN = [*REQUIRED, "data_type", "zipf_alpha", *schemas.BIN_COLUMNS]
_DTYPE_ALIASES = {"fp32": "fp32", "float32": "fp32", "float": "fp32", "datatype.fp32": "fp32",
                  "fp16": "fp16", "float16": "fp16", "half": "fp16", "datatype.fp16": "fp16"}
_FORMATS = ".csv (or .tsv), .parquet, .yaml or .yml"


def read_spec_file(path: str) -> pd.DataFrame:
    """The raw rows of a spec file; unreadable files and empty lists are errors naming the file."""
    path = os.fspath(path)
    if os.path.isdir(path.removeprefix("file://")):
        raise EmbshardError("is a folder, not a file", path=path, fix="give the spec file itself as --input")
    # file:// taken off (tables.parquet takes it too); an s3:// spec refused in one line; not found, a FIFO (would
    # hang), unreadable
    path = checks.local_input_file(path, fix="check the path of the table spec")
    ext = os.path.splitext(path)[1].lower()
    try:
        if ext in (".csv", ".tsv"):
            df = _read_csv(path)
        elif ext in (".parquet", ".pq"):
            import pyarrow.parquet as pq

            table = pq.read_table(path)
            written_nan = _parquet_nan_skew(table)  # NaN, unlike null, is a value written: pandas makes both NaN
            df = table.to_pandas()
            if written_nan is not None:
                col, i = written_nan
                raise EmbshardError(f"value NaN in row {i} ({_name(df, i)}) is not a number", path=path, field=col,
                                    fix=SKEW_NAN_FIX)
        elif ext in (".yaml", ".yml"):
            import yaml

            with open(path, encoding="utf-8") as f:
                doc = yaml.load(f, Loader=_unique_key_loader())  # a SafeLoader that refuses duplicate keys
            if isinstance(doc, dict):
                if doc and "tables" not in doc:  # e.g. a misspelt key: not "an empty table list"
                    raise EmbshardError(f"no 'tables' key (it has {', '.join(map(str, list(doc)[:3]))})", path=path,
                                        field="tables", fix="list the tables under 'tables:', one mapping each")
                extra = [str(k) for k in doc if k != "tables"]
                if extra:  # e.g. a `table_defaults: {data_type: fp16}` this reader would drop silently
                    raise EmbshardError(f"unknown key {extra[0]!r} beside 'tables'", path=path, field=extra[0],
                                        fix="give every value in each table's own mapping (only 'tables' is read)")
                doc = doc.get("tables")
            if doc is None:
                doc = []
            if not isinstance(doc, list) or not all(isinstance(r, dict) for r in doc):
                raise EmbshardError("expected a list of tables (mappings), or a mapping with a 'tables' list",
                                    path=path, field="tables", fix="write one mapping per table under 'tables:'")
            lines = _yaml_table_lines(path, len(doc))
            for i, r in enumerate(doc):  # a written .nan skew is a value; a missing key is the default
                for k in ("zipf_alpha", *schemas.BIN_COLUMNS):
                    v = r.get(k)
                    if isinstance(v, float) and v != v:
                        at = f"line {lines[i]}" if lines else f"table {i + 1} of the list"
                        raise EmbshardError(f"value .nan in {at} is not a number", path=path, field=k,
                                            fix=SKEW_NAN_FIX)
            for i, r in enumerate(doc):  # YAML reads yes/no, 012 (octal), 1_000, dates as other types
                if r.get("name") is not None and not isinstance(r["name"], str):
                    at = f"line {lines[i]}" if lines else f"table {i + 1} of the list"
                    raise EmbshardError(f"table name {r['name']!r} in {at} is not text (YAML read it as a "
                                        f"{type(r['name']).__name__})", path=path, field="name",
                                        fix="quote the name as written, e.g. name: '012'")
            df = pd.DataFrame(doc)
            df.attrs[LINES] = lines
        else:
            raise EmbshardError(f"unknown file type {ext or '(none)'!r}", path=path,
                                fix=f"give a {_FORMATS} file")
    except EmbshardError as exc:
        raise (exc if exc.path else exc.at(path)) from None
    except pd.errors.EmptyDataError:
        df = pd.DataFrame()
    except UnicodeDecodeError:  # e.g. Latin-1, or Excel's "Unicode text" (UTF-16)
        raise EmbshardError(f"is not UTF-8 text ({_first_bad_byte(path)}; UTF-16 or Latin-1?)", path=path,
                            field="encoding",
                            fix="save the file as UTF-8 (in Excel: 'CSV UTF-8'; iconv -f latin1 -t utf-8)") from None
    except Exception as exc:  # parser errors of three libraries: one line naming the file
        reason = first_line(exc)
        raise EmbshardError(f"cannot read this file ({reason})", path=path,
                            fix=f"give a valid {_FORMATS} file") from None
    df.columns = [str(c).strip() for c in df.columns]
    _check_columns(list(df.columns), path)
    if len(df) == 0:
        raise EmbshardError("the table list is empty", path=path, field="name",
                            fix="describe at least one table (one row per table)")
    return df


SKEW_NAN_FIX = "give a number, or leave the skew out (empty, null) for the default"


def _first_bad_byte(path: str) -> str:
    """Where a file stops being UTF-8, from its bytes (a text stream's error counts from its current chunk)."""
    with open(path, "rb") as f:
        raw = f.read()
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return f"byte {raw[exc.start:exc.start + 1]!r} at offset {exc.start:,}"
    return "a byte that is not UTF-8"


def _parquet_nan_skew(table) -> tuple[str, int] | None:
    """(column, row) of the first NaN written in a skew column of a Parquet spec (null is "not given"), or None."""
    import pyarrow as pa
    import pyarrow.compute as pc

    for col in ("zipf_alpha", *schemas.BIN_COLUMNS):
        if col in table.column_names and pa.types.is_floating(table.schema.field(col).type):
            nan = pc.fill_null(pc.is_nan(table.column(col)), False).to_numpy(zero_copy_only=False)
            if nan.any():
                return col, int(np.flatnonzero(nan)[0])
    return None


def _read_csv(path: str) -> pd.DataFrame:
    """A CSV spec: `#` starts a comment only at the start of a line; every row has at most the header's fields
    (empty trailing fields are allowed); a header that names a column twice is refused (pandas would rename the
    second to `name.1` and use the first silently)."""
    import csv
    import io

    with open(path, encoding="utf-8-sig", newline="") as f:  # -sig: a byte-order mark (Excel writes one) is dropped
        lines = [(n, line) for n, line in enumerate(f.read().splitlines(), start=1)
                 if line.strip() and not line.lstrip().startswith("#")]
    if not lines:
        return pd.DataFrame()
    # Commas, else tabs (a TSV, or a spreadsheet's copy), else semicolons (Excel's CSV in some locales; numbers
    # still take '.' as the decimal point)
    sep = next((d for d in (",", "\t", ";") if d in lines[0][1]), ",")
    header = [c.strip() for c in next(csv.reader([lines[0][1]], skipinitialspace=True, delimiter=sep))]
    while header and header[-1] == "":  # a trailing comma
        header.pop()
    _check_columns(header, path)
    for (n, _), fields in zip(lines[1:], csv.reader([line for _, line in lines[1:]], skipinitialspace=True,
                                                    delimiter=sep)):
        if len(fields) > len(header) and any(x.strip() for x in fields[len(header):]):
            raise EmbshardError(f"line {n} has {len(fields)} values but the header has {len(header)} columns "
                                f"({', '.join(header)})", path=path, field="columns",
                                fix="give one value per header column (quote a value that contains a comma)")
    text = "\n".join(line for _, line in lines)
    # Columns by position, named by the header as stripped above (`name , rows` reads as `name`, `rows`, as values
    # are read without spaces); index_col=False: a trailing comma on every row (Excel's empty column) is no index.
    read = dict(skipinitialspace=True, header=0, index_col=False, sep=sep)
    df = pd.read_csv(io.StringIO(text), usecols=range(len(header)), **read)
    df.columns = header
    # Read once more as written, the columns whose text matters: names (no number parsing of '007' or '1e3', no NA
    # words like 'NA' or 'nan'), and the skews (an empty cell is "the default skew"; a written 'nan' is a value,
    # refused as one).
    skews = [c for c in ("zipf_alpha", *schemas.BIN_COLUMNS) if c in header]
    written = [c for c in ("name", *skews) if c in header]
    if written:
        raw = pd.read_csv(io.StringIO(text), usecols=[header.index(c) for c in written], dtype=str,
                          keep_default_na=False, **read)
        raw.columns = [header[i] for i in sorted(header.index(c) for c in written)]  # pandas keeps file order
        if "name" in written:
            df["name"] = raw["name"]
        for col in skews:
            cell = raw[col].str.strip()
            df[col] = cell.where(cell != "", None)
    if len(df) == len(lines) - 1:  # one data row per kept line (a quoted value spanning lines has no simple line)
        df.attrs[LINES] = [n for n, _ in lines[1:]]
    return df


def _check_columns(columns: list[str], path: str) -> None:
    """Every column known and named once: a duplicate or an unknown name (a typo) is refused, naming the column,
    the closest known name and the known names."""
    import difflib

    seen: set[str] = set()
    for c in columns:
        if c in seen:
            raise EmbshardError("column given twice", path=path, field=c, fix=f"keep one '{c}' column")
        seen.add(c)
    for c in columns:
        if c not in KNOWN:
            close = difflib.get_close_matches(c, KNOWN, n=1, cutoff=0.6)
            hint = f"did you mean '{close[0]}'? " if close else ""
            raise EmbshardError("unknown column", path=path, field=c,
                                fix=f"{hint}rename or drop it; known columns: {', '.join(KNOWN[:6])}, "
                                    "bin_00..bin_16")


def _unique_key_loader():
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    def mapping(loader, node, deep=False):
        keys = set()
        for key_node, _ in node.value:
            key = loader.construct_object(key_node, deep=deep)
            if key in keys:
                raise EmbshardError("column given twice", field=str(key),
                                    fix=f"keep one '{key}' in line {key_node.start_mark.line + 1}'s table")
            keys.add(key)
        return loader.construct_mapping(node, deep=deep)

    Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
    return Loader


def _numbers(df: pd.DataFrame, col: str, path: str, integer: bool, required: bool = True) -> pd.Series:
    """A numeric column, or an error naming the first value that is not a number (or not an integer), or the first
    empty one of a `required` column (a short CSV row or a YAML table without the key reads as empty)."""
    s = df[col]
    if s.dtype == bool:
        raise EmbshardError("is boolean, not a number", path=path, field=col, fix="give numbers")
    if pd.api.types.is_datetime64_any_dtype(s) or pd.api.types.is_timedelta64_dtype(s):
        # a Parquet timestamp read as its count of milliseconds: pooling factors 1 and 2 had planned as 1000, 2000
        raise EmbshardError(f"is a {s.dtype} column (dates or durations), not numbers", path=path, field=col,
                            fix="write the column as numbers (int or float)")
    num = pd.to_numeric(s, errors="coerce")
    bad = num.isna() & s.notna()
    if bad.any():
        i = int(np.flatnonzero(bad.to_numpy())[0])
        raise EmbshardError(f"value {_show(s.iloc[i])} in {_at(df, i)} ({_name(df, i)}) is not a number", path=path,
                            field=col, fix="give a number" if not integer else "give an integer")
    if required:
        missing = num.isna()
        if missing.any():
            i = int(np.flatnonzero(missing.to_numpy())[0])
            raise EmbshardError(f"empty or NaN value in {_at(df, i)} ({_name(df, i)})", path=path, field=col,
                                fix=f"give {'an integer' if integer else 'a number'} for every table")
    if integer:
        frac = num != np.round(num)
        if frac.any():
            i = int(np.flatnonzero(frac.to_numpy())[0])
            raise EmbshardError(f"value {_show(s.iloc[i])} in {_at(df, i)} ({_name(df, i)}) is not an integer",
                                path=path, field=col, fix="give an integer")
    return num.astype("float64")


SAY_SAMPLING_FROM = 500     # tables sampled from which tables_from_spec says so (about 13 s and more)
SAMPLE_S_PER_TABLE = 0.026  # a spec table's access features take about this long to sample (2-core machine)
LINES = "embshard_lines"  # DataFrame.attrs key: the file line of each table of a CSV or YAML spec


def _at(df: pd.DataFrame, i: int) -> str:
    """Where table i is in its file, for a message: its line in a CSV or YAML spec (what an editor shows), else
    its row in a Parquet spec (counted from 0, as pandas and pyarrow count)."""
    lines = df.attrs.get(LINES)
    return f"line {lines[i]}" if lines is not None and i < len(lines) else f"row {i}"


def _name(df: pd.DataFrame, i: int) -> str:
    return f"table {_show(df['name'].iloc[i])}" if "name" in df.columns else _at(df, i)


def _where(df: pd.DataFrame, i: int) -> str:
    """Table i by its name and its place in the file ('table 'x' (line 2502)'): in a 5,000-table spec a value out of
    range had been named by the table alone."""
    return f"{_name(df, i)} ({_at(df, i)})" if "name" in df.columns else _at(df, i)


def _yaml_table_lines(path: str, count: int) -> list[int] | None:
    """The line where each of the `count` tables of a YAML spec starts (its sequence item), or None."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            node = yaml.compose(f, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return None
    if isinstance(node, yaml.MappingNode):
        node = next((v for k, v in node.value if getattr(k, "value", None) == "tables"), None)
    if not isinstance(node, yaml.SequenceNode) or len(node.value) != count:
        return None
    return [item.start_mark.line + 1 for item in node.value]


def _show(value) -> str:
    """A cell for a message: text quoted, numbers plainly (never np.float64(...))."""
    return repr(str(value)[:60]) if isinstance(value, str) else checks.number(value)


def validate_spec(df: pd.DataFrame, path: str) -> pd.DataFrame:
    """Checked spec rows: required columns, types, positive sizes, finite pooling, unique names."""
    for col in REQUIRED:
        if col not in df.columns:
            raise EmbshardError("missing column", path=path, field=col,
                                fix=f"add a '{col}' column (required: {', '.join(REQUIRED)})")
    names = df["name"]
    empty = names.isna() | (names.astype(str).str.strip() == "")
    if empty.any():
        i = int(np.flatnonzero(empty.to_numpy())[0])
        raise EmbshardError(f"empty name in {_at(df, i)}", path=path, field="name", fix="give every table a name")
    names = names.astype(str).str.strip()
    bad = names.map(checks.bad_id).astype(bool)
    if bad.any():
        i = int(np.flatnonzero(bad.to_numpy())[0])
        raise EmbshardError(f"table name {names.iloc[i][:60]!r} in {_at(df, i)} is not allowed", path=path,
                            field="name", fix=f"use {checks.ID_RULE}")
    dup = names.duplicated()
    if dup.any():
        i = int(np.flatnonzero(dup.to_numpy())[0])
        first = int(np.flatnonzero((names == names.iloc[i]).to_numpy())[0])
        raise EmbshardError(f"duplicate table name {names.iloc[i]!r} ({_at(df, first)} and {_at(df, i)})", path=path,
                            field="name", fix="give every table a unique name")
    out = pd.DataFrame({"name": names})
    for col in ("num_embeddings", "embedding_dim"):
        v = _numbers(df, col, path, integer=True)
        if (v <= 0).any():
            i = int(np.flatnonzero((v <= 0).to_numpy())[0])
            raise EmbshardError(f"value {checks.number(v.iloc[i])} of {_where(df, i)} is not > 0", path=path,
                                field=col, fix="rows and dims must be positive integers")
        upper = checks.MAX_DIM if col == "embedding_dim" else checks.MAX_TABLE_BYTES
        if (v > upper).any():
            i = int(np.flatnonzero((v > upper).to_numpy())[0])
            raise EmbshardError(f"value {checks.number(v.iloc[i])} of {_where(df, i)} is too large", path=path,
                                field=col, fix=f"give at most {checks.number(upper)}"
                                + (" (the largest dims in use are a few thousand)" if col == "embedding_dim" else ""))
        if col == "embedding_dim":
            odd = v % checks.DIM_MULTIPLE != 0
            if odd.any():
                i = int(np.flatnonzero(odd.to_numpy())[0])
                d = int(v.iloc[i])
                raise EmbshardError(f"dim {d} of {_name(df, i)} ({_at(df, i)}) is not a multiple of "
                                    f"{checks.DIM_MULTIPLE}: FBGEMM's kernels cannot measure it", path=path,
                                    field=col, fix=f"use a multiple of {checks.DIM_MULTIPLE} (e.g. "
                                    f"{-(-d // checks.DIM_MULTIPLE) * checks.DIM_MULTIPLE}; pad the table)")
        out[col] = v.astype(np.int64)
    pf = _numbers(df, "pooling_factor", path, integer=False)
    bad = ~np.isfinite(pf) | (pf < 0) | (pf > checks.MAX_POOLING_FACTOR)
    if bad.any():
        i = int(np.flatnonzero(bad.to_numpy())[0])
        raise EmbshardError(f"value {checks.number(pf.iloc[i])} of {_where(df, i)} is not a finite number from 0 "
                            f"to {checks.number(checks.MAX_POOLING_FACTOR)}", path=path, field="pooling_factor",
                            fix="give the mean lookups per sample of every table")
    out["pooling_factor"] = pf
    if "data_type" in df.columns:
        dt = df["data_type"].fillna("fp32").astype(str).str.strip().str.lower()
        unknown = ~dt.isin(list(_DTYPE_ALIASES))
        if unknown.any():
            i = int(np.flatnonzero(unknown.to_numpy())[0])
            raise EmbshardError(f"unsupported data type {df['data_type'].iloc[i]!r} of {_where(df, i)}",
                                path=path, field="data_type", fix="use fp32 or fp16")
        out["data_type"] = dt.map(_DTYPE_ALIASES)
    else:
        out["data_type"] = "fp32"
    size = out["num_embeddings"].astype(float) * out["embedding_dim"] * out["data_type"].map(DATA_TYPES)
    if (size >= checks.MAX_TABLE_BYTES).any():
        i = int(np.flatnonzero((size >= checks.MAX_TABLE_BYTES).to_numpy())[0])
        raise EmbshardError(f"{_where(df, i)} would need {size.iloc[i]:.3g} bytes", path=path, field="num_embeddings",
                            fix="give a table below 2^62 bytes (num_embeddings x embedding_dim x bytes per value)")
    if "zipf_alpha" in df.columns:
        za = _numbers(df, "zipf_alpha", path, integer=False, required=False)
        bad = za.notna() & (~np.isfinite(za) | (za < 0))
        if bad.any():
            i = int(np.flatnonzero(bad.to_numpy())[0])
            raise EmbshardError(f"value {checks.number(za.iloc[i])} of {_where(df, i)} is not a finite number >= 0",
                                path=path,
                                field="zipf_alpha",
                                fix="give a skew >= 0 (0 = uniform, ~1 = typical) or leave it empty")
        out["zipf_alpha"] = za
    present = [c for c in schemas.BIN_COLUMNS if c in df.columns]
    if present:
        if len(present) != schemas.NUM_BINS:
            missing = [c for c in schemas.BIN_COLUMNS if c not in df.columns]
            raise EmbshardError(f"only {len(present)} of the 17 bins given", path=path, field=missing[0],
                                fix="give all of bin_00..bin_16, or none (use zipf_alpha instead)")
        bins = pd.DataFrame({c: _numbers(df, c, path, integer=False, required=False) for c in schemas.BIN_COLUMNS})
        given = bins.notna().all(axis=1)
        partial = bins.notna().any(axis=1) & ~given
        if partial.any():
            i = int(np.flatnonzero(partial.to_numpy())[0])
            raise EmbshardError(f"{_where(df, i)} has some bins empty", path=path, field="bin_00..bin_16",
                                fix="give all 17 bins of a table, or none")
        vals = bins.to_numpy()
        bad = given.to_numpy() & ((vals < 0).any(axis=1) | (np.abs(np.nansum(vals, axis=1) - 1) > 1e-3))
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise EmbshardError(f"bins of {_where(df, i)} are not fractions summing to 1", path=path,
                                field="bin_00..bin_16", fix="give the fraction of unique indices in each bin")
        for c in schemas.BIN_COLUMNS:
            out[c] = bins[c]
    return out.reset_index(drop=True)


def tables_from_spec(path: str, seed: int = 0, bins_batch_size: int | None = None,
                     progress: bool = True, reread: bool = False) -> pd.DataFrame:
    """A validated tables frame (+ `zipf_alpha`, NaN where bins were given) from a spec file. `reread`: a command
    that reads the spec as its --tables (place, export, evaluate): a long sampling then says how to skip it."""
    from tqdm.auto import tqdm

    from .synthetic import BINS_BATCH_SIZE, sample_table_batch, table_bins, table_rng

    path = os.fspath(path).removeprefix("file://")  # as tables.parquet reads it (its `source` names the path)
    batch = int(bins_batch_size or BINS_BATCH_SIZE)
    spec = validate_spec(read_spec_file(path), path)
    n = len(spec)
    has_bins = (spec[schemas.BIN_COLUMNS].notna().all(axis=1).to_numpy() if schemas.BIN_COLUMNS[0] in spec
                else np.zeros(n, dtype=bool))
    alpha_given = spec["zipf_alpha"].to_numpy() if "zipf_alpha" in spec else np.full(n, np.nan)
    both = np.flatnonzero(has_bins & np.isfinite(alpha_given.astype(float)))
    if len(both):  # the bins would win silently over the alpha the user also wrote
        raise EmbshardError(f"table {spec.loc[both[0], 'name']} gives both zipf_alpha and the bins", path=path,
                            field="zipf_alpha", fix="give one skew per table: zipf_alpha, or the 17 bins")
    bins = np.empty((n, schemas.NUM_BINS))
    alpha = np.where(has_bins, np.nan, np.where(np.isfinite(alpha_given.astype(float)), alpha_given,
                                                DEFAULT_ZIPF_ALPHA)).astype(np.float64)
    where = f"spec:{os.path.abspath(path)}"
    sources = []
    for i in range(n):
        if has_bins[i]:
            bins[i] = spec.loc[i, schemas.BIN_COLUMNS].to_numpy(dtype=np.float64)
            bins[i] /= bins[i].sum()
            sources.append(f"{where};skew=bins")
        elif np.isfinite(alpha_given[i]):
            sources.append(f"{where};skew=zipf-{alpha[i]:g};bins_batch={batch}")
        else:
            sources.append(f"{where};skew=default-zipf-{DEFAULT_ZIPF_ALPHA:.1f};bins_batch={batch}")
    # Bins sampled by an earlier read of the same rows come from the cache (bins_cache: the same arrays).
    folder = bins_cache.cache_dir()
    keys = {int(i): bins_cache.table_key(seed, batch, str(spec.loc[i, "name"]), int(spec.loc[i, "num_embeddings"]),
                                         float(spec.loc[i, "pooling_factor"]), float(alpha[i]))
            for i in np.flatnonzero(~has_bins)}
    todo = []
    for i, key in keys.items():
        hit = bins_cache.load(folder, key)
        if hit is None:
            todo.append(i)
        else:
            bins[i] = hit
    # The bar shows on a terminal once reading has taken 2 s (a spec's access features take ~26 ms a table to sample).
    # Where stderr is no terminal (CI, a log) the bar is off, so a long sampling is said once, with how to skip it.
    if progress and len(todo) >= SAY_SAMPLING_FROM:
        log.info("%s: sampling the access features of %d tables (about %.0f s%s)", path, len(todo),
                 len(todo) * SAMPLE_S_PER_TABLE, "; `embshard ingest --source spec` once, then pass its "
                 "tables.parquet, skips this" if reread else "")
    writer = bins_cache.Writer(folder)
    for i in tqdm(todo, desc="spec tables: sampling access features", unit="table",
                  disable=not progress or None, mininterval=1.0, delay=2.0):
        # A stream per table, seeded by its name: its bins (and content hash) do not depend on the order or
        # number of rows in the file (seeded by the row index, a reordered spec changed every table's bins, so
        # `export` refused a plan of the same tables as "changed" and the learned planner planned them otherwise).
        rng = table_rng(seed, str(spec.loc[i, "name"]))
        rows = int(spec.loc[i, "num_embeddings"])
        idx, _ = sample_table_batch(rows, float(spec.loc[i, "pooling_factor"]), float(alpha[i]), batch, rng)
        bins[i] = table_bins(idx, rows)
        writer.store(keys[i], bins[i])
    bpe = spec["data_type"].map(DATA_TYPES).astype(np.int64)
    df = pd.DataFrame({"table_id": spec["name"], "rows": spec["num_embeddings"], "dim": spec["embedding_dim"],
                       "pooling_factor": spec["pooling_factor"], "bytes_per_element": bpe})
    df["size_bytes"] = df["rows"] * df["dim"] * df["bytes_per_element"]
    for k, c in enumerate(schemas.BIN_COLUMNS):
        df[c] = bins[:, k]
    df["source"] = sources
    df["zipf_alpha"] = alpha
    return schemas.validate(df, "tables", path)


def spec_sizes(path) -> tuple[np.ndarray, list[str], np.ndarray]:
    """(bytes (N,), names, rows (N,)) of the tables a spec lists, from its validated rows alone (no access
    features sampled: those take ~26 ms a table), so that a command can refuse tables that cannot fit, naming a
    table that alone needs most of the memory, before it reads them in full."""
    spec = validate_spec(read_spec_file(os.fspath(path)), os.fspath(path))
    bpe = spec["data_type"].map(DATA_TYPES).astype(np.int64).to_numpy()
    rows = spec["num_embeddings"].to_numpy(dtype=np.int64)
    return rows * spec["embedding_dim"].to_numpy(dtype=np.int64) * bpe, [str(n) for n in spec["name"]], rows


def is_spec_path(path) -> bool:
    """Whether `path` is a table spec rather than a tables.parquet: a CSV or YAML file, or a Parquet file with
    TorchRec's column names (schemas.spec_columns; only its footer is read)."""
    path = os.fspath(path).removeprefix("file://")  # read as its path
    ext = os.path.splitext(path)[1].lower()
    if ext in schemas.SPEC_SUFFIXES:
        return True
    if ext not in (".parquet", ".pq") or not os.path.isfile(path):
        return False
    import pyarrow.parquet as pq

    try:
        return schemas.spec_columns(pq.read_schema(path).names)
    except Exception:  # not readable as Parquet: the tables reader says why
        return False


def read_tables(path, seed: int = 0):
    """The TableSet of a tables.parquet, or of a table spec read here as `embshard ingest --source spec` reads it
    (the same seed, so the same tables): what `embshard place`, `predict` and `export` take as --tables."""
    from ..tableset import TableSet

    if is_spec_path(path):  # a progress bar on a terminal when this takes long: `embshard ingest` once saves it
        return TableSet.from_frame(tables_from_spec(os.fspath(path), seed=seed, progress=True, reread=True))
    return TableSet.read(path)
