"""`embshard predict`: what will a device shard cost? The cost model's answer per shard, with its interval.

Input: a tables file (tables contract) and a shards file (shards contract: sample_id, table_ids, num_devices,
origin; Parquet, or CSV with table_ids separated by spaces or semicolons). Output (Parquet, or CSV by the
extension): one row per shard with the predicted forward and backward compute, communication and total ms,
each with the ensemble's interval (`*_low`, `*_high`: calibrated to hold 90% of measured validation costs), the
shard's working set (bytes of weights a measured batch touches, and its share of the model's cache), and the
model, its hardware and batch size. Predictions are for the hardware the model was measured on.
"""
from __future__ import annotations

import argparse
import os

import numpy as np
import pandas as pd

from .. import schemas, storage
from ..errors import EmbshardError, first_line
from ..registry import COST_CHAMPION_URI, pinned


def read_shards(path: str) -> pd.DataFrame:
    """A shards file: Parquet (contract), or CSV with `table_ids` as space/semicolon-separated ids."""
    if path.lower().endswith(".csv"):
        from .. import checks

        checks.input_file(path, fix="check the --shards path")  # a FIFO would block; permission denied
        try:
            df = pd.read_csv(path, dtype={"sample_id": str, "table_ids": str})
        except (OSError, ValueError) as exc:
            raise EmbshardError(f"cannot read the shards CSV ({first_line(exc, 100)})", path=path,
                                fix="give a CSV with columns sample_id, table_ids, num_devices") from None
        if "table_ids" not in df.columns:
            raise EmbshardError("no table_ids column", path=path, field="table_ids",
                                fix="list each shard's table ids, separated by spaces or semicolons")
        df["table_ids"] = [str(v).replace(";", " ").split() if isinstance(v, str) else [] for v in df["table_ids"]]
        df["origin"] = df.get("origin", "user")
        return schemas.validate(df, "shards", path)
    return schemas.read(path, "shards")


def run(tables: str, shards: str, out: str, model_uri: str = COST_CHAMPION_URI,
        hardware: str | None = None) -> pd.DataFrame:
    """`hardware`: what the prediction is for (default: this machine); one warning line when the model was
    measured on other hardware (its predictions are for its own)."""
    import logging

    from .. import costmodel
    from ..bench.backends import check_target
    from ..features import working_set_bytes
    from ..ingest.spec import read_tables

    ts = read_tables(tables)
    sdf = read_shards(shards)
    if len(sdf) == 0:
        raise EmbshardError("no shards", path=shards, fix="list at least one shard")
    for sid, ids in zip(sdf["sample_id"], sdf["table_ids"]):
        dup = sorted({t for t in ids if list(ids).count(t) > 1})
        if dup:  # a device holds a table once: a repeated id would be costed as two tables
            raise EmbshardError(f"shard {str(sid)[:40]!r} lists table {dup[0]!r} {list(ids).count(dup[0])} times",
                                path=shards, field="table_ids", fix="list each table once per device shard")
    row_of = {str(t): i for i, t in enumerate(ts.table_ids)}
    missing = sorted({t for ids in sdf["table_ids"] for t in ids if t not in row_of})
    if missing:
        raise EmbshardError(f"{len(missing)} table ids are not in the tables file, e.g. {missing[:3]}", path=shards,
                            field="table_ids", fix=f"use ids of {os.fspath(tables)}")
    model_uri = pinned(model_uri)  # the version an alias names now: what the rows record (an alias moves)
    model = costmodel.load(model_uri)
    feats, rows = _shard_features(ts, sdf, row_of)
    cfg = model.config
    warning = check_target(str(cfg.hardware or ""), hardware)
    if warning:
        logging.getLogger(__name__).warning(warning)
    ws = working_set_bytes(feats, int(cfg.batch_size or 1024))
    out_df = pd.DataFrame({"sample_id": sdf["sample_id"].astype(str), "num_tables": [len(r) for r in rows],
                           "num_devices": sdf["num_devices"].astype(int)})
    cols: dict[str, np.ndarray] = {}
    for d in sorted(out_df["num_devices"].unique()):
        sel = np.flatnonzero(out_df["num_devices"].to_numpy() == d)
        for name, val in model.predict_columns(feats, [rows[i] for i in sel], int(d)).items():
            cols.setdefault(name, np.full(len(out_df), np.nan))[sel] = val
    for k, v in cols.items():
        out_df[k] = v
    out_df["working_set_bytes"] = [float(ws[r].sum()) for r in rows]
    out_df["working_set_over_cache"] = out_df["working_set_bytes"] / float(cfg.cache_bytes)
    out_df["model"] = model_uri
    out_df["hardware"] = cfg.hardware
    out_df["batch_size"] = int(cfg.batch_size or 0)
    with storage.atomic_write(out) as f:
        if out.lower().endswith(".csv"):
            f.write(out_df.to_csv(index=False).encode())
        else:
            out_df.to_parquet(f, index=False)
    return out_df


def _shard_features(ts, sdf: pd.DataFrame, row_of: dict[str, int]) -> tuple[np.ndarray, list[np.ndarray]]:
    """The feature rows the shards index: the tables' own, plus one row per split piece (column slice, row range
    or replica, costmodel.scoring.piece_features) so that a piece is predicted as what it is, not as its whole
    table. (A replica's all-reduce is not in these per-shard heads: costmodel.scoring.replica_extra_ms.)"""
    from ..costmodel.data import entry_pieces, entry_replicas
    from ..costmodel.scoring import piece_features
    from ..types import Shard

    base = ts.features()
    extra: list[Shard] = []
    share: list[int] = []  # D of a replica piece (its 1/D of the lookups), else 1
    rows = []
    for _, srow in sdf.iterrows():
        ids = list(srow["table_ids"])
        idx = []
        reps = entry_replicas(srow, len(ids))
        for t, (col, off, size), rep in zip(ids, entry_pieces(srow, len(ids)), reps):
            if col is None and size is None and not rep:
                idx.append(row_of[t])
            else:
                idx.append(len(base) + len(extra))
                extra.append(Shard(row_of[t], 0, 0, col, off, size))
                share.append(int(srow["num_devices"]) if rep else 1)
        rows.append(np.array(idx, dtype=np.int64))
    if not extra:
        return base, rows
    pf = piece_features(ts, extra)
    pf[:, 2] = pf[:, 2] / np.asarray(share, dtype=np.float64)
    return np.vstack([base, pf]), rows


# What `embshard predict` writes and reads: its --out is checked before any work (cli.check_output).
OUTPUT = {"kind": "file", "inputs": ("tables", "shards", "model"), "suffixes": (".parquet", ".csv")}


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tables", required=True,
                   help="tables.parquet, or a table spec (read as `embshard ingest --source spec` reads it)")
    p.add_argument("--shards", required=True, help="shards file: Parquet (shards contract) or CSV "
                                                   "(sample_id, table_ids separated by spaces, num_devices)")
    p.add_argument("--model", default=COST_CHAMPION_URI, help=f"cost model URI or folder (default {COST_CHAMPION_URI})")
    p.add_argument("--hardware", default=None,
                   help="the hardware the prediction is for (default: this machine's GPU, else its CPU); a "
                        "warning when the model was measured on other hardware")
    p.add_argument("--out", required=True, help="output file (.parquet, or .csv)")


def main(args: argparse.Namespace) -> int:
    df = run(args.tables, args.shards, args.out, args.model, hardware=args.hardware)
    show = df[["sample_id", "num_tables", "num_devices", "total_ms", "total_ms_low", "total_ms_high"]].head(10)
    with pd.option_context("display.width", 160, "display.float_format", "{:.3f}".format):
        print(show.to_string(index=False))
    if len(df) > 10:
        print(f"... {len(df) - 10} more")
    print(f"wrote {len(df)} shards to {args.out} (model {df['model'].iloc[0]}, {df['hardware'].iloc[0]}, "
          f"batch {df['batch_size'].iloc[0]})")
    return 0
