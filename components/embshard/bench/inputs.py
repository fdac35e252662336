"""Benchmark inputs: realistic batches for each table of a shard, and the memory rule that keeps them safe.

Indices come from the table's real trace when it has one (replayed window by window), otherwise they are
drawn from its 17 access bins; bag lengths from its pooling factor (ingest.synthetic.bag_lengths).

Drawing from the bins (no trace). With L lookups in the batch and bin k holding a fraction f_k of the unique
indices, each with a representative access count c_k (1, 2, 3, then the geometric middle 2**(k-0.5) of
(2**(k-1), 2**k]), the batch has U = L / sum_k f_k c_k unique ids (capped at rows). A pool in which U*f_k
distinct ids each repeat c_k times is shuffled and truncated/padded to L. Ids are ranks scattered over
[0, rows) by a per-table stride coprime with rows (distinct ranks give distinct ids). The hot ids (count >= 2)
keep the same ranks in every rotated batch, as hot rows do across real batches; the singletons take fresh
ranks in each batch, so rotating batches really brings cold rows in.

Memory rule (row scaling). Weights need sum(rows x dim x bytes_per_element) bytes (4 for FP32, 2 for FP16).
Where a per-table budget is set (`--max-table-gb`, off by default), each table first keeps at most that many
bytes of rows, by itself, whatever shares its shard (`table_caps`). When the shard's weights exceed the budget
left after the batch itself, the largest tables are capped at C rows (water-filling: tables under C are untouched,
C is the largest cap that fits). Access structure is kept: unique ids are remapped to distinct rows of [0, C)
whenever a batch touches at most C unique ids (always true for real batch sizes and sane budgets), else folded
modulo C.
`row_scale` = scaled weight bytes / original weight bytes of the shard (1.0 = none).
If the batch alone does not fit the budget the shard is refused with a message to lower the batch size.

Row ranges (a table's piece of kind `row`, rows [row_offset, row_offset + row_size); docs/contracts.md, "Shard
kinds"). The piece sees the lookups of the whole table's batch that fall in its range: the table's batches are
drawn as above (bins: ranks hashed to rows by the table's stride; trace: its real ids, windows replayed), the ids
outside the range are dropped, the kept ones rebased to 0..row_size-1, and each sample's bag length becomes the
count of its kept ids (empty bags included). Why: hashed ids spread hot and cold ids evenly over the rows, so a
range of 1/k of the rows gets about 1/k of the lookups with the same hot/cold shape (what the cost model's
`piece_features` assumes); a trace replays what its real ids put in the range (exact, even where the ids are
not spread evenly). The whole table's draw uses an rng of the table alone (seed, table id), the same for each
of its pieces, so a table's k ranges partition one batch's lookups exactly. The op is built with row_size rows
(then the memory rule above caps them like any table's; kept ids are remapped to distinct rows of the cap).

Replicas (kind `replicated`, a full copy on every one of D devices; docs/contracts.md, "Shard kinds"). A device
looks up only its own share of the batch: the table's batch of B samples is drawn as for a whole table and the
bags of all samples but the first ceil(B/D) are emptied (`keep_samples`), so the fused op does the lookups of
B/D samples of that table in its full table (rows capped by the memory rule like any table).
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from .. import schemas
from ..errors import EmbshardError
from ..features import MEASURED_WEIGHT_BYTES, REP_COUNTS
from ..ingest.synthetic import bag_lengths

WEIGHT_BYTES = MEASURED_WEIGHT_BYTES  # FP32 weights: the default where a table's precision is not given


@dataclass
class TableInput:
    """Spec of one table as measured: rows after scaling, dim (col_size where sliced), where its ids come from."""

    table_id: str
    rows: int            # original rows
    dim: int
    pooling_factor: float
    bins: np.ndarray     # (17,)
    trace_file: str | None = None
    trace_table_index: int = -1
    trace_pooling_factor: float | None = None  # trace_file's own mean bag length, where it is not pooling_factor
    scaled_rows: int | None = None
    row_offset: int = 0            # a row range [row_offset, row_offset + row_size) of the table (kind `row`)
    row_size: int | None = None    # None: all rows

    @property
    def piece_rows(self) -> int:
        """Rows of the piece measured before the memory cap: row_size of a row range, else the table's rows."""
        return int(self.row_size if self.row_size is not None else self.rows)

    @property
    def measured_rows(self) -> int:
        return int(self.scaled_rows if self.scaled_rows is not None else self.piece_rows)


def _stride(rows: int, rng: np.random.Generator) -> tuple[int, int]:
    """(offset, multiplier) of a bijection rank -> (offset + rank * multiplier) % rows."""
    if rows <= 1:
        return 0, 1
    while True:
        m = int(rng.integers(1, rows))
        if math.gcd(m, rows) == 1:
            return int(rng.integers(0, rows)), m


def _scatter(ranks: np.ndarray, rows: int, stride: tuple[int, int]) -> np.ndarray:
    a, m = stride
    # Python ints would be exact; int64 products overflow for rows near 1e8 * 1e8, so reduce first.
    r = np.asarray(ranks, dtype=np.int64) % rows
    return ((a + (r * (m % rows)) % rows) % rows if rows < 3_000_000_000 else (a + r) % rows).astype(np.int64)


def bin_counts(num_lookups: int, bins: np.ndarray, rows: int) -> np.ndarray:
    """Distinct ids per bin, n_k = U * f_k (at least one id when the batch has lookups)."""
    f = np.asarray(bins, dtype=np.float64)
    f = f / f.sum() if f.sum() > 0 else np.eye(schemas.NUM_BINS)[0]
    u = num_lookups / float((f * REP_COUNTS).sum())
    u = min(max(u, 1.0), float(rows))
    n = np.floor(u * f).astype(np.int64)
    # Largest remainders bring the total to round(u): small tables keep their hot ids.
    missing = int(round(u)) - int(n.sum())
    if missing > 0:
        order = np.argsort(-(u * f - n))
        n[order[:missing]] += 1
    return n


def sample_from_bins(num_lookups: int, bins: np.ndarray, rows: int, rng: np.random.Generator,
                     stride: tuple[int, int], batch_no: int = 0) -> np.ndarray:
    """`num_lookups` ids in [0, rows) whose access counts follow `bins` (see module doc)."""
    if num_lookups == 0:
        return np.zeros(0, dtype=np.int64)
    n = bin_counts(num_lookups, bins, rows)
    hot_ranks = int(n[1:].sum())
    # Hot ids: the same ranks in every batch, hottest first.
    reps = np.repeat(REP_COUNTS[1:].round().astype(np.int64), n[1:])
    hot = np.repeat(np.arange(hot_ranks, dtype=np.int64), reps)
    # Singletons: fresh ranks per rotated batch (cold rows), wrapping within the rows left.
    cold_space = max(rows - hot_ranks, 1)
    cold = hot_ranks + (batch_no * int(n[0]) + np.arange(n[0], dtype=np.int64)) % cold_space
    pool = np.concatenate([hot, cold])
    rng.shuffle(pool)
    if len(pool) >= num_lookups:
        ranks = pool[:num_lookups]
    else:
        ranks = np.concatenate([pool, pool[rng.integers(0, len(pool), num_lookups - len(pool))]])
    return _scatter(ranks, rows, stride)


def _trace(path: str, table_index: int) -> tuple[np.ndarray, np.ndarray, int, float]:
    """One table of a trace (indices, lengths, largest id, mean bag length), cached by the file's identity (a trace
    written again at the same path is read again: check_trace_matches then compares it with what was ingested)."""
    try:
        st = os.stat(path)
        stamp = (st.st_mtime_ns, st.st_size)
    except OSError:
        stamp = (0, 0)  # read_table_trace says the file is missing
    return _trace_at(path, stamp, int(table_index))


@lru_cache(maxsize=8)
def _trace_at(path: str, stamp: tuple, table_index: int  # noqa: ARG001 (the cache key)
              ) -> tuple[np.ndarray, np.ndarray, int, float]:
    try:
        from ..ingest.dlrm import read_table_trace
    except ImportError as exc:
        raise EmbshardError(f"cannot replay traces ({exc})", path=path, field="trace_file",
                            fix="install the ingest stage (embshard.ingest.dlrm) or drop trace_file") from None
    indices, lengths = read_table_trace(path, int(table_index))
    indices, lengths = np.asarray(indices, dtype=np.int64), np.asarray(lengths, dtype=np.int64)
    # what check_trace_matches compares, once per trace table (not at every shard that replays it)
    top = int(indices.max()) if len(indices) else -1
    return indices, lengths, top, float(lengths.sum()) / max(len(lengths), 1)


def check_trace_matches(t: TableInput, top: int, pooling: float) -> None:
    """The trace still holds what the table was ingested from: the same mean bag length (`pooling`; ingest's
    pooling factor came from the same lengths) and no id past the table's rows (`top`: its largest id). A trace
    regenerated at the same path (a daily export) would otherwise be replayed silently, its ids folded. A table
    ingested from several files of its trace replays the first, and its own bag length is compared
    (`trace_pooling_factor`)."""
    want = float(t.pooling_factor if t.trace_pooling_factor is None else t.trace_pooling_factor)
    if top >= int(t.rows) or not np.isclose(pooling, want, rtol=1e-9, atol=1e-12):
        found = (f"ids up to {top:,} for {int(t.rows):,} rows" if top >= int(t.rows)
                 else f"a mean bag length of {pooling:.6g}, ingested as {want:.6g}")
        raise EmbshardError(f"table {t.table_id} (trace table {int(t.trace_table_index)}) has {found}: the trace "
                            "changed since its tables were ingested", path=str(t.trace_file), field="trace_file",
                            fix="ingest the trace again (embshard ingest --source dlrm), then measure")


def trace_windows(t: TableInput, batch_size: int, num_batches: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Consecutive windows of `batch_size` samples of the table's trace (wrapping), ids remapped if scaled."""
    indices, lengths, top, pooling = _trace(str(t.trace_file), int(t.trace_table_index))
    total = len(lengths)
    if total == 0:
        raise EmbshardError("trace has no samples", path=str(t.trace_file), field="trace_table_index",
                            fix="re-ingest the trace")
    check_trace_matches(t, top, pooling)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    out = []
    for j in range(num_batches):
        samples = (j * batch_size + np.arange(batch_size)) % total
        lens = lengths[samples]
        starts = offsets[samples]
        # Gather each sample's ids: starts repeated by length plus the position inside the bag.
        pos = np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens, lens)
        out.append((indices[np.repeat(starts, lens) + pos], lens))
    rows = t.measured_rows
    if rows < t.rows or any(len(i) and i.max() >= rows for i, _ in out):
        out = fit_rows(out, rows)
    return out


def fit_rows(batches: list[tuple[np.ndarray, np.ndarray]], rows: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """The batches' ids remapped into [0, rows): distinct rows for distinct ids when they fit (the access
    structure is unchanged), else folded modulo rows."""
    if not batches or not sum(len(i) for i, _ in batches):
        return batches
    uniq, inv = np.unique(np.concatenate([i for i, _ in batches]), return_inverse=True)
    if len(uniq) <= rows:
        new = _scatter(np.arange(len(uniq)), rows, _stride(rows, np.random.default_rng(len(uniq))))
    else:
        new = uniq % rows
    mapped = new[inv]
    split = np.cumsum([len(i) for i, _ in batches])[:-1]
    return [(m, lens) for m, (_, lens) in zip(np.split(mapped, split), batches)]


def keep_range(indices: np.ndarray, lengths: np.ndarray, offset: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """The lookups of one batch (table-local `indices`, bag `lengths`) whose ids lie in [offset, offset + size),
    rebased to 0..size-1; the new lengths count each sample's kept ids."""
    indices = np.asarray(indices, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    keep = (indices >= offset) & (indices < offset + size)
    owner = np.repeat(np.arange(len(lengths)), lengths)
    return (indices[keep] - offset).astype(np.int64), np.bincount(owner[keep], minlength=len(lengths)).astype(np.int64)


def replica_share(batch_size: int, num_devices: int) -> int:
    """Samples of a B-sample batch one device of a D-device replica serves: ceil(B/D)."""
    return -(-int(batch_size) // max(int(num_devices), 1))


def keep_samples(indices: np.ndarray, lengths: np.ndarray, share: int) -> tuple[np.ndarray, np.ndarray]:
    """The lookups of the first `share` samples of one batch (the others' bags emptied; B stays the same)."""
    lengths = np.asarray(lengths, dtype=np.int64).copy()
    n = int(lengths[:share].sum())
    lengths[share:] = 0
    return np.asarray(indices, dtype=np.int64)[:n], lengths


def row_range_batches(t: TableInput, batch_size: int, num_batches: int, rng: np.random.Generator
                      ) -> list[tuple[np.ndarray, np.ndarray]]:
    """(indices, lengths) per rotated batch of a row range (t.row_size set): the whole table's batches (drawn
    with `rng`, or the trace) filtered to the range and rebased (module doc). Ids are in [0, row_size); the
    memory cap is applied by the caller (fit_rows)."""
    assert t.row_size is not None
    full = dataclasses.replace(t, row_offset=0, row_size=None, scaled_rows=None)
    if full.trace_file:
        whole = trace_windows(full, batch_size, num_batches)
    else:
        whole = table_batches(full, [bag_lengths(float(t.pooling_factor), batch_size, rng)
                                     for _ in range(num_batches)], rng)
    return [keep_range(i, ln, int(t.row_offset), int(t.row_size)) for i, ln in whole]


def table_lengths(t: TableInput, batch_size: int, num_batches: int, rng: np.random.Generator) -> list[np.ndarray]:
    if t.trace_file:
        return [lens for _, lens in trace_windows(t, batch_size, num_batches)]
    return [bag_lengths(float(t.pooling_factor), batch_size, rng) for _ in range(num_batches)]


def table_batches(t: TableInput, lengths: list[np.ndarray], rng: np.random.Generator
                  ) -> list[tuple[np.ndarray, np.ndarray]]:
    """(indices, lengths) per rotated batch for one table; `lengths` from `table_lengths`."""
    if t.trace_file:
        return trace_windows(t, len(lengths[0]), len(lengths))
    rows = t.measured_rows
    stride = _stride(rows, rng)
    return [(sample_from_bins(int(lens.sum()), t.bins, rows, rng, stride, j), lens)
            for j, lens in enumerate(lengths)]


def batch_bytes(total_lookups_per_batch: list[int], num_bags: int, batch_size: int, sum_dims: int,
                max_dim: int) -> int:
    """Bytes the inputs and the fwd/bwd temporaries need (indices+offsets per rotated batch, outputs, grads)."""
    idx = sum(8 * (2 * lk + num_bags + 1) for lk in total_lookups_per_batch)  # int64 ids (+ a copy) and offsets
    dense = 3 * batch_size * sum_dims * 4                                    # output, its grad, a temporary
    sparse_grad = max(total_lookups_per_batch, default=0) * (max_dim * 4 + 16)  # per-lookup grad rows, sort keys
    return int(idx + dense + sparse_grad)


def table_caps(rows: np.ndarray, dims: np.ndarray, budget_bytes: int, bytes_per_element=None) -> np.ndarray:
    """Each table's rows capped at `budget_bytes` of its own weights (at least one row), whatever else the shard
    holds (FP32 where `bytes_per_element` is not given)."""
    rows = np.asarray(rows, dtype=np.int64)
    row_bytes = np.asarray(dims, dtype=np.int64) * (WEIGHT_BYTES if bytes_per_element is None
                                                    else np.asarray(bytes_per_element, dtype=np.int64))
    return np.minimum(rows, np.maximum(int(budget_bytes) // np.maximum(row_bytes, 1), 1))


def row_cap(rows: np.ndarray, dims: np.ndarray, budget_bytes: int, bytes_per_element=None) -> int | None:
    """Largest C with sum(min(rows, C) * dims * bytes_per_element) <= budget (FP32 where not given), or None
    when no cap is needed."""
    rows = np.asarray(rows, dtype=np.int64)
    dims = np.asarray(dims, dtype=np.int64) * (WEIGHT_BYTES if bytes_per_element is None
                                               else np.asarray(bytes_per_element, dtype=np.int64))
    if int((rows * dims).sum()) <= budget_bytes:
        return None
    lo, hi = 0, int(rows.max())
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if int((np.minimum(rows, mid) * dims).sum()) <= budget_bytes:
            lo = mid
        else:
            hi = mid - 1
    return lo
