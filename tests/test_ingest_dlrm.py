"""DLRM-format traces: writer -> loader round trips in every layout, hand-made files, and bad input."""
from __future__ import annotations

import gzip
import os

import numpy as np
import pytest
import torch

from embshard import schemas
from embshard.cli import main as cli
from embshard.features import access_bins
from embshard.ingest import dlrm
from embshard.ingest.synthetic import generate_tables, write_dlrm_traces


@pytest.fixture(scope="module")
def tables():
    # small shapes, a mix of pooling factors (incl. < 1) and skews
    return generate_tables(7, seed=3, bins_batch_size=256)


def _direct(path):
    """Per-table (indices, lengths) straight from torch.load, without the loader under test."""
    if path.endswith(".gz"):
        with gzip.open(path, "rb") as f:
            indices, offsets, lengths = torch.load(f, weights_only=True)
    else:
        indices, offsets, lengths = torch.load(path, weights_only=True)
    T, B = lengths.shape
    out, pos = [], 0
    for t in range(T):
        n = int(lengths[t].sum())
        out.append((indices[pos:pos + n].numpy(), lengths[t].numpy()))
        pos += n
    return out


@pytest.mark.parametrize("layout,name", [("flat", "tr.pt"), ("per_table", "tr.pt"),
                                         ("per_table_cumulative", "tr.pt"), ("flat", "tr.pt.gz")])
def test_round_trip_features_equal_direct_computation(tmp_path, tables, layout, name):
    path = str(tmp_path / name)
    write_dlrm_traces(tables, path, batch_size=64, seed=5, layout=layout)
    raw = torch.load(path, weights_only=True) if not name.endswith(".gz") else None
    if raw is not None:
        assert raw[1].shape == ((7 * 64 + 1,) if layout == "flat" else (7, 65))
        if layout == "per_table":
            assert (raw[1][:, 0] == 0).all()
    out = tmp_path / "out"
    assert cli(["ingest", "--source", "dlrm", "--input", path, "--out", str(out), "--dim", "32",
                "--no-progress"]) == 0
    df = schemas.read(out / "tables.parquet", "tables")
    direct = _direct(path)
    assert len(df) == len(direct) == 7
    for t, (idx, lengths) in enumerate(direct):
        row = df.iloc[t]
        assert row["trace_table_index"] == t and row["trace_file"] == os.path.abspath(path)
        assert row["rows"] == (idx.max() + 1 if idx.size else 1)
        assert row["pooling_factor"] == pytest.approx(lengths.sum() / 64)
        np.testing.assert_allclose(row[schemas.BIN_COLUMNS].to_numpy(float), access_bins(idx))
        got_idx, got_len = dlrm.read_table_trace(path, t)
        assert got_idx.dtype == np.int64 and got_len.dtype == np.int64 and got_len.shape == (64,)
        np.testing.assert_array_equal(got_idx, idx)
        np.testing.assert_array_equal(got_len, lengths)
    assert (df["dim"] == 32).all() and (df["size_bytes"] == df["rows"] * 32 * 4).all()
    assert "dim=32" in df["source"].iloc[0] and "rows=max-index+1" in df["source"].iloc[0]


def _hand_made(layout):
    # table 0: samples [3,3] [] [5]; table 1: samples [0] [0,0,0] [1]
    indices = torch.tensor([3, 3, 5, 0, 0, 0, 0, 1])
    lengths = torch.tensor([[2, 0, 1], [1, 3, 1]])
    if layout == "flat":
        offsets = torch.tensor([0, 2, 2, 3, 4, 7, 8])
    elif layout == "local":
        offsets = torch.tensor([[0, 2, 2, 3], [0, 1, 4, 5]])
    else:
        offsets = torch.tensor([[0, 2, 2, 3], [3, 4, 7, 8]])
    return indices, offsets, lengths


@pytest.mark.parametrize("layout", ["flat", "local", "cumulative"])
def test_hand_made_trace(tmp_path, layout):
    path = tmp_path / "h.pt"
    torch.save(_hand_made(layout), path)
    df = dlrm.tables_from_trace(str(path), dlrm.TraceOptions(dim=8, data_type="fp16"), progress=False)
    assert df["rows"].tolist() == [6, 2]
    assert df["pooling_factor"].tolist() == pytest.approx([1.0, 5 / 3])
    assert df["bytes_per_element"].tolist() == [2, 2] and df["size_bytes"].tolist() == [6 * 8 * 2, 2 * 8 * 2]
    # table 0: index 3 twice (bin 1), 5 once (bin 0); table 1: index 0 four times (bin 2), 1 once (bin 0)
    b = df[schemas.BIN_COLUMNS].to_numpy()
    np.testing.assert_allclose(b[0, :3], [0.5, 0.5, 0.0])
    np.testing.assert_allclose(b[1, :3], [0.5, 0.0, 0.5])
    idx, lens = dlrm.read_table_trace(str(path), 1)
    assert idx.tolist() == [0, 0, 0, 0, 1] and lens.tolist() == [1, 3, 1]


def test_dict_int32_and_legacy_formats(tmp_path):
    ind, off, lens = _hand_made("flat")
    torch.save({"indices": ind.int(), "offsets": off.int(), "lengths": lens}, tmp_path / "d.pt")
    torch.save((ind, off, lens), tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    for name in ("d.pt", "legacy.pt"):
        df = dlrm.tables_from_trace(str(tmp_path / name), progress=False)
        assert df["rows"].tolist() == [6, 2], name
        assert dlrm.read_table_trace(str(tmp_path / name), 0)[0].dtype == np.int64


def test_options_rows_file_mixed_dims_and_first_n(tmp_path, tables):
    path = str(tmp_path / "tr.pt")
    write_dlrm_traces(tables, path, batch_size=32, seed=1)
    rows_file = tmp_path / "rows.txt"
    rows_file.write_text(",".join(str(r) for r in tables["rows"]))
    a = dlrm.tables_from_trace(path, dlrm.TraceOptions(rows_file=str(rows_file), seed=4), progress=False)
    b = dlrm.tables_from_trace(path, dlrm.TraceOptions(seed=4, num_tables=3), progress=False)
    assert a["rows"].tolist() == tables["rows"].tolist()
    assert set(a["dim"]) <= {4, 8, 16, 32, 64, 128, 256}
    assert len(b) == 3 and b["dim"].tolist() == a["dim"].tolist()[:3]  # same seeded dims
    assert "rows=file:" in a["source"].iloc[0] and "dim=mixed(seed=4)" in a["source"].iloc[0]


def test_gz_temp_copy_is_removed(tmp_path, tables):
    path = str(tmp_path / "tr.pt.gz")
    write_dlrm_traces(tables, path, batch_size=16, seed=1)
    scratch = tmp_path / "scratch"
    with dlrm.TraceFile(path, tmp_dir=str(scratch)) as trace:
        assert trace.num_tables == 7 and len(os.listdir(scratch)) == 1
        trace.table(6)
    assert os.listdir(scratch) == []


def _fails(capsys, argv, *words):
    assert cli(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err  # one line
    for w in words:
        assert w in err, err
    return err


def test_bad_trace_files(tmp_path, capsys, tables):
    good = tmp_path / "good.pt"
    write_dlrm_traces(tables, str(good), batch_size=16, seed=1)
    data = good.read_bytes()
    (tmp_path / "trunc.pt").write_bytes(data[: len(data) // 2])
    (tmp_path / "junk.pt").write_bytes(b"this is not a torch file at all")
    gz = gzip.compress(data)
    (tmp_path / "trunc.pt.gz").write_bytes(gz[: len(gz) // 2])
    (tmp_path / "corrupt.pt.gz").write_bytes(gz[:20] + b"\x00" * 64 + gz[84:])
    ind, off, lens = _hand_made("flat")
    torch.save((ind[:-1], off, lens), tmp_path / "short.pt")  # offsets promise more indices than stored
    torch.save((ind, off.float(), lens), tmp_path / "float.pt")
    torch.save([ind], tmp_path / "one.pt")
    torch.save((ind, off, lens.to_sparse()), tmp_path / "sparse.pt")  # a traceback (exit 1) before
    torch.save((ind.to("meta"), off, lens), tmp_path / "meta.pt")
    out = tmp_path / "out"
    base = ["ingest", "--source", "dlrm", "--out", str(out), "--no-progress", "--input"]
    _fails(capsys, base + [str(tmp_path / "missing.pt")], "missing.pt", "not found")
    for name in ("trunc.pt", "junk.pt", "trunc.pt.gz", "corrupt.pt.gz"):
        _fails(capsys, base + [str(tmp_path / name)], name, "corrupt", "fix:")
    _fails(capsys, base + [str(tmp_path / "short.pt")], "short.pt", "field 'offsets'")
    _fails(capsys, base + [str(tmp_path / "float.pt")], "float.pt", "field 'offsets'", "integer")
    _fails(capsys, base + [str(tmp_path / "one.pt")], "one.pt", "not (indices, offsets, lengths)")
    _fails(capsys, base + [str(tmp_path / "sparse.pt")], "sparse.pt", "field 'lengths'", "sparse_coo", "dense")
    _fails(capsys, base + [str(tmp_path / "meta.pt")], "meta.pt", "field 'indices'", "meta tensor")
    small_rows = tmp_path / "rows.txt"
    small_rows.write_text("1\n" * 7)
    _fails(capsys, base + [str(good), "--rows-file", str(small_rows)], "rows.txt", "field 'rows'")
    grouped = tmp_path / "grouped.txt"  # thousands separators: the commas split each size in three
    grouped.write_text("2,000,000\n" * len(tables))
    _fails(capsys, base + [str(good), "--rows-file", str(grouped)], "grouped.txt", "write 2000000, not 2,000,000")
    _fails(capsys, base + [str(good), "--dim", "0"], "field 'dim'")
    assert not out.exists() or os.listdir(out) == []  # nothing half-written
    assert [f for f in os.listdir(tmp_path) if ".embshard-trace-" in f] == []


def test_pages_handed_back_are_read_again_intact(tmp_path, tables):
    # TraceFile drops the pages of a table it has read (madvise): reading again must give the same data
    path = str(tmp_path / "tr.pt")
    write_dlrm_traces(tables, path, batch_size=2048, seed=9)
    direct = _direct(path)
    with dlrm.TraceFile(path) as trace:
        assert trace.mapped
        for _ in range(2):
            for t in range(trace.num_tables):
                np.testing.assert_array_equal(trace.table(t)[0], direct[t][0])


def test_a_stray_raw_id_or_an_unread_table_is_warned_about(tmp_path, caplog):
    """One stray id of 2^40 made a 65,536 GiB table, and a table without lookups became rows=1, pooling 0, both
    silently: ingest goes on (the trace may be right) but says which tables look wrong."""
    import logging

    # table 0: ids 3, 3 and a stray 2^40; table 1: no lookups; table 2: ordinary
    indices = torch.tensor([3, 3, 2 ** 40, 0, 1, 1])
    lengths = torch.tensor([[2, 1, 0], [0, 0, 0], [1, 2, 0]])
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.flatten().cumsum(0)])
    path = tmp_path / "odd.pt"
    torch.save((indices, offsets, lengths), path)
    with caplog.at_level(logging.WARNING, logger="embshard.ingest.dlrm"):
        df = dlrm.tables_from_trace(str(path), dlrm.TraceOptions(dim=8), progress=False)
    assert df["rows"].tolist() == [2 ** 40 + 1, 1, 2]
    warned = [r.getMessage() for r in caplog.records if "access bins" not in r.getMessage()]  # batch: below
    assert len(warned) == 2, warned
    assert "t0000 (1,099,511,627,777 rows)" in warned[0] and "--rows-file" in warned[0]
    assert "t0001" in warned[1] and "no lookups" in warned[1] and "t0002" not in " ".join(warned)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="embshard.ingest.dlrm"):  # an ordinary trace: no warning
        torch.save(_hand_made("flat"), tmp_path / "h.pt")
        dlrm.tables_from_trace(str(tmp_path / "h.pt"), dlrm.TraceOptions(dim=8), progress=False)
    assert [r.getMessage() for r in caplog.records if "access bins" not in r.getMessage()] == []


def test_a_trace_batch_other_than_the_bins_batch_is_warned_about(tmp_path, caplog, tables):
    """Bins are defined on 65,536 samples; an id's count grows with the batch, so a user's trace of 4,096 samples
    read its tables colder (1.0-3.8x fewer lookups per id), silently. The synthetic source's own traces are its
    choice: no warning."""
    import logging

    torch.save(_hand_made("flat"), tmp_path / "h.pt")
    with caplog.at_level(logging.WARNING, logger="embshard.ingest.dlrm"):
        dlrm.tables_from_trace(str(tmp_path / "h.pt"), dlrm.TraceOptions(dim=8), progress=False)
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "batch of 3 samples" in warned[0] and "65,536" in warned[0], warned
    assert "colder" in warned[0] and "fix:" in warned[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="embshard.ingest.dlrm"):
        assert cli(["ingest", "--source", "synthetic", "--num-tables", "4", "--write-traces", "--trace-batch-size",
                    "64", "--out", str(tmp_path / "syn"), "--no-progress"]) == 0
    assert [r.getMessage() for r in caplog.records if "access bins" in r.getMessage()] == []


def test_trace_errors_name_what_is_wrong(tmp_path, tables):
    """Offsets that go backwards inside a table are named as offsets (they had been reported as lengths that
    disagree with them); every table a --rows-file makes too small is named in one error, not one per run; the
    source records the rows file's absolute path."""
    ind, off, lens = _hand_made("flat")
    bad = off.clone()
    bad[1], bad[2] = 3, 1  # table 0: offsets 0, 3, 1, 3
    torch.save((ind, bad, lens), tmp_path / "back.pt")
    with pytest.raises(dlrm.EmbshardError) as exc:
        dlrm.tables_from_trace(str(tmp_path / "back.pt"), dlrm.TraceOptions(dim=8), progress=False)
    assert exc.value.field == "offsets" and "offsets decrease in table 0" in str(exc.value)
    torch.save(_hand_made("flat"), tmp_path / "h.pt")  # table 0 uses index 5, table 1 index 1
    (tmp_path / "rows.txt").write_text("2 1")
    with pytest.raises(dlrm.EmbshardError) as exc:
        dlrm.tables_from_trace(str(tmp_path / "h.pt"), dlrm.TraceOptions(dim=8, rows_file=str(tmp_path / "rows.txt")),
                               progress=False)
    assert "table 0 uses index 5 but has 2 rows; table 1 uses index 1 but has 1 rows" in str(exc.value)
    # a stray id of 2^40 against a small hash size: the same one line, not a bincount of 2^40 counters
    torch.save((torch.tensor([1, 2, 3, 2 ** 40, 1, 2, 3, 4]), torch.tensor([0, 2, 4, 6, 8]),
                torch.tensor([[2, 2], [2, 2]])), tmp_path / "stray.pt")
    (tmp_path / "rows100.txt").write_text("100 100")
    with pytest.raises(dlrm.EmbshardError, match="table 0 uses index 1,099,511,627,776 but has 100 rows"):
        dlrm.tables_from_trace(str(tmp_path / "stray.pt"),
                               dlrm.TraceOptions(dim=8, rows_file=str(tmp_path / "rows100.txt")), progress=False)
    (tmp_path / "ok.txt").write_text("6 2")
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        df = dlrm.tables_from_trace("h.pt", dlrm.TraceOptions(dim=8, rows_file="ok.txt"), progress=False)
    finally:
        os.chdir(cwd)
    assert f"rows=file:{tmp_path / 'ok.txt'}" in df["source"].iloc[0]


def test_several_files_of_one_trace_are_ingested_as_one(tmp_path, tables, capsys):
    """Meta's dataset holds one batch per file (fbgemm_t856_bs65536_0.pt ... _15.pt): the files of one trace give
    one table each, whose features describe all of them, and the benchmark replays the first file."""
    from embshard.bench import inputs, runner
    from embshard.features import bin_histogram
    from embshard.tableset import TableSet

    # Natural order (_2 before _10), different seeds and batch sizes, one of them gzip-compressed.
    names = {2: ("tr_2.pt", 48, 11), 10: ("tr_10.pt.gz", 64, 12), 1: ("tr_1.pt", 32, 13)}
    for name, batch, seed in names.values():
        write_dlrm_traces(tables, str(tmp_path / name), batch_size=batch, seed=seed)
    order = [str(tmp_path / names[k][0]) for k in (1, 2, 10)]
    out = tmp_path / "out"
    assert cli(["ingest", "--source", "dlrm", "--input", str(tmp_path / "tr_*.pt*"), "--out", str(out),
                "--dim", "32", "--no-progress"]) == 0
    df = schemas.read(out / "tables.parquet", "tables")
    per_file = [_direct(p) for p in order]
    for t in range(len(tables)):
        idx = [f[t][0] for f in per_file]
        lens = [f[t][1] for f in per_file]
        row = df.iloc[t]
        assert row["rows"] == max(max((int(i.max()) + 1 for i in idx if i.size), default=1), 1)
        assert row["pooling_factor"] == pytest.approx(sum(int(x.sum()) for x in lens) / (32 + 48 + 64))
        # each file is one batch: the unique ids per bin of each batch, added up
        hist = sum(bin_histogram(np.unique(i, return_counts=True)[1]) for i in idx if i.size)
        np.testing.assert_allclose(row[schemas.BIN_COLUMNS].to_numpy(float), hist / hist.sum())
        assert row["trace_file"] == os.path.abspath(order[0])
        assert row["trace_pooling_factor"] == pytest.approx(lens[0].sum() / 32)
    assert "files=3" in df["source"].iloc[0] and "batch=32+48+64" in df["source"].iloc[0]
    # The same files listed (the shell's expansion), in the same order: the same tables.
    out2 = tmp_path / "out2"
    assert cli(["ingest", "--source", "dlrm", "--input", *order, "--out", str(out2), "--dim", "32",
                "--no-progress"]) == 0
    assert schemas.read(out2 / "tables.parquet", "tables").equals(df)
    # The benchmark replays the first file and checks it against that file's own bag length.
    ts = TableSet.from_frame(df)
    spec = runner._table_inputs(ts, np.array([1]), None)[0]
    assert spec.trace_pooling_factor == pytest.approx(per_file[0][1][1].sum() / 32)
    assert len(inputs.trace_windows(spec, 16, 2)) == 2
    # One file alone: no trace_pooling_factor column, as before.
    one = tmp_path / "one"
    assert cli(["ingest", "--source", "dlrm", "--input", order[0], "--out", str(one), "--no-progress"]) == 0
    assert "trace_pooling_factor" not in schemas.read(one / "tables.parquet", "tables").columns


def test_files_of_different_traces_or_a_pattern_that_matches_nothing_are_one_line_errors(tmp_path, tables, capsys):
    write_dlrm_traces(tables, str(tmp_path / "a_0.pt"), batch_size=16, seed=1)
    write_dlrm_traces(tables.head(5), str(tmp_path / "a_1.pt"), batch_size=16, seed=2)
    out = tmp_path / "out"
    base = ["ingest", "--source", "dlrm", "--out", str(out), "--no-progress", "--input"]
    _fails(capsys, base + [str(tmp_path / "a_*.pt")], "a_1.pt", "holds 5 tables, a_0.pt holds 7", "fix:")
    _fails(capsys, base + [str(tmp_path / "b_*.pt")], "b_*.pt", "no trace file matches", "field 'input'")
    _fails(capsys, base + [f"{tmp_path / 'a_0.pt'},{tmp_path / 'a_0.pt'}"], "a_0.pt", "names one file twice")
    _fails(capsys, base + [str(tmp_path / "a_0.pt"), str(tmp_path / "nope.pt")], "nope.pt", "not found")
    _fails(capsys, ["ingest", "--source", "spec", "--out", str(out), "--no-progress", "--input",
                    str(tmp_path / "a_0.pt"), str(tmp_path / "a_1.pt")], "2 files given; a spec is one file")
    assert not out.exists() or os.listdir(out) == []  # nothing half-written


def test_pipeline_params_take_a_pattern_of_trace_files(tmp_path):
    from embshard.errors import EmbshardError
    from embshard.params import check as validate

    population = generate_tables(20, seed=3, bins_batch_size=256)  # a run learns from 8 tables at the least
    for k in range(2):
        write_dlrm_traces(population, str(tmp_path / f"d_{k}.pt"), batch_size=16, seed=k)
    ok = validate({"source": "dlrm", "input": str(tmp_path / "d_*.pt"), "tables_per_task": "2-3"})
    assert ok["input"] == str(tmp_path / "d_*.pt")
    with pytest.raises(EmbshardError, match="no trace file matches") as err:
        validate({"source": "dlrm", "input": str(tmp_path / "x_*.pt")})
    assert err.value.field == "input"
    with pytest.raises(EmbshardError, match="no file") as err:
        validate({"source": "dlrm", "input": f"{tmp_path / 'd_0.pt'},{tmp_path / 'gone.pt'}"})
    # tasks larger than the first file's pools are refused before any work, as for one file
    with pytest.raises(EmbshardError, match="tables_per_task"):
        validate({"source": "dlrm", "input": str(tmp_path / "d_*.pt"), "tables_per_task": "11-12"})
    # each file is read in full: the ingest stage's time limit grows with them
    from embshard.params import stage_timeout_s

    one = {"source": "dlrm", "input": str(tmp_path / "d_0.pt"), "num_tables": 5000}
    assert stage_timeout_s("ingest", {**one, "input": str(tmp_path / "d_*.pt")}) == 2 * stage_timeout_s("ingest", one)


def test_every_way_of_naming_several_files_reads_the_same_files_or_says_what_is_wrong(tmp_path, tables, capsys,
                                                                                        caplog):
    """Found by a user's session of the multi-file input: file:// entries of a list, a comma in a folder's name, a
    link to a file listed, an empty --input (an unset variable), --input given twice, a pattern inside a list."""
    comma = tmp_path / "run,2024"
    folder = tmp_path / "run"
    for where in (comma, folder):
        where.mkdir()
        for k in range(3):
            write_dlrm_traces(tables, str(where / f"x_{k}.pt"), batch_size=16, seed=k)
    # a comma in the folder's name: a pattern that matches files is a pattern, a file a file
    assert dlrm.trace_files(str(comma / "x_*.pt")) == [str(comma / f"x_{k}.pt") for k in range(3)]
    assert dlrm.trace_files(str(comma / "x_0.pt")) == [str(comma / "x_0.pt")]
    files = [str(folder / f"x_{k}.pt") for k in range(3)]
    assert dlrm.trace_files(f"{files[0]}, file://{files[1]},{files[2]},") == [files[0], f"file://{files[1]}",
                                                                              files[2]]
    assert dlrm.trace_files(f"{files[0]},{folder}/x_[12].pt") == files  # a pattern inside a list
    (tmp_path / "link.pt").symlink_to(files[0])
    with pytest.raises(dlrm.EmbshardError, match="names one file twice"):
        dlrm.trace_files([files[0], str(tmp_path / "link.pt")])
    out = tmp_path / "out"
    base = ["ingest", "--source", "dlrm", "--out", str(out), "--no-progress", "--dim", "32"]
    _fails(capsys, base + ["--input", ""], "field 'input'", "empty", "unset shell variable")
    _fails(capsys, base + ["--input", files[0], ""], "field 'input'", "empty")
    _fails(capsys, ["ingest", "--source", "spec", "--out", str(out), "--input", ""], "field 'input'", "empty")
    # --input given twice: both (argparse kept only the last)
    assert cli(base + ["--input", files[0], "--input", files[1], "f" + "ile://" + files[2]]) == 0
    assert "files=3" in schemas.read(out / "tables.parquet", "tables")["source"].iloc[0]
    # A file of another trace is refused before any file is read (zip-format files tell their tables at once).
    write_dlrm_traces(tables.head(3), str(tmp_path / "other.pt"), batch_size=16, seed=9)
    _fails(capsys, base + ["--input", *files, str(tmp_path / "other.pt")], "other.pt", "holds 3 tables")
    from embshard.params import check

    with pytest.raises(dlrm.EmbshardError, match="holds 3 tables"):
        check({"source": "dlrm", "input": f"{files[0]},{tmp_path / 'other.pt'}"})


def test_a_table_the_replayed_file_reads_unlike_the_others_is_warned_about(tmp_path, caplog):
    """The benchmark replays the first file: a table it never reads (the others do) would be measured as never
    read, against features that say it is."""
    import logging

    def save(path, lengths_1):
        lengths = torch.tensor([[1, 1, 1, 1], lengths_1])
        indices = torch.arange(int(lengths.sum())) % 3
        torch.save((indices, None, lengths), path)

    save(tmp_path / "e_0.pt", [0, 0, 0, 0])
    save(tmp_path / "e_1.pt", [2, 2, 2, 2])
    with caplog.at_level(logging.WARNING, logger="embshard.ingest.dlrm"):
        df = dlrm.tables_from_trace(str(tmp_path / "e_*.pt"), progress=False)
    assert df["trace_pooling_factor"].tolist() == [1.0, 0.0] and df["pooling_factor"].tolist() == [1.0, 1.0]
    text = caplog.text
    assert "e_0.pt" in text and "t0001 (0 against 1)" in text and "t0000" not in text.split("benchmark replays")[0]


def test_ingest_sorts_no_ids_where_a_count_over_the_rows_will_do(tmp_path, tables, monkeypatch):
    """The multi-file ingest had added a sort of every table's ids (a unique count for the raw-id warning): 2.4x
    slower on one file. The count comes from the histogram; tables whose ids span few rows are counted linearly."""
    path = str(tmp_path / "t.pt")
    small = tables.assign(rows=np.minimum(tables["rows"], 1000))
    write_dlrm_traces(small, path, batch_size=512, seed=1)
    import sys

    calls = []
    real = np.unique

    def spy(*a, **k):  # embshard's own sorts (pandas calls np.unique to build frames)
        caller = sys._getframe(1).f_code.co_filename
        if f"{os.sep}embshard{os.sep}" in caller:
            calls.append(caller)
        return real(*a, **k)

    monkeypatch.setattr(np, "unique", spy)
    df = dlrm.tables_from_trace(path, progress=False)
    assert calls == [] and len(df) == len(tables)
