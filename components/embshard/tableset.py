"""TableSet: a columnar, numpy view of tables.parquet that planners, models and the benchmark share."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from . import schemas
from .errors import EmbshardError
from .features import feature_matrix


@dataclass(frozen=True)
class TableSet:
    table_ids: np.ndarray          # (N,) str
    rows: np.ndarray               # (N,) int64
    dims: np.ndarray               # (N,) int64
    pooling_factor: np.ndarray     # (N,) float64
    bytes_per_element: np.ndarray  # (N,) int64
    size_bytes: np.ndarray         # (N,) int64
    bins: np.ndarray               # (N, 17) float64
    trace_file: np.ndarray         # (N,) object, None where no trace
    trace_table_index: np.ndarray  # (N,) int64, -1 where no trace
    # (N,) float64: the mean bag length of trace_file's own table where the features came from several files of
    # the trace (ingest.dlrm.tables_from_trace), NaN where it is pooling_factor
    trace_pooling: np.ndarray

    @classmethod
    def from_frame(cls, df: pd.DataFrame, where: str = "<tables DataFrame>", *, checked: bool = False) -> TableSet:
        """Tables from a frame with the columns of tables.parquet (docs/contracts.md). The frame is checked against
        that contract first (one EmbshardError naming `where`, the field and the fix: a negative size, a NaN, a
        duplicate id, a dim FBGEMM cannot run had planned silently or failed deep in torch); a missing `source`
        column reads as "dataframe". `checked`: the frame was read with schemas.read or validated already."""
        if not checked:
            if isinstance(df, pd.DataFrame) and "source" not in df.columns:
                df = df.assign(source="dataframe")
            if not isinstance(df, pd.DataFrame):
                raise EmbshardError(f"a {type(df).__name__}, not a pandas DataFrame", path=where, field="tables",
                                    fix="give a DataFrame with the columns of tables.parquet, or read a file with "
                                        "TableSet.read(path) (tables.parquet) or embshard.ingest.spec.read_tables"
                                        "(path) (a table spec)")
            df = schemas.validate(df, "tables", where)
        n = len(df)
        trace_file = (df["trace_file"].to_numpy(dtype=object) if "trace_file" in df.columns
                      else np.full(n, None, dtype=object))
        trace_idx = (df["trace_table_index"].fillna(-1).to_numpy(dtype=np.int64)
                     if "trace_table_index" in df.columns else np.full(n, -1, dtype=np.int64))
        return cls(
            table_ids=df["table_id"].astype(str).to_numpy(dtype=object),
            rows=df["rows"].to_numpy(dtype=np.int64),
            dims=df["dim"].to_numpy(dtype=np.int64),
            pooling_factor=df["pooling_factor"].to_numpy(dtype=np.float64),
            bytes_per_element=df["bytes_per_element"].to_numpy(dtype=np.int64),
            size_bytes=df["size_bytes"].to_numpy(dtype=np.int64),
            bins=df[schemas.BIN_COLUMNS].to_numpy(dtype=np.float64),
            trace_file=trace_file,
            trace_table_index=trace_idx,
            trace_pooling=(df["trace_pooling_factor"].to_numpy(dtype=np.float64, na_value=np.nan)
                           if "trace_pooling_factor" in df.columns else np.full(n, np.nan)),
        )

    def to_frame(self) -> pd.DataFrame:
        """The tables as a frame with tables.parquet's columns (docs/contracts.md), as `schemas.read` gives them: what
        `from_frame` reads back and the registered planner's pyfunc takes (a table spec read with
        embshard.ingest.spec.read_tables had no way there but through `embshard ingest`)."""
        df = pd.DataFrame({
            "table_id": pd.Series(self.table_ids, dtype=object).astype(str),
            "rows": self.rows.astype(np.int64), "dim": self.dims.astype(np.int32),
            "pooling_factor": self.pooling_factor.astype(np.float64),
            "bytes_per_element": self.bytes_per_element.astype(np.int32),
            "size_bytes": self.size_bytes.astype(np.int64),
            **{c: self.bins[:, k].astype(np.float64) for k, c in enumerate(schemas.BIN_COLUMNS)},
            "source": "tableset"})
        if any(f is not None for f in self.trace_file):  # only tables ingested from a trace have these
            df["trace_file"] = list(self.trace_file)
            df["trace_table_index"] = self.trace_table_index.astype(np.int64)
            if not np.isnan(self.trace_pooling).all():
                df["trace_pooling_factor"] = self.trace_pooling.astype(np.float64)
        return df

    @classmethod
    def read(cls, path) -> TableSet:
        return cls.from_frame(schemas.read(path, "tables"), checked=True)

    def __len__(self) -> int:
        return len(self.table_ids)

    def index_of(self, ids, where: str = "task", source: str = "tables.parquet") -> np.ndarray:
        """Positions of the given table ids; unknown ids are an error naming them and `source`, the file these
        tables were read from (a spec, a tables.parquet)."""
        lookup = {t: i for i, t in enumerate(self.table_ids)}
        missing = [t for t in ids if t not in lookup]
        if missing:
            raise EmbshardError(f"unknown table ids {missing[:3]}{'...' if len(missing) > 3 else ''}",
                                path=where, field="table_ids", fix=f"use ids present in {source}")
        return np.fromiter((lookup[t] for t in ids), dtype=np.int64, count=len(ids))

    def subset(self, idx) -> TableSet:
        idx = np.asarray(idx, dtype=np.int64)
        return TableSet(*(getattr(self, f)[idx] for f in self.__dataclass_fields__))

    def select(self, ids, where: str = "task", source: str = "tables.parquet") -> TableSet:
        return self.subset(self.index_of(list(ids), where, source))

    def content_hashes(self) -> np.ndarray:
        """(N,) 16-hex content hash of each table as a planner sees it (rows, dim, bytes per element, pooling,
        access bins; not its id or trace path): a plan records them, so that its export can tell that a table
        changed since it was planned."""
        import hashlib

        out = np.empty(len(self), dtype=object)
        for i in range(len(self)):
            h = hashlib.sha256(np.array([self.rows[i], self.dims[i], self.bytes_per_element[i]], np.int64).tobytes())
            h.update(np.array([self.pooling_factor[i], *self.bins[i]], np.float64).tobytes())
            out[i] = h.hexdigest()[:16]
        return out

    def features(self) -> np.ndarray:
        """(N, 21) raw features (features.FEATURE_NAMES order)."""
        return feature_matrix(self)
