"""What a costs folder measured: a fingerprint that decides whether a rerun may resume it.

A rerun resumes finished chunks and measured shards only when it would measure the same thing: the same tables
(a hash of their content, not of the file's bytes), the same shard list, batch size, backend, hardware, timer,
iterations, warm-up, seed, memory cap and communication settings. Anything else stops with an error that names
what differs; mixing parts of two configurations would give a cost model data that no single setting produced.
The fingerprint lives in OUT/costs/.fingerprint.json (hidden from readers of the costs folder).
"""
from __future__ import annotations

import hashlib
import json

import numpy as np
import pandas as pd

from .. import storage
from ..errors import EmbshardError
from ..tableset import TableSet

FILE = ".fingerprint.json"
VERSION = 1
# Fingerprint key -> the CLI option to name in an error.
OPTIONS = {"tables_sha256": "tables", "shards_sha256": "shards", "batch_size": "batch_size", "backend": "backend",
           "device": "device", "hardware": "hardware", "timer": "timer", "iterations": "iterations",
           "warmup": "warmup", "num_batches": "num_batches", "seed": "seed", "max_shard_gb": "max_shard_gb",
           "max_table_gb": "max_table_gb",
           "comm": "comm_bandwidth_gbps", "num_threads": "EMBSHARD_NUM_THREADS"}


def tables_hash(ts: TableSet) -> str:
    """Content hash of what a measurement reads from the tables (ids, shapes, access pattern, traces)."""
    h = hashlib.sha256()
    h.update("\0".join(map(str, ts.table_ids)).encode())
    for arr in (ts.rows, ts.dims, ts.pooling_factor, ts.bytes_per_element, ts.bins, ts.trace_table_index):
        h.update(np.ascontiguousarray(arr).tobytes())
    h.update("\0".join("" if f is None else str(f) for f in ts.trace_file).encode())
    if not np.isnan(ts.trace_pooling).all():  # tables of several trace files (only then: older hashes unchanged)
        h.update(np.ascontiguousarray(ts.trace_pooling).tobytes())
    return h.hexdigest()


def shards_hash(shard_df: pd.DataFrame) -> str:
    """Hash of the shard list in order (its position decides the chunk a shard belongs to)."""
    cols = [c for c in ("sample_id", "table_ids", "num_devices", "origin", "col_sizes", "row_offsets", "row_sizes")
            if c in shard_df.columns]
    rows = [[_plain(r[c]) for c in cols] for _, r in shard_df[cols].iterrows()]
    return hashlib.sha256(json.dumps(rows, separators=(",", ":")).encode()).hexdigest()


def _plain(v):
    if v is None or (isinstance(v, float) and np.isnan(v)):
        return None
    if isinstance(v, (list, tuple, np.ndarray)):
        return [_plain(x) for x in list(v)]
    if isinstance(v, np.generic):
        return v.item()
    return v


def check_or_adopt(costs_dir: str, fp: dict, has_results: bool) -> bool:
    """Compare `fp` with the folder's fingerprint. Returns True when it must still be written (a fresh folder).

    A different fingerprint, or results without one (an older embshard), is an error: never resume across them.
    """
    path = storage.join(costs_dir, FILE)
    if not storage.exists(path):
        if has_results:
            raise EmbshardError("this costs folder holds measurements without a fingerprint of their settings",
                                path=costs_dir, field="fingerprint",
                                fix="write to a new --out, or delete this costs folder to measure again")
        return True
    try:
        old = json.loads(storage.read_text(path))
    except (ValueError, OSError, UnicodeDecodeError):
        raise EmbshardError("unreadable fingerprint", path=path, field="fingerprint",
                            fix="write to a new --out, or delete this costs folder to measure again") from None
    diff = _differences(old, fp)
    if diff:
        what = "; ".join(f"{k.removesuffix('_sha256')} {_short(old.get(k))} there, {_short(fp.get(k))} now"
                         for k in diff[:3])
        raise EmbshardError(f"this folder was measured with other settings ({what})", path=costs_dir,
                            field=OPTIONS[diff[0]],
                            fix="rerun with the same inputs and options to resume, or write to a new --out")
    return False


def matches(costs_dir: str, fp: dict) -> bool:
    """Whether the folder's fingerprint is `fp` (False: none there, unreadable, or other inputs or settings)."""
    path = storage.join(costs_dir, FILE)
    if not storage.exists(path):
        return False
    try:
        old = json.loads(storage.read_text(path))
    except (ValueError, OSError, UnicodeDecodeError):
        return False
    return not _differences(old, fp)


def _differences(old: dict, fp: dict) -> list[str]:
    """The fingerprint keys (OPTIONS) whose values differ."""
    return [k for k in OPTIONS if old.get(k) != fp.get(k)]


def write(costs_dir: str, fp: dict) -> None:
    storage.write_text(storage.join(costs_dir, FILE), json.dumps({"version": VERSION, **fp}, indent=1) + "\n")


def _short(v) -> str:
    if isinstance(v, str) and len(v) == 64:
        return v[:10]  # a hash: enough to see that they differ
    return "none" if v is None else str(v)
