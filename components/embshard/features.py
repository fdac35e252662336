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
# Representative access count of each bin: 1, 2, 3, then the geometric middle 2**(k-0.5) of (2**(k-1), 2**k].
REP_COUNTS = np.array([1.0, 2.0, 3.0] + [2.0 ** (k - 0.5) for k in range(3, NUM_BINS)])
# Bytes per weight where a table's precision is not known (FP32); measured ops use each table's own precision.
MEASURED_WEIGHT_BYTES = 4
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
        return bins_from_histogram(np.zeros(NUM_BINS, dtype=np.int64))
    _, counts = np.unique(indices, return_counts=True)
    return bins_from_counts(counts)


def bins_from_counts(counts: np.ndarray) -> np.ndarray:
    """The 17 bins from the access count of every unique index."""
    return bins_from_histogram(bin_histogram(counts))


def bins_from_histogram(hist: np.ndarray) -> np.ndarray:
    """(..., 17) fractions of the unique indices per bin from their counts per bin (bin_histogram, or several
    batches' added up); a table never looked up (no index at all) is uniformly cold: bin 0 = 1."""
    hist = np.asarray(hist, dtype=np.float64)
    total = hist.sum(axis=-1, keepdims=True)
    out = np.divide(hist, total, out=np.zeros_like(hist), where=total > 0)
    out[..., 0] = np.where(total[..., 0] > 0, out[..., 0], 1.0)
    return out


def bin_histogram(counts: np.ndarray) -> np.ndarray:
    """(17,) int64: how many unique indices fall in each bin, from their access counts (bins_from_counts before
    it is normalised: histograms of several batches add up)."""
    return np.bincount(bin_of_count(counts), minlength=NUM_BINS)


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


def working_set_rows(raw: np.ndarray, batch_size: int) -> np.ndarray:
    """(N,) unique rows a batch of `batch_size` samples touches per table, from raw features: B x pooling / the
    mean access count of a unique row (from the bins), capped at the table's rows. This is the rule the
    benchmark's inputs are drawn with (embshard.bench.inputs), so it is the working set each measurement had."""
    raw = np.asarray(raw, dtype=np.float64)
    bins = raw[:, 4:]
    total = bins.sum(1)
    mean_count = np.where(total > 0, (bins * REP_COUNTS).sum(1) / np.where(total > 0, total, 1.0), 1.0)
    lookups = float(batch_size) * raw[:, 2]
    return np.minimum(np.maximum(lookups / mean_count, np.minimum(lookups, 1.0)), raw[:, 1])


def working_set_bytes(raw: np.ndarray, batch_size: int) -> np.ndarray:
    """(N,) bytes of weights a measured batch touches per table: unique rows x bytes per row, the row's bytes
    being size_bytes / rows (dim x 4 for FP32, dim x 2 for FP16, the precision the benchmark measures in)."""
    raw = np.asarray(raw, dtype=np.float64)
    row_bytes = np.where(raw[:, 1] > 0, raw[:, 3] / np.maximum(raw[:, 1], 1.0), raw[:, 0] * MEASURED_WEIGHT_BYTES)
    return working_set_rows(raw, batch_size) * row_bytes


@dataclass
class FeatureScaler:
    """Fixed normalisation fitted on a training pool (robust where a task's tables share a value)."""

    mean: np.ndarray
    std: np.ndarray

    @classmethod
    def fit(cls, raw: np.ndarray) -> FeatureScaler:
        x = _log_part(raw)
        std = x.std(axis=0)
        return cls(mean=x.mean(axis=0), std=np.where(std < 1e-6, 1.0, std))


def _log_part(raw: np.ndarray) -> np.ndarray:
    x = np.array(raw, dtype=np.float64, copy=True)
    x[:, :_LOG_FEATURES] = np.log1p(x[:, :_LOG_FEATURES])
    return x
