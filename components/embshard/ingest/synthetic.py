"""A seeded generator of realistic embedding-table populations (DLRM-like).

Hash sizes follow a power law from 10 to 1e8 rows (many small tables, a few huge ones), dims are mixed
4..256, pooling factors are heavy-tailed (a third of the features are one-hot), and each table's accesses
follow a Zipf-like law whose strength varies from uniform (alpha 0) to very skewed (alpha 1.4).
The 17 access bins are computed from a sampled batch, exactly as for a real trace.
"""
from __future__ import annotations

import hashlib

import numpy as np
import pandas as pd

from .. import schemas
from ..features import bin_histogram, bins_from_histogram

MIN_ROWS, MAX_ROWS = 10, 10**8
DIMS = np.array([4, 8, 16, 32, 64, 128, 256])
DIM_PROBS = np.array([0.04, 0.10, 0.18, 0.26, 0.22, 0.13, 0.07])
MAX_POOLING = 120.0
# Large multi-hot features (a user's history of item ids: tens of millions of rows and tens to a hundred lookups
# per sample; public DLRM models have a few). Size and pooling drawn independently make one with 1e7+ rows and
# 50+ lookups about 1 table in 900, too rare for the cost model to learn what a cut of one costs, so a fraction
# of the population can be drawn as such (`hot_large_fraction`). Their own random stream: the other tables stay.
HOT_LARGE_LOG10_ROWS = (7.0, 8.0)
HOT_LARGE_POOLING = (20.0, MAX_POOLING)
HOT_LARGE_ALPHA = (0.6, 1.2)
# Production models keep many tables in FP16 (half the bytes and memory traffic of FP32); a cost model that never
# measured one mis-prices it: features carry a table's bytes, not its type, and an FP32-only model priced shards
# holding an FP16 table a median 16% below their cost on this CPU. So a fraction of the population can be drawn as
# FP16 (`fp16_fraction`; 0 in the pipeline: a run with 0.25 planned no better, params.py). Their own random stream:
# the shapes, and which tables are hot and large, stay.
FP16_STREAM = 0xF16
# Batch on which the access bins are computed: the open DLRM dataset's 65,536 samples.
BINS_BATCH_SIZE = 65_536


def sample_population(num_tables: int, seed: int = 0, hot_large_fraction: float = 0.0) -> pd.DataFrame:
    """Table shapes and access parameters (rows, dim, pooling_factor, zipf_alpha), no bins yet; about
    `hot_large_fraction` of the tables are large multi-hot features (HOT_LARGE_*)."""
    rng = np.random.default_rng(seed)
    # log10(rows) = 1 + 7 * u**1.6 puts most tables below 1e5 rows and a tail up to 1e8.
    u = rng.random(num_tables)
    rows = np.floor(10 ** (np.log10(MIN_ROWS) + (np.log10(MAX_ROWS) - np.log10(MIN_ROWS)) * u ** 1.6))
    rows = np.clip(rows, MIN_ROWS, MAX_ROWS).astype(np.int64)
    dims = rng.choice(DIMS, size=num_tables, p=DIM_PROBS).astype(np.int64)
    one_hot = rng.random(num_tables) < 0.33
    pooling = np.where(one_hot, 1.0, np.clip(rng.lognormal(mean=1.6, sigma=1.1, size=num_tables), 1.0,
                                             MAX_POOLING))
    # Some features are missing for part of the samples: pooling slightly below 1 is realistic.
    pooling = np.where(one_hot & (rng.random(num_tables) < 0.3), rng.uniform(0.3, 1.0, num_tables), pooling)
    alpha = rng.uniform(0.0, 1.4, size=num_tables)
    if hot_large_fraction > 0:
        g = np.random.default_rng([seed, 0x407])
        pick = g.random(num_tables) < hot_large_fraction
        n = int(pick.sum())
        rows[pick] = np.floor(10 ** g.uniform(*HOT_LARGE_LOG10_ROWS, n)).astype(np.int64)
        lo, hi = np.log(HOT_LARGE_POOLING[0]), np.log(HOT_LARGE_POOLING[1])
        pooling[pick] = np.exp(g.uniform(lo, hi, n))
        alpha[pick] = g.uniform(*HOT_LARGE_ALPHA, n)
    return pd.DataFrame({
        "table_id": [f"t{i:04d}" for i in range(num_tables)],
        "rows": rows, "dim": dims, "pooling_factor": np.round(pooling, 4), "zipf_alpha": np.round(alpha, 4),
    })


def element_bytes(num_tables: int, seed: int, bytes_per_element: int = 4, fp16_fraction: float = 0.0) -> np.ndarray:
    """(num_tables,) bytes per weight: `bytes_per_element`, with about `fp16_fraction` of the tables FP16 (2),
    drawn on a stream of their own (FP16_STREAM)."""
    out = np.full(num_tables, int(bytes_per_element), dtype=np.int64)
    if fp16_fraction > 0:
        out[np.random.default_rng([seed, FP16_STREAM]).random(num_tables) < fp16_fraction] = 2
    return out


def zipf_indices(rows: int, alpha: float, count: int, rng: np.random.Generator) -> np.ndarray:
    """`count` indices in [0, rows) with P(rank r) ~ r**-alpha (continuous inverse-CDF approximation).

    Ranks are scattered over the id space by a fixed multiplicative hash, as hashed ids would be.
    """
    u = rng.random(count)
    n = float(rows)
    if abs(alpha - 1.0) < 1e-6:
        ranks = np.exp(u * np.log(n + 1.0))
    else:
        a = 1.0 - alpha
        ranks = ((n + 1.0) ** a - 1.0) * u + 1.0
        ranks = ranks ** (1.0 / a)
    ranks = np.clip(np.floor(ranks).astype(np.int64) - 1, 0, rows - 1)
    return (ranks * 2654435761) % rows


def bag_lengths(pooling_factor: float, batch_size: int, rng: np.random.Generator) -> np.ndarray:
    """Bag lengths with mean `pooling_factor`: Bernoulli below 1 lookup, else 1 + Poisson (heavy-ish tail)."""
    if pooling_factor <= 1.0:
        return (rng.random(batch_size) < pooling_factor).astype(np.int64)
    return 1 + rng.poisson(pooling_factor - 1.0, size=batch_size).astype(np.int64)


def table_rng(seed: int, name: str) -> np.random.Generator:
    """A spec table's own random stream, seeded by its name: its bins do not depend on its row in the file
    (bins_cache keys on this function's source)."""
    return np.random.default_rng([seed, *_name_seed(name)])


def _name_seed(name: str) -> list[int]:
    """Four 32-bit words of the name's SHA-256: a seed that is the same in every process and Python version."""
    digest = hashlib.sha256(name.encode("utf-8")).digest()
    return [int.from_bytes(digest[k:k + 4], "little") for k in range(0, 16, 4)]


def sample_table_batch(rows: int, pooling_factor: float, alpha: float, batch_size: int,
                       rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(indices, lengths) of one table for one batch, DLRM layout."""
    lengths = bag_lengths(pooling_factor, batch_size, rng)
    indices = zipf_indices(rows, alpha, int(lengths.sum()), rng)
    return indices, lengths


def generate_tables(num_tables: int, seed: int = 0, bytes_per_element: int = 4,
                    bins_batch_size: int = BINS_BATCH_SIZE, hot_large_fraction: float = 0.0,
                    fp16_fraction: float = 0.0) -> pd.DataFrame:
    """A validated tables frame (tables contract + `zipf_alpha`) of `num_tables` synthetic tables, of
    `bytes_per_element` weights except about `fp16_fraction` of them drawn as FP16 (2 bytes)."""
    from ..errors import EmbshardError

    if num_tables <= 0:
        raise EmbshardError("must be > 0", field="num_tables", fix="ask for at least one table")
    for name, value, example in (("hot_large_fraction", hot_large_fraction, 0.03), ("fp16_fraction", fp16_fraction,
                                                                                   0.25)):
        if not 0.0 <= float(value) <= 1.0:  # also refuses NaN
            raise EmbshardError(f"{value} is not a fraction", field=name,
                                fix=f"give a value from 0 to 1 (e.g. {example})")
    if float(fp16_fraction) > 0 and int(bytes_per_element) == 2:
        raise EmbshardError("every table is FP16 already (bytes_per_element 2, --data-type fp16)",
                            field="fp16_fraction",
                            fix="leave out fp16_fraction, or draw FP32 tables (--data-type fp32) with a share in FP16")
    pop = sample_population(num_tables, seed, float(hot_large_fraction))
    rng = np.random.default_rng(seed + 1)
    bins = np.empty((num_tables, schemas.NUM_BINS))
    for i, t in enumerate(pop.itertuples()):
        idx, _ = sample_table_batch(t.rows, t.pooling_factor, t.zipf_alpha, bins_batch_size, rng)
        bins[i] = table_bins(idx, t.rows)
    df = pop.copy()
    df["bytes_per_element"] = element_bytes(num_tables, seed, bytes_per_element, float(fp16_fraction))
    df["size_bytes"] = df["rows"] * df["dim"] * df["bytes_per_element"]
    for k, c in enumerate(schemas.BIN_COLUMNS):
        df[c] = bins[:, k]
    df["source"] = f"synthetic:seed={seed}"
    return schemas.validate(df[[c for c in df.columns if c != "zipf_alpha"] + ["zipf_alpha"]], "tables",
                            "<synthetic>")


def table_bins(indices: np.ndarray, rows: int | None = None) -> np.ndarray:
    """features.access_bins, computed with a bincount when the id space is small (same result, faster)."""
    return bins_from_histogram(table_bin_histogram(indices, rows))


def table_bin_histogram(indices: np.ndarray, rows: int | None = None) -> np.ndarray:
    """(17,) int64 unique indices per bin of one batch (features.bin_histogram; all zero for no lookups): the
    histograms of several batches of a table add up. np.unique sorts the batch; a bincount over [0, rows) is linear
    and wins whenever the table is not much larger than the batch, so huge tables alone fall back to the sort."""
    indices = np.asarray(indices)
    if indices.size == 0:
        return np.zeros(schemas.NUM_BINS, dtype=np.int64)
    if rows is None or rows > 4 * indices.size + (1 << 16):
        _, counts = np.unique(indices, return_counts=True)
    else:
        counts = np.bincount(indices, minlength=0)
        counts = counts[counts > 0]
    return bin_histogram(counts)


TRACE_LAYOUTS = ("flat", "per_table", "per_table_cumulative")


def write_dlrm_traces(tables_df: pd.DataFrame, path, batch_size: int, seed: int,
                      layout: str = "flat") -> None:
    """Write one batch of `batch_size` samples per table in Meta's open DLRM trace format.

    The file is `torch.save((indices, offsets, lengths))`: indices int64 (all tables concatenated, table by
    table), lengths int64 [T, B], and offsets in one of the layouts the loader accepts:
    "flat" = one array of T*B+1 running positions (fbgemm_t856_bs65536.pt), "per_table" = [T, B+1] with every
    row starting at 0, "per_table_cumulative" = [T, B+1] rows holding the global positions.
    Each table's lengths follow its pooling_factor, its indices its `zipf_alpha` (1.0 where the column is
    missing). A path ending in .gz is gzip-compressed. The write is atomic (temp file, then rename).
    """
    import gzip
    import os
    import shutil
    import tempfile

    import torch

    from ..errors import EmbshardError

    if layout not in TRACE_LAYOUTS:
        raise EmbshardError(f"unknown layout {layout!r}", field="layout", fix=f"use one of {TRACE_LAYOUTS}")
    if batch_size <= 0:
        raise EmbshardError("must be > 0", field="batch_size", fix="use a positive batch size")
    n = len(tables_df)
    if n == 0:
        raise EmbshardError("no tables to write traces for", field="tables", fix="pass at least one table")
    rows = tables_df["rows"].to_numpy(dtype=np.int64)
    pooling = tables_df["pooling_factor"].to_numpy(dtype=np.float64)
    alpha = (tables_df["zipf_alpha"].fillna(1.0).to_numpy(dtype=np.float64) if "zipf_alpha" in tables_df
             else np.ones(n))
    rng = np.random.default_rng([seed, 7])
    # Lengths first, so the concatenated indices are allocated once (traces can hold 100M+ indices).
    lengths = np.stack([bag_lengths(float(p), batch_size, rng) for p in pooling])
    totals = lengths.sum(axis=1)
    starts = np.concatenate([[0], np.cumsum(totals)])
    indices = np.empty(int(starts[-1]), dtype=np.int64)
    for t in range(n):
        indices[starts[t]:starts[t + 1]] = zipf_indices(int(rows[t]), float(alpha[t]), int(totals[t]), rng)
    local = np.zeros((n, batch_size + 1), dtype=np.int64)
    np.cumsum(lengths, axis=1, out=local[:, 1:])
    if layout == "flat":
        offsets = np.concatenate([[0], np.cumsum(lengths.reshape(-1))])
    elif layout == "per_table":
        offsets = local
    else:
        offsets = local + starts[:-1, None]
    payload = (torch.from_numpy(indices), torch.from_numpy(offsets), torch.from_numpy(lengths))

    path = os.fspath(path)
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=parent)
    os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; the trace is a normal data file
    try:
        if path.endswith(".gz"):
            raw = tmp + ".raw"
            try:
                torch.save(payload, raw)
                with open(raw, "rb") as src, gzip.open(tmp, "wb", compresslevel=1) as dst:
                    shutil.copyfileobj(src, dst, 16 << 20)
            finally:
                if os.path.exists(raw):
                    os.remove(raw)
        else:
            torch.save(payload, tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
