"""Table-spec files (CSV, Parquet, YAML with TorchRec's names): examples, skew handling, and bad input."""
from __future__ import annotations

from importlib import resources
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from embshard import schemas
from embshard.cli import main as cli
from embshard.ingest import spec

EXAMPLES = resources.files("embshard.ingest") / "examples"
CRITEO_KAGGLE = [1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27, 14992,
                 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572]


def test_criteo_csv_example(tmp_path):
    out = tmp_path / "out"
    # a small bins batch keeps the test fast; the default is the open dataset's 65,536 samples
    assert cli(["ingest", "--source", "spec", "--input", str(EXAMPLES / "criteo_26.csv"), "--out", str(out),
                "--bins-batch-size", "2048", "--no-progress"]) == 0
    df = schemas.read(out / "tables.parquet", "tables")
    assert len(df) == 26 and df["rows"].tolist() == CRITEO_KAGGLE
    assert (df["dim"] == 128).all() and (df["pooling_factor"] == 1.0).all()
    assert (df["size_bytes"] == df["rows"] * 128 * 4).all()
    assert df["source"].str.contains("skew=default-zipf-1.0").all()
    assert (df["zipf_alpha"] == spec.DEFAULT_ZIPF_ALPHA).all()
    # a 3-row table hit 2048 times cannot be cold; a 10M-row table mostly is
    t3 = df.set_index("table_id").loc["t_cat_8", schemas.BIN_COLUMNS].to_numpy(float)
    big = df.set_index("table_id").loc["t_cat_2", schemas.BIN_COLUMNS].to_numpy(float)
    assert t3[0] == 0 and big[0] > 0.5


def test_mlperf_yaml_example():
    df = spec.tables_from_spec(str(EXAMPLES / "mlperf_dlrm.yaml"), bins_batch_size=256, progress=False)
    assert len(df) == 26 and df["rows"].max() == 40_000_000
    assert df.set_index("table_id").loc["t_cat_20", "pooling_factor"] == 100


def test_parquet_with_bins_alpha_and_fp16(tmp_path):
    bins = np.zeros(17)
    bins[[0, 3]] = [0.75, 0.25]
    rows = [
        {"name": "a", "num_embeddings": 1000, "embedding_dim": 16, "pooling_factor": 2.5, "data_type": "fp16",
         "zipf_alpha": np.nan, **{c: b for c, b in zip(schemas.BIN_COLUMNS, bins)}},
        {"name": "b", "num_embeddings": 50, "embedding_dim": 8, "pooling_factor": 1.0, "data_type": "FP32",
         "zipf_alpha": 0.0, **{c: np.nan for c in schemas.BIN_COLUMNS}},
        {"name": "c", "num_embeddings": 50, "embedding_dim": 8, "pooling_factor": 1.0, "data_type": None,
         "zipf_alpha": np.nan, **{c: np.nan for c in schemas.BIN_COLUMNS}},
    ]
    path = tmp_path / "s.parquet"
    pd.DataFrame(rows).to_parquet(path)
    df = spec.tables_from_spec(str(path), seed=1, bins_batch_size=512, progress=False).set_index("table_id")
    np.testing.assert_allclose(df.loc["a", schemas.BIN_COLUMNS].to_numpy(float), bins)
    assert df.loc["a", "bytes_per_element"] == 2 and df.loc["a", "size_bytes"] == 1000 * 16 * 2
    assert df.loc["b", "bytes_per_element"] == 4 and df.loc["c", "bytes_per_element"] == 4
    assert df.loc["a", "source"].endswith("skew=bins")
    assert "skew=zipf-0;" in df.loc["b", "source"] and "default-zipf-1.0" in df.loc["c", "source"]
    # uniform over 50 rows, 512 lookups: ~10 per index -> bins 3..4, nothing cold
    assert df.loc["b", "bin_00"] == 0
    # seeded: the same file gives the same bins
    again = spec.tables_from_spec(str(path), seed=1, bins_batch_size=512, progress=False).set_index("table_id")
    np.testing.assert_array_equal(again[schemas.BIN_COLUMNS].to_numpy(), df[schemas.BIN_COLUMNS].to_numpy())


def test_a_tables_access_features_do_not_depend_on_its_row_in_the_spec(tmp_path):
    """The same tables in another order, or beside other tables, are the same tables: the same sampled bins and
    content hashes (they were seeded by the row index, so `export` refused a plan of a reordered spec as 'changed
    since the plan was made', and the learned planner planned it otherwise)."""
    from embshard.tableset import TableSet

    rows = [f"t{k},{1000 * (k + 1)},{8 * (k % 3 + 1)},{1.0 + k}" for k in range(6)]
    header = "name,num_embeddings,embedding_dim,pooling_factor\n"
    (tmp_path / "a.csv").write_text(header + "\n".join(rows) + "\n")
    (tmp_path / "b.csv").write_text(header + "\n".join(reversed(rows[1:])) + "\n")  # reversed, t0 left out

    def read(name):
        df = spec.tables_from_spec(str(tmp_path / name), seed=1, bins_batch_size=512, progress=False)
        return df.set_index("table_id"), dict(zip(df["table_id"], TableSet.from_frame(df).content_hashes()))

    (a, hash_a), (b, hash_b) = read("a.csv"), read("b.csv")
    np.testing.assert_array_equal(b[schemas.BIN_COLUMNS].to_numpy(), a.loc[b.index, schemas.BIN_COLUMNS].to_numpy())
    assert hash_b == {t: hash_a[t] for t in b.index}


GOOD = "name,num_embeddings,embedding_dim,pooling_factor\nx,100,16,1.0\ny,200,32,2.0\n"


@pytest.mark.parametrize("name,content,field,words", [
    ("missing_col.csv", "name,num_embeddings,pooling_factor\nx,100,1.0\n", "embedding_dim", ["missing column"]),
    ("zero_rows.csv", GOOD.replace("100,16", "0,16"), "num_embeddings", ["not > 0"]),
    ("neg_dim.csv", GOOD.replace("200,32", "200,-4"), "embedding_dim", ["not > 0"]),
    ("nan_pool.csv", GOOD.replace("1.0", "nan"), "pooling_factor", ["empty or NaN value in line 2"]),
    ("empty_pool.csv", GOOD.replace(",1.0", ","), "pooling_factor", ["empty or NaN value in line 2", "table 'x'"]),
    ("short_row.csv", GOOD.replace("x,100,16,1.0", "x,100,16"), "pooling_factor", ["empty or NaN value in line 2"]),
    ("no_pool.yaml", "tables:\n  - {name: a, num_embeddings: 10, embedding_dim: 4}\n"
     "  - {name: b, num_embeddings: 10, embedding_dim: 4, pooling_factor: 1}\n", "pooling_factor",
     ["empty or NaN value in line 2", "table 'a'"]),
    ("dup.csv", GOOD.replace("y,", "x,"), "name", ["duplicate", "'x'", "line 2 and line 3"]),
    # lines as an editor counts them: comment and blank lines, a YAML table written over several lines
    ("comments.csv", "# sizes from prod\nname,num_embeddings,embedding_dim,pooling_factor\n\nx,100,16,1.0\n"
     "# the next one is new\ny,200,30,2.0\n", "embedding_dim", ["table 'y'", "line 6", "multiple of 4"]),
    ("dup.yaml", "tables:\n  - name: a\n    num_embeddings: 10\n    embedding_dim: 4\n    pooling_factor: 1\n"
     "  - {name: a, num_embeddings: 10, embedding_dim: 4, pooling_factor: 1}\n", "name", ["line 2 and line 6"]),
    ("text_rows.csv", GOOD.replace("100,16", "lots,16"), "num_embeddings", ["'lots'", "not a number"]),
    ("frac_dim.csv", GOOD.replace("100,16", "100,16.5"), "embedding_dim", ["not an integer"]),
    ("bad_dtype.csv", GOOD.replace("factor\n", "factor,data_type\n").replace("1.0\n", "1.0,int4\n")
     .replace("2.0\n", "2.0,fp16\n"), "data_type", ["int4"]),
    ("header_only.csv", "name,num_embeddings,embedding_dim,pooling_factor\n", "name", ["empty"]),
    ("blank.csv", "", "name", ["empty"]),
    ("empty.yaml", "tables: []\n", "name", ["empty"]),
    ("scalar.yaml", "tables: 3\n", "tables", ["list of tables"]),
    # a default the reader would drop: fp16 meant, fp32 (twice the bytes) read
    ("defaults.yaml", "tables:\n  - {name: a, num_embeddings: 100, embedding_dim: 16, pooling_factor: 1}\n"
     "table_defaults: {data_type: fp16}\n", "table_defaults", ["unknown key 'table_defaults'"]),
])
def test_bad_spec_files(tmp_path, capsys, name, content, field, words):
    path = tmp_path / name
    path.write_text(content)
    out = tmp_path / "out"
    assert cli(["ingest", "--source", "spec", "--input", str(path), "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and str(path) in err and f"field '{field}'" in err and "fix:" in err, err
    for w in words:
        assert w in err, err
    assert not (out / "tables.parquet").exists()


@pytest.mark.parametrize("name,encoding", [("latin1.csv", "latin-1"), ("excel_unicode.csv", "utf-16"),
                                           ("latin1.yaml", "latin-1")])
def test_a_spec_not_in_utf8_says_to_save_it_as_utf8(tmp_path, capsys, name, encoding):
    """A Latin-1 name or Excel's "Unicode text" (UTF-16) export had said only "cannot read this file", with no
    field and no fix."""
    path = tmp_path / name
    pad = "# " + "x" * 60 + "\n"  # past the first chunk a text stream decodes: its error counts from that chunk
    text = GOOD.replace("x,", "\u00e9t\u00e9,") if name.endswith(".csv") else \
        "tables:\n" + pad * 200 + "  - {name: \u00e9t\u00e9, num_embeddings: 100, embedding_dim: 16, " \
        "pooling_factor: 1}\n"
    path.write_bytes(text.encode(encoding))
    at = text.encode(encoding).index("\u00e9".encode(encoding)) if encoding == "latin-1" else 0
    assert cli(["ingest", "--source", "spec", "--input", str(path), "--out", str(tmp_path / "out"),
                "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and str(path) in err and "field 'encoding'" in err and "not UTF-8" in err, err
    assert "save the file as UTF-8" in err and f"at offset {at:,}" in err


def test_bad_parquet_and_other_files(tmp_path, capsys):
    out = tmp_path / "out"
    ok = pd.DataFrame({"name": ["a", "b"], "num_embeddings": [10, 20], "embedding_dim": [4, 8],
                       "pooling_factor": [1.0, 2.0]})
    cases = {
        "missing.parquet": (ok.drop(columns=["pooling_factor"]), "pooling_factor"),
        "mistyped.parquet": (ok.assign(embedding_dim=["four", "eight"]), "embedding_dim"),
        "bool.parquet": (ok.assign(pooling_factor=[True, False]), "pooling_factor"),
        "empty.parquet": (ok.iloc[:0], "name"),
    }
    for name, (frame, field) in cases.items():
        frame.to_parquet(tmp_path / name)
        assert cli(["ingest", "--source", "spec", "--input", str(tmp_path / name), "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert name in err and f"field '{field}'" in err, err
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 not really")
    (tmp_path / "bad.yaml").write_text("tables: [ {name: a, \n")
    (tmp_path / "spec.txt").write_text(GOOD)
    for name, words in [("broken.parquet", ["cannot read"]), ("bad.yaml", ["cannot read"]),
                        ("spec.txt", ["unknown file type"]), ("nope.csv", ["not found"])]:
        assert cli(["ingest", "--source", "spec", "--input", str(tmp_path / name), "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert name in err and all(w in err for w in words), err
    assert cli(["ingest", "--source", "spec", "--out", str(out)]) == 2
    assert "--input" in capsys.readouterr().err
    assert not (out / "tables.parquet").exists()


def test_place_and_export_read_a_spec_and_the_other_commands_say_how(tmp_path, capsys):
    """`embshard place --tables my_tables.yaml` (and export; predict: test_costmodel_uncertainty): a user's spec
    is read as `embshard ingest --source spec` reads it (same seed: the same tables, so the same plan); a spec
    given where only a tables.parquet is read (tasks, evaluate, ...) is refused in one line that names the ingest
    command, not called a corrupt Parquet file."""
    yaml_spec = tmp_path / "my_tables.yaml"
    yaml_spec.write_text("tables:\n" + "".join(
        f"  - {{name: t{i}, num_embeddings: {1000 * (i + 1)}, embedding_dim: {4 * (1 + i % 4)}, "
        f"pooling_factor: {1 + i % 3}}}\n" for i in range(8)))
    ingested = tmp_path / "ingested"
    assert cli(["ingest", "--source", "spec", "--input", str(yaml_spec), "--out", str(ingested), "--no-progress"]) == 0
    placements = {}
    for name, tables in (("spec", yaml_spec), ("parquet", ingested / "tables.parquet")):
        out = tmp_path / f"plan-{name}"
        assert cli(["place", "--tables", str(tables), "--devices", "2", "--memory-gb", "1",
                    "--planner", "size_lookup_greedy", "--out", str(out)]) == 0
        placements[name] = pd.read_parquet(out / "placements.parquet")
    pd.testing.assert_frame_equal(placements["spec"], placements["parquet"])
    # the report's header names no task when --task-id was not given (it once read "task task: 8 tables ...")
    header = next(line for line in capsys.readouterr().out.splitlines() if "tables on 2 devices" in line)
    assert header.startswith("8 tables on 2 devices, planner size_lookup_greedy"), header
    assert cli(["export", "--placements", str(tmp_path / "plan-spec" / "placements.parquet"), "--tables",
                str(yaml_spec), "--out", str(tmp_path / "export")]) == 0
    assert spec.is_spec_path(yaml_spec) and not spec.is_spec_path(ingested / "tables.parquet")
    # A Parquet spec (TorchRec's names) is a spec too; a bad one gets the spec reader's one-line error.
    pq_spec = tmp_path / "spec.parquet"
    pd.DataFrame({"name": ["a"], "num_embeddings": [10], "embedding_dim": [4], "pooling_factor": [1.0]}).to_parquet(
        pq_spec)
    assert spec.is_spec_path(pq_spec) and len(spec.read_tables(pq_spec)) == 1
    bad = tmp_path / "bad.yaml"
    bad.write_text("tables:\n  - {name: a, num_embeddings: -5, embedding_dim: 4, pooling_factor: 1}\n")
    capsys.readouterr()
    assert cli(["place", "--tables", str(bad), "--devices", "2", "--memory-gb", "1", "--planner", "size_greedy",
                "--out", str(tmp_path / "bad-out")]) == 2
    err = capsys.readouterr().err
    assert "bad.yaml" in err and "num_embeddings" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "bad-out" / "plan.json").exists()
    for spec_file in (yaml_spec, pq_spec):
        assert cli(["tasks", "--tables", str(spec_file), "--num-tasks", "1", "--devices", "2",
                    "--out", str(tmp_path / "tasks")]) == 2
        err = capsys.readouterr().err
        assert "a table spec, not a tables file" in err and "embshard ingest --source spec" in err, err
        assert "corrupt" not in err


def test_names_are_kept_as_written(tmp_path):
    """A CSV's names are text, never numbers or missing values ('007' stayed '7', 'NA' was refused as empty), and a
    byte-order mark (Excel's UTF-8 CSV) is not part of the first column's name."""
    path = tmp_path / "names.csv"
    path.write_bytes("\ufeffname,num_embeddings,embedding_dim,pooling_factor\n007,10,4,1\nNA,10,4,1\n1e3,10,4,2\n"
                     "7,10,4,1\n1.50,10,4,1\n".encode())
    df = spec.tables_from_spec(str(path), bins_batch_size=64, progress=False)
    assert list(df["table_id"]) == ["007", "NA", "1e3", "7", "1.50"]


@pytest.mark.parametrize("text", [
    "name,num_embeddings,embedding_dim,pooling_factor,\nuser,100,16,1.0,\nitem,200,32,2,\n",  # Excel's empty column
    "name,num_embeddings,embedding_dim,pooling_factor\nuser,100,16,1.0,\nitem,200,32,2,\n",  # trailing commas only
])
def test_trailing_commas_are_empty_fields(tmp_path, text):
    """The docstring's 'empty trailing fields are allowed': a header ending in a comma was refused by a pandas
    message, and rows ending in one read as 'empty name in row 0' (pandas took the names for an index)."""
    path = tmp_path / "t.csv"
    path.write_text(text)
    df = spec.tables_from_spec(str(path), bins_batch_size=512, progress=False)
    assert list(df["table_id"]) == ["user", "item"] and list(df["rows"]) == [100, 200]
    assert list(df["pooling_factor"]) == [1.0, 2.0]


def test_spaces_around_csv_header_names_are_read_as_around_values(tmp_path):
    """`name , num_embeddings` was a pandas error ("Usecols do not match columns") while spaces around values
    were accepted."""
    path = tmp_path / "h.csv"
    path.write_text("name , num_embeddings , embedding_dim , pooling_factor\na,100,16,1\nb , 200, 32 ,2\n")
    df = spec.tables_from_spec(str(path), bins_batch_size=512, progress=False)
    assert list(df["table_id"]) == ["a", "b"] and list(df["rows"]) == [100, 200] and list(df["dim"]) == [16, 32]


@pytest.mark.parametrize("name,sep", [("t.tsv", "\t"), ("t.csv", "\t"), ("t.csv", ";")])
def test_tab_and_semicolon_separated_specs_read_like_csv(tmp_path, name, sep):
    """A TSV (or a spreadsheet's copy saved as .csv) and Excel's semicolon CSV read as the comma CSV; they had
    failed as "unknown column 'name\\tnum_embeddings...'"."""
    path = tmp_path / name
    rows = [["name", "num_embeddings", "embedding_dim", "pooling_factor"], ["user", "100", "16", "1.5"],
            ["item", "200", "32", "2"]]
    path.write_text("".join(sep.join(r) + "\n" for r in rows))
    df = spec.tables_from_spec(str(path), bins_batch_size=512, progress=False)
    assert list(df["table_id"]) == ["user", "item"] and list(df["rows"]) == [100, 200]
    assert list(df["dim"]) == [16, 32] and list(df["pooling_factor"]) == [1.5, 2.0]


def test_a_spec_with_a_name_no_reader_knows_says_which_names_are_read(tmp_path):
    from embshard import schemas as schemas_mod
    from embshard.errors import EmbshardError

    path = tmp_path / "model.txt"
    path.write_text("name,num_embeddings,embedding_dim,pooling_factor\nuser,100,16,1.5\n")
    with pytest.raises(EmbshardError, match=r"not a Parquet file \(fix: give a tables.parquet, or a table spec named "
                                            r"\*.csv, \*.tsv, \*.yaml or \*.yml"):
        schemas_mod.read(str(path), "tables")


def test_a_table_with_both_a_zipf_alpha_and_bins_is_refused(tmp_path):
    """The bins had won silently over the alpha written beside them."""
    from embshard.errors import EmbshardError

    bins = ",".join(["1"] + ["0"] * 16)
    path = tmp_path / "both.csv"
    path.write_text("name,num_embeddings,embedding_dim,pooling_factor,zipf_alpha," + ",".join(schemas.BIN_COLUMNS)
                    + f"\nuser,100,16,1.0,1.2,{bins}\nitem,100,16,1.0,,{bins}\n")
    with pytest.raises(EmbshardError, match="table user gives both zipf_alpha and the bins") as err:
        spec.tables_from_spec(str(path), bins_batch_size=64, progress=False)
    assert err.value.field == "zipf_alpha"


def test_a_written_nan_skew_is_refused_and_an_empty_cell_is_the_default(tmp_path):
    """`zipf_alpha=nan` on one row of a 5,000-table CSV was read as "not given": the row got the default skew,
    silently, while inf and -1 were refused. An empty cell still means the default."""
    from embshard.errors import EmbshardError

    path = tmp_path / "s.csv"
    path.write_text("name,num_embeddings,embedding_dim,pooling_factor,zipf_alpha\nuser,100,16,1.0,1.1\n"
                    "item,100,16,1.0,nan\ngeo,100,16,1.0,\n")
    with pytest.raises(EmbshardError) as err:
        spec.tables_from_spec(str(path), bins_batch_size=64, progress=False)
    assert err.value.field == "zipf_alpha" and "'nan'" in str(err.value) and "line 3" in str(err.value), err.value
    path.write_text("name,num_embeddings,embedding_dim,pooling_factor,zipf_alpha\nuser,100,16,1.0,1.1\n"
                    "geo,100,16,1.0, \n")
    df = spec.tables_from_spec(str(path), bins_batch_size=64, progress=False).set_index("table_id")
    assert "skew=zipf-1.1" in df.loc["user", "source"] and "default-zipf-1.0" in df.loc["geo", "source"]


def test_a_long_sampling_of_a_spec_is_said_once_with_how_to_skip_it(tmp_path, monkeypatch, caplog):
    """`place` of a 5,000-table CSV spent 50 s sampling access features with nothing on a non-terminal stderr."""
    import logging

    monkeypatch.setattr(spec, "SAY_SAMPLING_FROM", 2)
    monkeypatch.setenv("EMBSHARD_CACHE_DIR", "off")  # every read samples (a cached table is not sampled again)
    path = tmp_path / "s.csv"
    path.write_text("name,num_embeddings,embedding_dim,pooling_factor\nuser,100,16,1.0\nitem,100,16,1.0\n")
    with caplog.at_level(logging.INFO, logger="embshard.ingest.spec"):
        spec.tables_from_spec(str(path), bins_batch_size=64, progress=True, reread=True)  # place's --tables
        spec.tables_from_spec(str(path), bins_batch_size=64, progress=True)  # ingest itself: no advice to ingest
        spec.tables_from_spec(str(path), bins_batch_size=64, progress=False)  # a caller's own progress: nothing
    said = [r.getMessage() for r in caplog.records if "sampling the access features" in r.getMessage()]
    assert len(said) == 2 and all("of 2 tables" in m for m in said), said
    assert "embshard ingest --source spec" in said[0] and "embshard ingest" not in said[1], said


def test_a_value_out_of_range_names_its_line_beside_its_table(tmp_path):
    """In a 5,000-table spec `num_embeddings -5` was named by its table alone, while a NaN got its line too."""
    from embshard.errors import EmbshardError

    path = tmp_path / "s.csv"
    path.write_text("# a model\nname,num_embeddings,embedding_dim,pooling_factor\nuser,100,16,1.0\n\nitem,-5,16,1.0\n")
    with pytest.raises(EmbshardError) as err:
        spec.tables_from_spec(str(path), bins_batch_size=64, progress=False)
    assert err.value.field == "num_embeddings" and "of table 'item' (line 5) is not > 0" in str(err.value), err.value


def test_a_written_nan_skew_is_refused_in_yaml_and_parquet_too(tmp_path):
    """Only a CSV told a written nan from an empty cell; a YAML `.nan` or a Parquet NaN still read as "not given"."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from embshard.errors import EmbshardError

    y = tmp_path / "s.yaml"
    y.write_text("- {name: user, num_embeddings: 100, embedding_dim: 16, pooling_factor: 1.0, zipf_alpha: 1.1}\n"
                 "- {name: item, num_embeddings: 100, embedding_dim: 16, pooling_factor: 1.0, zipf_alpha: .nan}\n")
    with pytest.raises(EmbshardError) as err:
        spec.tables_from_spec(str(y), bins_batch_size=64, progress=False)
    assert err.value.field == "zipf_alpha" and "line 2" in str(err.value), err.value
    cols = {"name": ["user", "item", "geo"], "num_embeddings": [100, 100, 100], "embedding_dim": [16, 16, 16],
            "pooling_factor": [1.0, 1.0, 1.0]}
    pq.write_table(pa.table({**cols, "zipf_alpha": pa.array([1.1, None, 0.5])}), tmp_path / "ok.parquet")
    df = spec.tables_from_spec(str(tmp_path / "ok.parquet"), bins_batch_size=64, progress=False)
    assert "default-zipf-1.0" in df.set_index("table_id").loc["item", "source"]  # null: the default
    pq.write_table(pa.table({**cols, "zipf_alpha": pa.array([1.1, float("nan"), 0.5])}), tmp_path / "nan.parquet")
    with pytest.raises(EmbshardError) as err:
        spec.tables_from_spec(str(tmp_path / "nan.parquet"), bins_batch_size=64, progress=False)
    assert err.value.field == "zipf_alpha" and "row 1 (table 'item')" in str(err.value), err.value


def test_a_spec_read_again_takes_the_very_bins_it_sampled_from_the_cache(tmp_path, monkeypatch):
    """`place --tables spec.csv` sampled every table's access features on every call (7-9 s at 856 tables, against
    ~1 s to plan them with a heuristic): a table read again comes from the cache, bit for bit what sampling gives;
    a changed row is sampled again, alone; a damaged entry is sampled again and replaced."""
    from embshard.ingest import bins_cache, synthetic

    rows = [f"t{k},{1000 * (k + 1)},16,{1.0 + k}" + (",0.8" if k % 2 else ",") for k in range(5)]
    path = tmp_path / "s.csv"
    path.write_text("name,num_embeddings,embedding_dim,pooling_factor,zipf_alpha\n" + "\n".join(rows) + "\n")
    sampled = []
    real = synthetic.sample_table_batch
    monkeypatch.setattr(synthetic, "sample_table_batch", lambda rows, *a: sampled.append(rows) or real(rows, *a))

    def read(cache):
        monkeypatch.setenv("EMBSHARD_CACHE_DIR", str(cache))
        sampled.clear()
        return spec.tables_from_spec(str(path), seed=3, bins_batch_size=512, progress=False)

    cache = tmp_path / "cache"
    fresh = read("off")
    assert len(sampled) == 5 and not cache.exists()
    pd.testing.assert_frame_equal(read(cache), fresh)
    assert len(sampled) == 5 and len(list(cache.rglob("*.bin"))) == 5
    pd.testing.assert_frame_equal(read(cache), fresh)
    assert sampled == []  # all five from the cache

    path.write_text(path.read_text().replace("t2,3000,16,3.0", "t2,3000,16,3.5"))
    changed = read(cache)
    assert sampled == [3000]
    pd.testing.assert_frame_equal(changed.drop(index=2), fresh.drop(index=2))
    assert not np.array_equal(changed.loc[2, schemas.BIN_COLUMNS].to_numpy(float),
                              fresh.loc[2, schemas.BIN_COLUMNS].to_numpy(float))

    # t0's entry (rows 1000, pooling 1.0, the default alpha), named by its key
    damaged = Path(bins_cache._entry(str(cache / bins_cache.FOLDER),
                                     bins_cache.table_key(3, 512, "t0", 1000, 1.0, spec.DEFAULT_ZIPF_ALPHA)))
    damaged.write_bytes(damaged.read_bytes()[:40])
    pd.testing.assert_frame_equal(read(cache), changed)
    assert sampled == [1000] and damaged.stat().st_size == 8 * schemas.NUM_BINS
    assert damaged.stat().st_mode & 0o777 == 0o644  # a shared cache's entries are readable by its other users
    assert bins_cache.load(str(cache / bins_cache.FOLDER), "0" * 64) is None  # no entry: sampled


def test_a_cache_that_cannot_be_written_leaves_the_read_as_it_was(tmp_path, monkeypatch):
    """A pod's home is read-only: the cache is skipped, the tables read as without it (no error)."""
    path = tmp_path / "s.csv"
    path.write_text(GOOD)
    monkeypatch.setenv("EMBSHARD_CACHE_DIR", "off")
    fresh = spec.tables_from_spec(str(path), bins_batch_size=64, progress=False)
    (tmp_path / "file").write_text("not a folder")
    monkeypatch.setenv("EMBSHARD_CACHE_DIR", str(tmp_path / "file" / "cache"))
    pd.testing.assert_frame_equal(spec.tables_from_spec(str(path), bins_batch_size=64, progress=False), fresh)


@pytest.mark.parametrize("change", [dict(seed=1), dict(batch=128), dict(name="u"), dict(rows=11),
                                    dict(pooling_factor=2.0000001), dict(alpha=0.5)])
def test_every_input_of_a_tables_sample_is_in_its_cache_key(change):
    from embshard.ingest import bins_cache

    base = dict(seed=0, batch=64, name="t", rows=10, pooling_factor=2.0, alpha=1.0)
    assert bins_cache.table_key(**{**base, **change}) != bins_cache.table_key(**base)


def test_a_spec_given_as_a_file_uri_reads_as_its_path(tmp_path):
    """`--tables file:///.../tables.parquet` worked, `file:///.../spec.csv` said "No such file or directory"."""
    path = tmp_path / "s.csv"
    path.write_text(GOOD)
    assert spec.is_spec_path(f"file://{path}")
    pd.testing.assert_frame_equal(spec.tables_from_spec(f"file://{path}", bins_batch_size=64, progress=False),
                                  spec.tables_from_spec(str(path), bins_batch_size=64, progress=False))
