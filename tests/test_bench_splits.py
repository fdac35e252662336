"""Split shards measured on real kernels (issue 24): row ranges get their share of the table's lookups, column
slices their width; costs carry the pieces; the cost model featurises them as planners do and reports on them."""
from __future__ import annotations

import zlib

import numpy as np
import pandas as pd
import pytest

from embshard import pools, schemas
from embshard.bench import inputs, runner
from embshard.bench.runner import MeasureSettings
from embshard.bench.sampler import random_shards, split_shards
from embshard.errors import EmbshardError
from embshard.jobs.bench import run
from embshard.tableset import TableSet

FAST = dict(batch_size=256, warmup=2, iterations=10, comm_bandwidth_gbps=10.0, comm_latency_us=20.0)


@pytest.fixture(scope="module")
def tables_df():
    from embshard.ingest.synthetic import generate_tables

    return generate_tables(30, seed=3, bins_batch_size=2048)


@pytest.fixture(scope="module")
def ts(tables_df):
    return TableSet.from_frame(tables_df)


@pytest.fixture()
def tables_path(tmp_path, tables_df):
    p = tmp_path / "tables.parquet"
    schemas.write(tables_df, p, "tables")
    return str(p)


def _hot(ts) -> int:
    """The table with the most lookup work (pooling x dim) among those with >= 100k rows."""
    return int(np.argmax(np.where(ts.rows >= 100_000, ts.pooling_factor * ts.dims, 0)))


def _ranges(rows: int, k: int) -> list[tuple[int, int]]:
    return [(j * rows // k, (j + 1) * rows // k - j * rows // k) for j in range(k)]


def test_keep_range_filters_rebases_and_recounts():
    idx = np.array([5, 1, 9, 3, 7, 2], dtype=np.int64)
    lens = np.array([2, 0, 3, 1], dtype=np.int64)  # samples: [5, 1], [], [9, 3, 7], [2]
    got_i, got_l = inputs.keep_range(idx, lens, 2, 5)  # rows 2..6
    assert got_i.tolist() == [3, 1, 0] and got_l.tolist() == [1, 0, 1, 1]


def test_row_ranges_partition_the_tables_lookups(ts):
    t = _hot(ts)
    rows = int(ts.rows[t])
    cfg = MeasureSettings(batch_size=2048, **{k: v for k, v in FAST.items() if k != "batch_size"}).config()
    # The reference: the whole table's batches drawn with the table's own rng, as every piece draws them.
    spec = runner._table_inputs(ts, np.array([t]), None, [(0, rows)])[0]
    ref = inputs.row_range_batches(spec, cfg.batch_size, cfg.num_batches,
                                   np.random.default_rng([cfg.seed, zlib.crc32(spec.table_id.encode())]))
    total = sum(int(ln.sum()) for _, ln in ref)
    assert total > 10_000
    counts = []
    for off, size in _ranges(rows, 4):
        piece = runner.shard_inputs(ts, [t], cfg, row_ranges=[(off, size)])
        # Exactly the reference's lookups in the range, sample by sample (ids may be remapped by the row cap).
        for (i, ln), (ri, rl) in zip(piece.batches, ref):
            exp_i, exp_l = inputs.keep_range(ri, rl, off, size)
            assert ln.tolist() == exp_l.tolist() and len(i) == len(exp_i)
            assert len(i) == 0 or (i.min() >= 0 and i.max() < piece.rows[0])
        assert piece.rows[0] <= size and piece.dims == [int(ts.dims[t])]
        counts.append(sum(int(ln.sum()) for _, ln in piece.batches))
    assert sum(counts) == total  # the ranges partition the lookups
    shares = np.array(counts) / total
    assert (np.abs(shares - 0.25) < 0.1).all(), shares  # hashed ids: about 1/k each (fixed seed: no flake)


def test_four_way_row_split_measures_less_compute_per_piece_than_the_whole(ts):
    t = _hot(ts)
    cfg = MeasureSettings(batch_size=2048, **{k: v for k, v in FAST.items() if k != "batch_size"}).config()
    whole = runner.measure_shard(ts, [t], cfg, num_devices=4)
    pieces = [runner.measure_shard(ts, [t], cfg, num_devices=4, row_ranges=[r])
              for r in _ranges(int(ts.rows[t]), 4)]
    compute = [m["fwd_compute_ms"] + m["bwd_compute_ms"] for m in pieces]
    assert max(compute) < whole["fwd_compute_ms"] + whole["bwd_compute_ms"]
    # A row piece sends full-dim partial sums (same bytes as the whole table); a column slice sends narrower ones.
    assert all(m["fwd_comm_ms"] == pytest.approx(whole["fwd_comm_ms"]) for m in pieces)
    col = runner.measure_shard(ts, [t], cfg, num_devices=4, col_sizes=[int(ts.dims[t]) // 4])
    assert col["fwd_comm_ms"] < whole["fwd_comm_ms"]


def _split_shards_file(ts, path) -> tuple[str, pd.DataFrame]:
    t = _hot(ts)
    rows, dim = int(ts.rows[t]), int(ts.dims[t])
    other = str(ts.table_ids[(t + 1) % len(ts)])
    tid = str(ts.table_ids[t])
    df = pd.DataFrame({
        "sample_id": ["row-piece", "col-piece", "mixed", "whole"],
        "table_ids": [[tid], [tid], [tid, other], [tid]], "num_devices": [4, 4, 4, 4], "origin": ["given"] * 4,
        "col_sizes": [[-1], [dim // 2], [-1, -1], [-1]],
        "row_offsets": [[rows // 4], [-1], [0, -1], [-1]],
        "row_sizes": [[rows // 4], [-1], [rows // 8, -1], [-1]]})
    schemas.write(df, path, "shards")
    return str(path), df


def test_bench_run_writes_costs_with_the_pieces(ts, tables_path, tmp_path):
    shards, given = _split_shards_file(ts, tmp_path / "shards.parquet")
    parts = run(tables_path, shards, str(tmp_path / "out"), MeasureSettings(**FAST), progress=False)
    costs = schemas.read(str(tmp_path / "out" / "costs"), "costs").set_index("sample_id")
    for _, g in given.iterrows():
        row = costs.loc[g["sample_id"]]
        for c in ("col_sizes", "row_offsets", "row_sizes"):
            assert list(row[c]) == list(g[c])
        assert row["fwd_compute_ms"] > 0 and row["bwd_compute_ms"] > 0 and row["fwd_comm_ms"] > 0
    # Round trip through the contract: the piece lists keep their values and types.
    again = schemas.read(parts[0], "costs")
    schemas.write(again, tmp_path / "again.parquet", "costs")
    back = schemas.read(str(tmp_path / "again.parquet"), "costs")
    assert back["row_sizes"].map(list).tolist() == again["row_sizes"].map(list).tolist()
    # Old costs without the columns still read.
    schemas.write(again.drop(columns=["col_sizes", "row_offsets", "row_sizes"]), tmp_path / "old.parquet", "costs")
    assert "row_sizes" not in schemas.read(str(tmp_path / "old.parquet"), "costs").columns


def test_bad_pieces_are_one_line_errors_naming_file_and_field(ts, tables_path, tmp_path):
    t = str(ts.table_ids[0])
    rows = int(ts.rows[0])
    base = {"sample_id": ["s"], "table_ids": [[t]], "num_devices": [2], "origin": ["given"]}
    cases = {"row_offsets": {"row_offsets": [[rows - 1]], "row_sizes": [[2]]},
             "row_sizes": {"row_offsets": [[0]], "row_sizes": [[-3]]},
             "col_sizes": {"col_sizes": [[6]]}}
    for field, extra in cases.items():
        path = tmp_path / f"{field}.parquet"
        pd.DataFrame({**base, **extra}).to_parquet(path)
        with pytest.raises(EmbshardError) as err:
            run(tables_path, str(path), str(tmp_path / f"out-{field}"), MeasureSettings(**FAST), progress=False)
        assert str(path) in str(err.value) and f"'{field}'" in str(err.value) and "\n" not in str(err.value)


def _synthetic_costs(tables_df, seed=0) -> pd.DataFrame:
    """Costs rows on train-pool tables, a third of them with a row range or a column slice."""
    tdf = schemas.validate(tables_df, "tables")
    train = [t for t, p in zip(tdf["table_id"], pools.of(tdf, seed)) if p == "train"]
    df = split_shards(random_shards(train, 60, max_tables=4, seed=seed), TableSet.from_frame(tdf), share=0.4,
                      seed=seed)
    rng = np.random.default_rng(seed)
    n = len(df)
    return df.assign(fwd_compute_ms=rng.uniform(0.5, 2, n), bwd_compute_ms=rng.uniform(1, 4, n),
                     fwd_comm_ms=0.1, bwd_comm_ms=0.1, hardware="cpu:test", backend="fbgemm", batch_size=256,
                     iterations=10, measured_at=pd.Timestamp.now(tz="UTC"))


def test_cost_data_features_split_pieces_as_planners_score_them(tables_df, tables_path, tmp_path):
    from embshard.costmodel.data import entry_pieces, load
    from embshard.costmodel.scoring import piece_features
    from embshard.types import Shard

    cdf = _synthetic_costs(tables_df)
    schemas.write(cdf, tmp_path / "costs.parquet", "costs")
    data = load(str(tmp_path / "costs.parquet"), tables_path)
    ts = TableSet.from_frame(schemas.validate(tables_df, "tables"))
    assert data.is_split.any() and (~data.is_split).any()
    for s in range(len(data.frame)):
        row = data.frame.iloc[s]
        tabs = ts.index_of(list(row["table_ids"]))
        want = piece_features(ts, [Shard(int(t), 0, col_size=c, row_offset=o, row_size=z)
                                   for t, (c, o, z) in zip(tabs, entry_pieces(row, len(tabs)))])
        np.testing.assert_array_equal(data.features[data.shards[s]], want)
        assert data.tables_of(data.shards[s]).tolist() == tabs.tolist()
        assert data.is_split[s] == any(c is not None or z is not None for c, _, z in entry_pieces(row, len(tabs)))


def test_report_gives_split_shard_accuracy_separately(tables_df, tables_path, tmp_path):
    from embshard.costmodel.data import load
    from embshard.jobs.train_cost import kind_breakdown, summary_table

    schemas.write(_synthetic_costs(tables_df), tmp_path / "costs.parquet", "costs")
    data = load(str(tmp_path / "costs.parquet"), tables_path)
    idx = np.arange(len(data.frame))
    learned = data.targets[idx] * np.where(data.split_mask(idx), 1.2, 1.1)[:, None]
    rep = kind_breakdown(learned, data, idx)
    assert rep["split"]["n"] == int(data.is_split.sum()) and rep["whole"]["n"] == int((~data.is_split).sum())
    assert rep["split"]["mape"] == pytest.approx(20.0) and rep["whole"]["mape"] == pytest.approx(10.0)
    assert np.isfinite(rep["split"]["spearman"])
    m = {"mape": 1.0, "rmse": 1.0, "spearman": 1.0, "n": 3}
    text = summary_table({"heldout": {"n_shards": 3, "n_compared": 3, "by_shard_kind": rep,
                                      **{e: {h: m for h in ("fwd_compute", "bwd_compute", "total_compute",
                                                             "comm", "total")}
                                         for e in ("learned", "sum_singles", "analytic")}}})
    assert "split shards" in text and "split MAPE 20.0%" in text


def test_report_gives_fp16_shard_accuracy_separately(tables_df, tmp_path):
    """Shards holding an FP16 table (split pieces too) are scored apart from FP32-only ones: the model tells the
    types apart by a table's bytes per row, so it prices FP16 only where it measured it."""
    from embshard.costmodel.data import load
    from embshard.jobs.train_cost import element_breakdown, summary_table

    df = tables_df.copy()
    half = df.index % 3 == 0
    df.loc[half, "bytes_per_element"] = 2
    df["size_bytes"] = df["rows"] * df["dim"] * df["bytes_per_element"]
    schemas.write(df, tmp_path / "tables.parquet", "tables")
    schemas.write(_synthetic_costs(df), tmp_path / "costs.parquet", "costs")
    data = load(str(tmp_path / "costs.parquet"), str(tmp_path / "tables.parquet"))
    fp16_ids = set(df.loc[half, "table_id"])
    want = np.array([bool(set(v) & fp16_ids) for v in data.frame["table_ids"]])
    assert data.element_bytes == (2, 4) and (data.holds_fp16 == want).all()
    assert (want & data.is_split).any() and 0 < want.sum() < len(want)  # split pieces of FP16 tables included
    idx = np.arange(len(data.frame))
    learned = data.targets[idx] * np.where(want, 1.3, 1.05)[:, None]
    rep = element_breakdown(learned, data, idx)
    assert rep["holds_fp16"]["n"] == want.sum() and rep["fp32_only"]["n"] == (~want).sum()
    assert rep["holds_fp16"]["mape"] == pytest.approx(30.0) and rep["fp32_only"]["mape"] == pytest.approx(5.0)
    m = {"mape": 1.0, "rmse": 1.0, "spearman": 1.0, "n": 3}
    text = summary_table({"heldout": {"n_shards": 3, "n_compared": 3, "by_element_type": rep,
                                      **{e: {h: m for h in ("fwd_compute", "bwd_compute", "total_compute",
                                                             "comm", "total")}
                                         for e in ("learned", "sum_singles", "analytic")}}})
    assert "by weight type: holds_fp16 MAPE 30.0%" in text


def test_sampler_emits_split_pieces_at_the_rate_deterministically(ts):
    base = random_shards(list(ts.table_ids), 400, seed=5)
    a = split_shards(base, ts, seed=5)
    b = split_shards(base, ts, seed=5)
    pd.testing.assert_frame_equal(a, b)
    assert a["table_ids"].map(tuple).tolist() == base["table_ids"].map(tuple).tolist()  # same tables, same count
    split = [k for k in range(len(a)) if max(a["col_sizes"][k]) > 0 or max(a["row_sizes"][k]) > 0]
    assert 0.17 < len(split) / len(a) < 0.33  # SPLIT_SHARE = 0.25 of 400 (binomial sd 0.022)
    work = ts.pooling_factor * ts.dims
    picked = []
    for k in split:
        ids, cols, offs, sizes = (a[c][k] for c in ("table_ids", "col_sizes", "row_offsets", "row_sizes"))
        for tid, c, o, z in zip(ids, cols, offs, sizes):
            t = int(ts.index_of([tid])[0])
            if c > 0:
                assert c % 4 == 0 and c < ts.dims[t]
                picked.append(work[t])
            if z > 0:
                assert o >= 0 and o + z <= ts.rows[t]
                assert any(z in (ts.rows[t] // k, ts.rows[t] // k + 1) for k in (2, 4, 8, 16))  # k equal ranges
                picked.append(work[t])
    assert len(picked) == len(split)  # one piece per split shard
    # Biased toward the tables with the most lookup work: above the work of a table drawn uniformly.
    assert np.median(picked) > np.median(work)


def test_plan_shards_keep_the_pieces_of_split_plans():
    from embshard.ingest.synthetic import generate_tables
    from embshard.jobs.shards import plan_shards

    big = TableSet.from_frame(generate_tables(220, seed=5, bins_batch_size=2048))
    a = plan_shards(big, 60, memory_bytes_per_device=2**40, seed=4)
    assert len(a) == 60
    split = a[a["origin"].str.contains(r"\+split")]
    has_piece = split.apply(lambda r: max(r["col_sizes"]) > 0 or max(r["row_sizes"]) > 0, axis=1)
    assert has_piece.any()
    unsplit = a[~a["origin"].str.contains(r"\+split")]
    assert unsplit.apply(lambda r: max(r["col_sizes"]) < 0 and max(r["row_sizes"]) < 0, axis=1).all()
