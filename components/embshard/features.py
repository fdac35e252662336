"""The 21 table features (docs/method.md, "Features") and their normalisation.

Features per table: dim, rows (hash size), pooling_factor (mean lookups per sample), size_bytes, and 17
access-distribution bins: bin k is the fraction of unique indices whose access count in a batch falls in
(0,1], (1,2], (2,4], ..., (16384,32768]; the last bin holds counts > 32768.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .schemas import BIN_COLUMNS, NUM_BINS

FEATURE_NAMES = ["dim", "rows", "pooling_factor", "size_bytes", *BIN_COLUMNS]
NUM_FEATURES = len(FEATURE_NAMES)  # 21
# The numeric features span orders of magnitude: they enter the networks as log1p, then z-scored.
_LOG_FEATURES = 4


def bin_of_count(counts: np.ndarray) -> np.ndarray:
    """Bin index of each access count (counts >= 1): ceil(log2(count)), capped at the last bin."""
    counts = np.asarray(counts, dtype=np.int64)
    if counts.size and counts.min() < 1:
        raise ValueError("access counts must be >= 1")
    # frexp(c - 1) returns the exponent e with c - 1 < 2**e, i.e. the bit length of c - 1 = ceil(log2(c)).
    _, exp = np.frexp((counts - 1).astype(np.float64))
    return np.minimum(exp.astype(np.int64), NUM_BINS - 1)


def access_bins(indices: np.ndarray) -> np.ndarray:
    """The 17 bins of one table's indices in one batch (fractions summing to 1; all zero bins -> bin 0 = 1)."""
    indices = np.asarray(indices)
    if indices.size == 0:
        out = np.zeros(NUM_BINS)
        out[0] = 1.0  # a table never looked up: treat as uniformly cold
        return out
    _, counts = np.unique(indices, return_counts=True)
    return bins_from_counts(counts)


def bins_from_counts(counts: np.ndarray) -> np.ndarray:
    """The 17 bins from the access count of every unique index."""
    hist = np.bincount(bin_of_count(counts), minlength=NUM_BINS).astype(np.float64)
    return hist / hist.sum()


def feature_matrix(tables) -> np.ndarray:
    """(N, 21) raw features in FEATURE_NAMES order from a tables DataFrame or a TableSet."""
    if hasattr(tables, "columns"):  # a DataFrame with the tables contract
        cols = [tables[c] for c in ("dim", "rows", "pooling_factor", "size_bytes")]
        bins = tables[BIN_COLUMNS]
    else:  # a TableSet
        cols = [tables.dims, tables.rows, tables.pooling_factor, tables.size_bytes]
        bins = tables.bins
    cols = [np.asarray(c, dtype=np.float64) for c in cols]
    bins = np.asarray(bins, dtype=np.float64)
    return np.column_stack([*cols, bins])


@dataclass
class FeatureScaler:
    """Fixed normalisation fitted on a training pool (robust where a task's tables share a value)."""

    mean: np.ndarray
    std: np.ndarray

    @classmethod
    def fit(cls, raw: np.ndarray) -> "FeatureScaler":
        x = _log_part(raw)
        std = x.std(axis=0)
        return cls(mean=x.mean(axis=0), std=np.where(std < 1e-6, 1.0, std))

    def transform(self, raw: np.ndarray) -> np.ndarray:
        return ((_log_part(raw) - self.mean) / self.std).astype(np.float32)

    def to_dict(self) -> dict:
        return {"mean": self.mean.tolist(), "std": self.std.tolist()}

    @classmethod
    def from_dict(cls, d: dict) -> "FeatureScaler":
        return cls(np.asarray(d["mean"], dtype=np.float64), np.asarray(d["std"], dtype=np.float64))


def _log_part(raw: np.ndarray) -> np.ndarray:
    x = np.array(raw, dtype=np.float64, copy=True)
    x[:, :_LOG_FEATURES] = np.log1p(x[:, :_LOG_FEATURES])
    return x
