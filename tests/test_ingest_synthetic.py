"""The synthetic source: a realistic, seeded population; traces it writes are replayable."""
from __future__ import annotations

import os

import numpy as np
import pandas as pd
import pytest

from embshard import schemas
from embshard.cli import main as cli
from embshard.features import access_bins
from embshard.ingest import dlrm
from embshard.jobs.ingest import run


def test_856_tables_population(tmp_path):
    out = tmp_path / "out"
    # the default bins batch is 65,536 samples (~15 s for 856 tables); a small one keeps the test quick
    assert cli(["ingest", "--source", "synthetic", "--num-tables", "856", "--seed", "0", "--out", str(out),
                "--bins-batch-size", "512", "--no-progress"]) == 0
    df = schemas.read(out / "tables.parquet", "tables")
    assert len(df) == 856 and df["table_id"].is_unique
    assert df["rows"].between(10, 10**8).all() and df["rows"].min() < 1000 and df["rows"].max() > 10**7
    assert set(df["dim"]) == {4, 8, 16, 32, 64, 128, 256}
    pf = df["pooling_factor"]
    assert (pf == 1.0).mean() > 0.15 and pf.max() > 10 * pf.median()  # many one-hot, a heavy tail
    assert df["zipf_alpha"].between(0, 1.4).all() and df["zipf_alpha"].std() > 0.3
    assert (df["size_bytes"] == df["rows"] * df["dim"] * 4).all()
    # same seed, same tables; another seed, other tables
    again = run("synthetic", str(tmp_path / "again"), seed=0, num_tables=856, bins_batch_size=512,
                progress=False)
    other = run("synthetic", str(tmp_path / "other"), seed=1, num_tables=856, bins_batch_size=512,
                progress=False)
    assert schemas.read(again, "tables").equals(df)
    assert not np.array_equal(schemas.read(other, "tables")["rows"], df["rows"])


@pytest.mark.parametrize("layout", ["flat", "per_table"])
def test_write_traces_rows_point_at_replayable_indices(tmp_path, layout):
    out = tmp_path / "out"
    assert cli(["ingest", "--source", "synthetic", "--num-tables", "12", "--seed", "2", "--out", str(out),
                "--write-traces", "--trace-batch-size", "128", "--trace-layout", layout, "--no-progress"]) == 0
    df = schemas.read(out / "tables.parquet", "tables")
    trace = str(out / "traces.pt")
    assert os.path.isfile(trace)
    assert (df["trace_file"] == os.path.abspath(trace)).all()
    assert df["trace_table_index"].tolist() == list(range(12))
    plain = run("synthetic", str(tmp_path / "plain"), seed=2, num_tables=12, progress=False)
    plain = schemas.read(plain, "tables")
    # shapes are the generator's; pooling and bins are those of the written indices
    assert df["rows"].tolist() == plain["rows"].tolist() and df["dim"].tolist() == plain["dim"].tolist()
    for t in range(12):
        idx, lengths = dlrm.read_table_trace(trace, t)
        assert lengths.shape == (128,) and (idx < df["rows"][t]).all()
        assert df["pooling_factor"][t] == pytest.approx(lengths.sum() / 128)
        np.testing.assert_allclose(df.loc[t, schemas.BIN_COLUMNS].to_numpy(float), access_bins(idx))


def test_hot_large_fraction_draws_large_multi_hot_tables_and_leaves_the_others_alone(tmp_path):
    from embshard.ingest.synthetic import sample_population

    base = sample_population(2000, seed=3)
    hot = sample_population(2000, seed=3, hot_large_fraction=0.05)
    changed = (hot[["rows", "pooling_factor", "zipf_alpha"]] != base[["rows", "pooling_factor", "zipf_alpha"]]).any(
        axis=1)
    drawn = hot[changed]
    assert 0.03 < changed.mean() < 0.07           # about the fraction asked for; the other tables are untouched
    assert (drawn["rows"] >= 10**7).all() and drawn["pooling_factor"].between(20, 120).all()
    assert (drawn["pooling_factor"] >= 50).mean() > 0.3
    assert ((base["rows"] >= 10**7) & (base["pooling_factor"] >= 50)).mean() < 0.003  # rare without it
    assert (hot["dim"] == base["dim"]).all()        # a drawn table keeps its dim: cuts of every width get measured
    assert cli(["ingest", "--source", "synthetic", "--num-tables", "40", "--hot-large-fraction", "0.1",
                "--bins-batch-size", "256", "--out", str(tmp_path / "o"), "--no-progress"]) == 0
    df = schemas.read(tmp_path / "o" / "tables.parquet", "tables")
    assert ((df["rows"] >= 10**7) & (df["pooling_factor"] >= 20)).any()


def test_fp16_fraction_draws_fp16_tables_and_leaves_their_shapes_alone(tmp_path, capsys):
    from embshard.ingest.synthetic import generate_tables

    base = generate_tables(400, seed=5, bins_batch_size=256)
    mixed = generate_tables(400, seed=5, bins_batch_size=256, fp16_fraction=0.25)
    half = mixed["bytes_per_element"] == 2
    assert (base["bytes_per_element"] == 4).all()
    assert 0.18 < half.mean() < 0.32 and set(mixed["bytes_per_element"]) == {2, 4}  # about the fraction asked for
    # only the weight type and its bytes change: shapes and accesses are the same tables'
    same = ["table_id", "rows", "dim", "pooling_factor", "zipf_alpha", *schemas.BIN_COLUMNS]
    pd.testing.assert_frame_equal(mixed[same], base[same])
    assert (mixed["size_bytes"] == mixed["rows"] * mixed["dim"] * mixed["bytes_per_element"]).all()
    # `embshard ingest` draws them on asking (the pipeline's fp16_fraction, 0 by default)
    assert cli(["ingest", "--source", "synthetic", "--num-tables", "60", "--fp16-fraction", "0.5",
                "--bins-batch-size", "256", "--out", str(tmp_path / "o"), "--no-progress"]) == 0
    df = schemas.read(tmp_path / "o" / "tables.parquet", "tables")
    assert set(df["bytes_per_element"]) == {2, 4}
    assert f"{int((df['bytes_per_element'] == 2).sum())} of them FP16" in capsys.readouterr().out  # said, not hidden
    # traces written: the types are kept beside the traced pooling and bins
    assert cli(["ingest", "--source", "synthetic", "--num-tables", "12", "--fp16-fraction", "0.5", "--write-traces",
                "--trace-batch-size", "64", "--out", str(tmp_path / "t"), "--no-progress"]) == 0
    traced = schemas.read(tmp_path / "t" / "tables.parquet", "tables")
    want = generate_tables(12, seed=0, bins_batch_size=64, fp16_fraction=0.5)["bytes_per_element"].to_numpy()
    assert (traced["bytes_per_element"].to_numpy() == want).all() and (want == 2).any()
    assert (traced["size_bytes"] == traced["rows"] * traced["dim"] * traced["bytes_per_element"]).all()


def test_bad_synthetic_requests(tmp_path, capsys):
    out = tmp_path / "out"
    assert cli(["ingest", "--source", "synthetic", "--num-tables", "0", "--out", str(out)]) == 2
    assert "num_tables" in capsys.readouterr().err
    with pytest.raises(Exception, match="layout"):
        run("synthetic", str(out), num_tables=3, write_traces=True, trace_layout="diagonal", progress=False)
    with pytest.raises(Exception, match="does not apply"):
        run("synthetic", str(out), num_tables=3, dim=16)
    for bad in ("1.5", "nan", "-0.1"):
        assert cli(["ingest", "--source", "synthetic", "--num-tables", "3", "--hot-large-fraction", bad,
                    "--out", str(out)]) == 2
        assert "hot_large_fraction" in capsys.readouterr().err
        assert cli(["ingest", "--source", "synthetic", "--num-tables", "3", "--fp16-fraction", bad,
                    "--out", str(out)]) == 2
        assert "fp16_fraction" in capsys.readouterr().err
    with pytest.raises(Exception, match="fp16_fraction.*every table is FP16 already"):  # a share of all: no-op
        run("synthetic", str(out), num_tables=3, bytes_per_element=2, fp16_fraction=0.5, progress=False)
    assert cli(["ingest", "--source", "spec", "--input", "x.csv", "--fp16-fraction", "0.5", "--out", str(out)]) == 2
    assert "--fp16-fraction" in capsys.readouterr().err  # another source's tables have their own types
    assert not out.exists() or os.listdir(out) == []


def test_a_killed_re_ingest_never_leaves_tables_over_other_traces_or_old_tasks(tmp_path, monkeypatch):
    """Traces and the tables that point at them are one pair: a re-ingest killed after its traces took their name
    had left the old tables over the new traces (bench measured them without a word), and one killed before it
    removed the old tasks left them beside the new tables. Killed at the rename now: no tables (and no tasks) are
    left, and no temporary traces; run again, the pair is the new one."""
    from embshard.jobs import tasks as tasks_job

    out = tmp_path / "out"
    assert run("synthetic", str(out), seed=0, num_tables=12, write_traces=True, trace_batch_size=64, progress=False)
    tasks_job.run(str(out / "tables.parquet"), str(out), num_tasks=1, tables_per_task=4, devices=2, memory_gb=1)
    assert (out / "tasks.parquet").exists()

    real_replace = os.replace

    def killed(src, dst):  # a SIGTERM (embshard.signals) at the moment the new traces take their name
        if os.path.basename(src).startswith(".traces.pt.tmp-"):
            raise KeyboardInterrupt
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        run("synthetic", str(out), seed=1, num_tables=12, write_traces=True, trace_batch_size=64, progress=False)
    monkeypatch.undo()
    assert not (out / "tables.parquet").exists() and not (out / "tasks.parquet").exists()
    assert sorted(p.name for p in out.iterdir()) == ["traces.pt"]  # the old traces, alone; no temporary file
    run("synthetic", str(out), seed=1, num_tables=12, write_traces=True, trace_batch_size=64, progress=False)
    df = schemas.read(out / "tables.parquet", "tables")
    idx, lengths = dlrm.read_table_trace(str(out / "traces.pt"), 0)
    assert df["pooling_factor"][0] == pytest.approx(lengths.sum() / 64)
