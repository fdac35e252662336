"""The bad-input battery (issue 16): every case is one CLI call on one bad input, in-process.

Each must exit with code 2, print one line on stderr that names the input (file or option) and the field, and
write nothing: the folder holding the inputs and the output folder are byte-for-byte what they were before.
A benchmark folder's fingerprint is tested at the end: a killed run resumes to the same result, a rerun with
other settings is refused.
"""
from __future__ import annotations

import gzip
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from embshard import schemas
from embshard.cli import main as cli

LOG_LINE = re.compile(r"^\d\d:\d\d:\d\d (DEBUG|INFO|WARNING) ")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Valid inputs every case starts from: 12 tables, one train and one test task of 3 tables, a placement."""
    from embshard.ingest.synthetic import generate_tables
    from embshard.jobs import tasks
    from embshard.planners.baselines import make_baseline
    from embshard.tableset import TableSet

    root = tmp_path_factory.mktemp("world")
    df = generate_tables(12, seed=1, bins_batch_size=512)
    tables = str(root / "tables.parquet")
    schemas.write(df, tables, "tables")
    tasks_path = tasks.run(tables, str(root), num_tasks=1, tables_per_task=3, devices=2, memory_gb=64, seed=0)
    tdf = schemas.read(tasks_path, "tasks")
    t = tdf[tdf["split"] == "test"].iloc[0]
    ts = TableSet.read(tables)
    pl = make_baseline("size_greedy").plan(ts.select(list(t["table_ids"])), 2, int(t["memory_bytes_per_device"]),
                                           t["task_id"])
    placements = str(root / "placements.parquet")
    schemas.write(pl.to_frame(), placements, "placements")
    return {"root": str(root), "tables": tables, "tasks": tasks_path, "placements": placements,
            "tables_df": df, "tasks_df": tdf, "placements_df": pl.to_frame(), "task_id": t["task_id"],
            "train_task": tdf[tdf["split"] == "train"].iloc[0]["task_id"]}


# -- writers of bad files ------------------------------------------------------------------------------------------
def raw_parquet(df: pd.DataFrame, path) -> str:
    """Write a frame as Parquet without the contract's checks (how a broken file reaches a user)."""
    pq.write_table(pa.Table.from_pandas(df, preserve_index=False), str(path))
    return str(path)


def spec(d, text: str, name: str = "spec.csv") -> str:
    path = os.path.join(d, name)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return path


HEAD = "name,num_embeddings,embedding_dim,pooling_factor"


def spec_row(row: str, extra_head: str = "", extra: str = "") -> str:
    return f"{HEAD}{extra_head}\nok_table,100,16,1.0{extra}\n{row}\n"


def tables_with(w, d, **cols) -> str:
    df = w["tables_df"].copy()
    df["table_id"] = df["table_id"].astype(object)
    for col, (i, v) in cols.items():
        df.loc[i, col] = v
    return raw_parquet(df, os.path.join(d, "tables.parquet"))


def tasks_with(w, d, **fields) -> str:
    df = w["tasks_df"].copy()
    i = df.index[df["task_id"] == w["task_id"]][0]
    for col, v in fields.items():
        df.at[i, col] = v
    return raw_parquet(df, os.path.join(d, "tasks.parquet"))


def placements_with(w, d, edit) -> str:
    df = edit(w["placements_df"].copy())
    return raw_parquet(df, os.path.join(d, "placements.parquet"))


def first_ids(w, k):
    t = w["tasks_df"].set_index("task_id").loc[w["task_id"], "table_ids"]
    return list(t)[:k]


def trace(d, name="trace.pt") -> str:
    import torch

    lengths = torch.ones(2, 4, dtype=torch.int64)
    indices = torch.arange(8, dtype=torch.int64) % 3
    offsets = torch.arange(9, dtype=torch.int64)
    path = os.path.join(d, name)
    torch.save((indices, offsets, lengths), path)
    return path


# -- the cases: (id, builder(world, dir) -> (argv, words the message must contain)) --------------------------------
def ingest_spec(text, name="spec.csv"):
    def build(w, d):
        p = spec(d, text, name)
        return ["ingest", "--source", "spec", "--input", p], [name]
    return build


CASES = {
    # ingest: spec files
    "spec-missing-file": lambda w, d: (["ingest", "--source", "spec", "--input", os.path.join(d, "nope.csv")],
                                       ["nope.csv", "not found"]),
    "spec-is-a-folder": lambda w, d: (["ingest", "--source", "spec", "--input", d], [d, "folder"]),
    "spec-unknown-extension": ingest_spec(spec_row("a,1,4,1"), "spec.txt"),
    "spec-header-only": ingest_spec(HEAD + "\n"),
    "spec-no-rows-at-all": ingest_spec(""),
    "spec-missing-num_embeddings": ingest_spec("name,embedding_dim,pooling_factor\na,4,1\n"),
    "spec-missing-pooling": ingest_spec("name,num_embeddings,embedding_dim\na,10,4\n"),
    "spec-missing-name": ingest_spec("num_embeddings,embedding_dim,pooling_factor\n10,4,1\n"),
    "spec-empty-name": ingest_spec(spec_row(",10,4,1")),
    "spec-duplicate-name": ingest_spec(spec_row("ok_table,10,4,1")),
    "spec-name-dotdot": ingest_spec(spec_row("..,10,4,1")),
    "spec-name-dot": ingest_spec(spec_row(".,10,4,1")),
    "spec-name-path": ingest_spec(spec_row("../../etc/x,10,4,1")),
    "spec-name-slash": ingest_spec(spec_row("a/b,10,4,1")),
    "spec-name-space": ingest_spec(spec_row("a b,10,4,1")),
    "spec-name-too-long": ingest_spec(spec_row("a" * 200 + ",10,4,1")),
    "spec-name-leading-dash": ingest_spec(spec_row("-a,10,4,1")),
    "spec-rows-text": ingest_spec(spec_row("a,abc,4,1")),
    "spec-rows-fraction": ingest_spec(spec_row("a,1.5,4,1")),
    "spec-rows-zero": ingest_spec(spec_row("a,0,4,1")),
    "spec-rows-negative": ingest_spec(spec_row("a,-5,4,1")),
    "spec-rows-above-int64": ingest_spec(spec_row("a,100000000000000000000000,4,1")),
    "spec-rows-empty": ingest_spec(spec_row("a,,4,1")),
    "spec-size-overflows": ingest_spec(spec_row("a,2305843009213693952,128,1")),
    "spec-dim-zero": ingest_spec(spec_row("a,10,0,1")),
    "spec-dim-huge": ingest_spec(spec_row("a,10,100000000,1")),
    "spec-dim-fraction": ingest_spec(spec_row("a,10,2.5,1")),
    "spec-pooling-nan": ingest_spec(spec_row("a,10,4,nan")),
    "spec-pooling-negative": ingest_spec(spec_row("a,10,4,-1")),
    "spec-pooling-1e300": ingest_spec(spec_row("a,10,4,1e300")),
    "spec-pooling-inf": ingest_spec(spec_row("a,10,4,inf")),
    "spec-pooling-text": ingest_spec(spec_row("a,10,4,many")),
    "spec-data-type": ingest_spec(spec_row("a,10,4,1,fp8", ",data_type", ",fp32")),
    "spec-zipf-negative": ingest_spec(spec_row("a,10,4,1,-1", ",zipf_alpha", ",1.0")),
    "spec-one-bin-only": ingest_spec(spec_row("a,10,4,1,1.0", ",bin_00", ",1.0")),
    "spec-yaml-not-a-list": ingest_spec("tables: 5\n", "spec.yaml"),
    "spec-yaml-broken": ingest_spec("tables: [\n  {name: a\n", "spec.yaml"),
    "spec-parquet-corrupt": ingest_spec("PAR1 not really", "spec.parquet"),
    "spec-without-input": lambda w, d: (["ingest", "--source", "spec"], ["input"]),
    # ingest: DLRM traces
    "dlrm-missing-file": lambda w, d: (["ingest", "--source", "dlrm", "--input", os.path.join(d, "t.pt")],
                                       ["t.pt", "not found"]),
    "dlrm-folder": lambda w, d: (["ingest", "--source", "dlrm", "--input", d], [d, "folder"]),
    "dlrm-gz-not-gzip": lambda w, d: (["ingest", "--source", "dlrm", "--input", spec(d, "x" * 64, "t.pt.gz")],
                                      ["t.pt.gz", "gzip"]),
    "dlrm-gz-corrupt": lambda w, d: (["ingest", "--source", "dlrm", "--input",
                                      _write_bytes(d, "t.pt.gz", gzip.compress(b"junk" * 10)[:20])], ["t.pt.gz"]),
    "dlrm-not-torch": lambda w, d: (["ingest", "--source", "dlrm", "--input", spec(d, "hello", "t.pt")], ["t.pt"]),
    "dlrm-dim-huge": lambda w, d: (["ingest", "--source", "dlrm", "--input", trace(d), "--dim", "100000000"],
                                   ["dim"]),
    "dlrm-dim-zero": lambda w, d: (["ingest", "--source", "dlrm", "--input", trace(d), "--dim", "0"], ["dim"]),
    "dlrm-rows-file-folder": lambda w, d: (["ingest", "--source", "dlrm", "--input", trace(d), "--rows-file", d],
                                           [d, "folder"]),
    "dlrm-rows-file-text": lambda w, d: (["ingest", "--source", "dlrm", "--input", trace(d), "--rows-file",
                                          spec(d, "10 x", "rows.txt")], ["rows.txt", "rows"]),
    "dlrm-rows-too-small": lambda w, d: (["ingest", "--source", "dlrm", "--input", trace(d), "--rows-file",
                                          spec(d, "1 1", "rows.txt")], ["rows.txt", "rows"]),
    "dlrm-data-type": lambda w, d: (["ingest", "--source", "dlrm", "--input", trace(d), "--data-type", "fp8"],
                                    ["--data-type"]),
    "ingest-unknown-source": lambda w, d: (["ingest", "--source", "csv"], ["--source"]),
    "synthetic-zero-tables": lambda w, d: (["ingest", "--source", "synthetic", "--num-tables", "0"],
                                           ["num_tables"]),
    # tasks
    "tasks-missing-tables": lambda w, d: (_tasks(os.path.join(d, "no.parquet")), ["no.parquet", "not found"]),
    "tasks-tables-folder": lambda w, d: (_tasks(w["root"]), [w["root"], "folder"]),
    "tasks-tables-corrupt": lambda w, d: (_tasks(spec(d, "junk", "tables.parquet")), ["tables.parquet"]),
    "tasks-tables-missing-column": lambda w, d: (
        _tasks(raw_parquet(w["tables_df"].drop(columns=["rows"]), os.path.join(d, "t.parquet"))),
        ["t.parquet", "rows"]),
    "tasks-table-id-path": lambda w, d: (_tasks(tables_with(w, d, table_id=(0, "../../etc/x"))),
                                         ["tables.parquet", "table_id"]),
    "tasks-table-id-dotdot": lambda w, d: (_tasks(tables_with(w, d, table_id=(0, ".."))),
                                           ["tables.parquet", "table_id"]),
    "tasks-table-id-duplicate": lambda w, d: (_tasks(tables_with(w, d, table_id=(0, w["tables_df"]["table_id"][1]))),
                                              ["tables.parquet", "table_id"]),
    "tasks-table-dim-huge": lambda w, d: (_tasks(tables_with(w, d, dim=(0, 100_000_000))), ["tables.parquet", "dim"]),
    "tasks-table-pooling-1e300": lambda w, d: (_tasks(tables_with(w, d, pooling_factor=(0, 1e300))),
                                               ["tables.parquet", "pooling_factor"]),
    "tasks-table-rows-zero": lambda w, d: (_tasks(tables_with(w, d, rows=(0, 0))), ["tables.parquet", "rows"]),
    "tasks-memory-1e30": lambda w, d: (_tasks(w["tables"], "--memory-gb", "1e30"), ["memory_gb"]),
    "tasks-memory-zero": lambda w, d: (_tasks(w["tables"], "--memory-gb", "0"), ["memory_gb"]),
    "tasks-memory-nan": lambda w, d: (_tasks(w["tables"], "--memory-gb", "nan"), ["memory_gb"]),
    "tasks-memory-negative": lambda w, d: (_tasks(w["tables"], "--memory-gb", "-1"), ["memory_gb"]),
    "tasks-memory-too-small": lambda w, d: (_tasks(w["tables"], "--memory-gb", "0.000001"),
                                            ["tables.parquet", "memory_gb"]),
    "tasks-devices-zero": lambda w, d: (_tasks(w["tables"], "--devices", "0"), ["devices"]),
    "tasks-devices-text": lambda w, d: (_tasks(w["tables"], "--devices", "four"), ["devices"]),
    "tasks-devices-huge": lambda w, d: (_tasks(w["tables"], "--devices", "1000000000"), ["devices"]),
    "tasks-per-task-zero": lambda w, d: (_tasks(w["tables"], "--tables-per-task", "0"), ["tables_per_task"]),
    "tasks-per-task-reversed": lambda w, d: (_tasks(w["tables"], "--tables-per-task", "5-2"), ["tables_per_task"]),
    "tasks-per-task-too-many": lambda w, d: (_tasks(w["tables"], "--tables-per-task", "50"),
                                             ["tables.parquet", "tables_per_task"]),
    "tasks-num-tasks-zero": lambda w, d: (_tasks(w["tables"], "--num-tasks", "0"), ["num_tasks"]),
    # place
    "place-devices-zero-with-task": lambda w, d: (_place(w, "--tasks", w["tasks"], "--task-id", w["task_id"],
                                                         "--devices", "0"), ["devices"]),
    "place-memory-zero-with-task": lambda w, d: (_place(w, "--tasks", w["tasks"], "--task-id", w["task_id"],
                                                        "--memory-gb", "0"), ["memory_gb"]),
    "place-devices-negative": lambda w, d: (_place(w, "--devices", "-1", "--memory-gb", "8"), ["devices"]),
    "place-memory-negative": lambda w, d: (_place(w, "--devices", "2", "--memory-gb", "-1"), ["memory_gb"]),
    "place-memory-nan": lambda w, d: (_place(w, "--devices", "2", "--memory-gb", "nan"), ["memory_gb"]),
    # float() reads 1_6 as 16: a typo for 1.6 gave ten times the memory
    # a flag the command would have ignored without a word
    "place-heuristic-given-a-model": lambda w, d: (
        _place(w, "--devices", "2", "--memory-gb", "8", "--model", "models:/embshard-policy/1"),
        ["model", "size_greedy uses none"]),
    "place-hardware-empty": lambda w, d: (_place(w, "--devices", "2", "--memory-gb", "8", "--hardware", " "),
                                          ["hardware", "empty"]),
    "place-memory-underscore": lambda w, d: (_place(w, "--devices", "2", "--memory-gb", "1_6"), ["memory-gb", "'_'"]),
    # 2^62 bytes per device had planned, then failed writing plan.json, naming the plan.json being written
    "place-task-memory-over-a-pib": lambda w, d: (
        _place(w, "--tasks", tasks_with(w, d, memory_bytes_per_device=2**62), "--task-id", w["task_id"]),
        ["tasks.parquet", "memory_bytes_per_device", "1 PiB"]),
    "export-negative-predicted-cost": lambda w, d: (
        _export(w, placements_with(w, d, lambda df: df.assign(predicted_cost_ms=-5.0))),
        ["placements.parquet", "predicted_cost_ms"]),
    "export-infinite-estimate": lambda w, d: (
        _export(w, placements_with(w, d, lambda df: df.assign(balanced_estimate_ms=float("inf")))),
        ["placements.parquet", "balanced_estimate_ms"]),
    "place-memory-1e30": lambda w, d: (_place(w, "--devices", "2", "--memory-gb", "1e30"), ["memory_gb"]),
    "place-memory-inf": lambda w, d: (_place(w, "--devices", "2", "--memory-gb", "inf"), ["memory_gb"]),
    "place-memory-too-small": lambda w, d: (_place(w, "--devices", "2", "--memory-gb", "0.000001"),
                                            ["tables.parquet", "field 'memory_gb'"]),
    "place-no-devices": lambda w, d: (_place(w, "--memory-gb", "8"), ["field 'devices'", "--devices is required"]),
    # the flag left out is named, not the one given
    "place-no-memory": lambda w, d: (_place(w, "--devices", "8"), ["field 'memory_gb'", "--memory-gb is required"]),
    "place-unknown-task": lambda w, d: (_place(w, "--tasks", w["tasks"], "--task-id", "nope"),
                                        ["tasks.parquet", "task_id"]),
    "place-task-without-tasks": lambda w, d: (_place(w, "--task-id", w["task_id"]), ["tasks"]),
    "place-task-lists-table-twice": lambda w, d: (
        _place(w, "--tasks", tasks_with(w, d, table_ids=first_ids(w, 2) + first_ids(w, 1)), "--task-id",
               w["task_id"]), ["tasks.parquet", "table_ids"]),
    "place-task-unknown-table": lambda w, d: (
        _place(w, "--tasks", tasks_with(w, d, table_ids=["t_unknown"]), "--task-id", w["task_id"]),
        ["tasks.parquet", "table_ids"]),
    "place-tables-folder": lambda w, d: (["place", "--tables", w["root"], "--devices", "2", "--memory-gb", "8",
                                          "--planner", "size_greedy", "--out", os.path.join(d, "out")],
                                         [w["root"], "folder"]),
    "place-unknown-planner": lambda w, d: (_place(w, "--devices", "2", "--memory-gb", "8", planner="best"),
                                           ["planner"]),
    "place-time-budget-nan": lambda w, d: (_place(w, "--devices", "2", "--memory-gb", "8", "--time-budget-s", "nan"),
                                           ["time_budget_s"]),
    "place-search-evaluations-negative": lambda w, d: (
        _place(w, "--devices", "2", "--memory-gb", "8", "--search-evaluations", "-1"), ["search_evaluations"]),
    # evaluate
    "evaluate-task-lists-table-twice": lambda w, d: (
        _evaluate(w, tasks_with(w, d, table_ids=first_ids(w, 2) + first_ids(w, 1))), ["tasks.parquet", "table_ids"]),
    "evaluate-task-cannot-fit": lambda w, d: (_evaluate(w, tasks_with(w, d, memory_bytes_per_device=1000)),
                                              ["tasks.parquet", "memory_bytes_per_device"]),
    "evaluate-task-too-little-total": lambda w, d: (
        _evaluate(w, tasks_with(w, d, num_devices=1, memory_bytes_per_device=int(
            w["tables_df"].set_index("table_id").loc[first_ids(w, 3), "size_bytes"].max()))),
        ["tasks.parquet", "memory_bytes_per_device"]),
    "evaluate-task-zero-devices": lambda w, d: (_evaluate(w, tasks_with(w, d, num_devices=0)),
                                                ["tasks.parquet", "num_devices"]),
    "evaluate-task-id-path": lambda w, d: (_evaluate(w, tasks_with(w, d, task_id="../x")),
                                           ["tasks.parquet", "task_id"]),
    "evaluate-missing-tasks": lambda w, d: (_evaluate(w, os.path.join(d, "no.parquet")), ["no.parquet", "not found"]),
    # a plan.json given as --tables: it read "not a readable Parquet file (... Either the )", cut mid-sentence
    "place-tables-is-a-json-file": lambda w, d: (
        _place(w, "--devices", "2", "--memory-gb", "8", tables=spec(d, '{"tables": []}', "plan.json")),
        ["plan.json", "not a Parquet file"]),
    # a DLRM trace given as --tables: "not a Parquet file", with no word of ingest
    "place-tables-is-a-trace": lambda w, d: (
        _place(w, "--devices", "2", "--memory-gb", "8", tables=trace(d)),
        ["trace.pt", "a DLRM trace", "embshard ingest --source dlrm"]),
    # a YAML spec whose key is misspelt: it read "the table list is empty"
    "spec-yaml-without-tables-key": ingest_spec("table:\n  - {name: a, num_embeddings: 10, embedding_dim: 4}\n",
                                                "spec.yaml"),
    # a typo in --calibration-dir calibrated anew into a new folder, silently
    "evaluate-calibration-dir-missing": lambda w, d: (
        _evaluate(w, w["tasks"], "--calibration-dir", os.path.join(d, "nonexist")), ["nonexist", "calibration_dir"]),
    "evaluate-no-such-split": lambda w, d: (_evaluate(w, w["tasks"], "--split", "validation"),
                                            ["tasks.parquet", "split"]),
    "evaluate-unknown-planner": lambda w, d: (_evaluate(w, w["tasks"], planners="best"), ["planner"]),
    "evaluate-no-planners": lambda w, d: (_evaluate(w, w["tasks"], planners=","), ["planners"]),
    "evaluate-zero-rounds": lambda w, d: (_evaluate(w, w["tasks"], "--rounds", "0"), ["rounds"]),
    "evaluate-negative-rounds": lambda w, d: (_evaluate(w, w["tasks"], "--rounds", "-3"), ["rounds"]),
    # a billion rounds had failed allocating 44.7 GiB in a traceback; a huge batch, 745 GiB
    "evaluate-rounds-huge": lambda w, d: (_evaluate(w, w["tasks"], "--rounds", "1000000000"), ["rounds", "1 to 100"]),
    "evaluate-batch-huge": lambda w, d: (_evaluate(w, w["tasks"], "--batch-size", "100000000000"),
                                         ["batch_size", "4,194,304"]),
    "evaluate-baselines-is-not-a-planner": lambda w, d: (_evaluate(w, w["tasks"], planners="baselines"),
                                                         ["planners", "baselines"]),
    "evaluate-no-test-tasks": lambda w, d: (_evaluate(w, tasks_with(w, d, split="train")),
                                            ["tasks.parquet", "split"]),
    # bench
    "bench-max-shard-nan": lambda w, d: (_bench(w, d, "--max-shard-gb", "nan"), ["max_shard_gb"]),
    "bench-max-shard-zero": lambda w, d: (_bench(w, d, "--max-shard-gb", "0"), ["max_shard_gb"]),
    "bench-max-shard-negative": lambda w, d: (_bench(w, d, "--max-shard-gb", "-2"), ["max_shard_gb"]),
    "bench-max-table-nan": lambda w, d: (_bench(w, d, "--max-table-gb", "nan"), ["max_table_gb"]),
    "bench-batch-zero": lambda w, d: (_bench(w, d, "--batch-size", "0"), ["batch_size"]),
    "bench-iterations-few": lambda w, d: (_bench(w, d, "--iterations", "5"), ["iterations"]),
    "bench-iterations-huge": lambda w, d: (_bench(w, d, "--iterations", "100000000000000"), ["iterations", "100,000"]),
    "bench-batch-huge": lambda w, d: (_bench(w, d, "--batch-size", "100000000000"), ["batch_size", "4,194,304"]),
    "bench-warmup-huge": lambda w, d: (_bench(w, d, "--warmup", "100000000000"), ["warmup"]),
    "bench-warmup-negative": lambda w, d: (_bench(w, d, "--warmup", "-1"), ["warmup"]),
    "bench-shards-bogus": lambda w, d: (_bench(w, d, shards="bogus:2"), ["bogus"]),
    "bench-shards-random-zero": lambda w, d: (_bench(w, d, shards="random:0"), ["shards"]),
    "bench-shards-random-text": lambda w, d: (_bench(w, d, shards="random:x"), ["shards"]),
    "bench-shards-unknown-table": lambda w, d: (_bench(w, d, shards=raw_parquet(pd.DataFrame(
        {"sample_id": ["s0"], "table_ids": [["t_unknown"]], "num_devices": [2], "origin": ["given"]}),
        os.path.join(d, "shards.parquet"))), ["table_ids"]),
    "bench-shards-row-outside-table": lambda w, d: (_bench(w, d, shards=_piece_shards(
        w, d, lambda rows, dim: {"row_offsets": [[rows - 1]], "row_sizes": [[2]]})), ["shards.parquet", "row_offsets"]),
    "bench-shards-row-size-negative": lambda w, d: (_bench(w, d, shards=_piece_shards(
        w, d, lambda rows, dim: {"row_offsets": [[0]], "row_sizes": [[-5]]})), ["shards.parquet", "row_sizes"]),
    "bench-shards-col-not-multiple-of-4": lambda w, d: (_bench(w, d, shards=_piece_shards(
        w, d, lambda rows, dim: {"col_sizes": [[6]]})), ["shards.parquet", "col_sizes"]),
    "bench-chunk-out-of-range": lambda w, d: (_bench(w, d, "--chunk", "5", "--num-chunks", "2"), ["chunk"]),
    "bench-zero-chunks": lambda w, d: (_bench(w, d, "--num-chunks", "0"), ["num_chunks"]),
    "bench-missing-tables": lambda w, d: (_bench(w, d, tables=os.path.join(d, "no.parquet")), ["no.parquet"]),
    "bench-comm-bandwidth-nan": lambda w, d: (_bench(w, d, "--comm-bandwidth-gbps", "nan", "--comm-latency-us", "2"),
                                              ["comm_bandwidth_gbps"]),
    # export
    "export-task-misses-tables": lambda w, d: (
        _export(w, placements_with(w, d, lambda df: df.iloc[1:]), tasks=w["tasks"]),
        ["placements.parquet", "table_id"]),
    "export-table-placed-twice": lambda w, d: (
        _export(w, placements_with(w, d, lambda df: pd.concat([df, df.iloc[:1]]))), ["placements.parquet", "table_id"]),
    "export-table-id-dotdot": lambda w, d: (
        _export(w, placements_with(w, d, lambda df: df.assign(table_id=[".."] + list(df["table_id"][1:])))),
        ["placements.parquet", "table_id"]),
    "export-table-id-dot": lambda w, d: (
        _export(w, placements_with(w, d, lambda df: df.assign(table_id=["."] + list(df["table_id"][1:])))),
        ["placements.parquet", "table_id"]),
    "export-table-id-path": lambda w, d: (
        _export(w, placements_with(w, d, lambda df: df.assign(table_id=["../../etc/x"] + list(df["table_id"][1:])))),
        ["placements.parquet", "table_id"]),
    "export-task-id-path": lambda w, d: (
        _export(w, placements_with(w, d, lambda df: df.assign(task_id="../../etc/x"))),
        ["placements.parquet", "task_id"]),
    "export-task-id-dotdot": lambda w, d: (
        _export(w, placements_with(w, d, lambda df: df.assign(task_id=".."))), ["placements.parquet", "task_id"]),
    "export-task-not-in-tasks": lambda w, d: (
        _export(w, placements_with(w, d, lambda df: df.assign(task_id="other")), tasks=w["tasks"]),
        ["placements.parquet", "task_id"]),
    "export-unknown-table": lambda w, d: (
        _export(w, placements_with(w, d, lambda df: df.assign(table_id=["t_unknown"] + list(df["table_id"][1:])))),
        ["placements.parquet", "table_ids"]),
    "export-foreign-table": lambda w, d: (
        _export(w, placements_with(w, d, lambda df: pd.concat([df, df.iloc[:1].assign(
            table_id=sorted(set(w["tables_df"]["table_id"]) - set(first_ids(w, 3)))[0])])), tasks=w["tasks"]),
        ["placements.parquet", "table_id"]),
    "export-device-beyond-task": lambda w, d: (
        _export(w, placements_with(w, d, lambda df: df.assign(device=[5] + list(df["device"][1:]))), tasks=w["tasks"]),
        ["placements.parquet", "device"]),
    "export-memory-over": lambda w, d: (
        _export(w, placements_with(w, d, lambda df: df.assign(device=0)),
                tasks=tasks_with(w, d, memory_bytes_per_device=int(
                    w["tables_df"].set_index("table_id").loc[first_ids(w, 3), "size_bytes"].max()))),
        ["placements.parquet", "memory"]),
    "export-missing-placements": lambda w, d: (_export(w, os.path.join(d, "no.parquet")), ["no.parquet", "not found"]),
    "export-placements-folder": lambda w, d: (_export(w, d), [d, "folder"]),
    "export-placements-corrupt": lambda w, d: (_export(w, spec(d, "junk", "p.parquet")), ["p.parquet"]),
    "export-placements-no-device": lambda w, d: (
        _export(w, placements_with(w, d, lambda df: df.drop(columns=["device"]))), ["placements.parquet", "device"]),
    "export-negative-device": lambda w, d: (
        _export(w, placements_with(w, d, lambda df: df.assign(device=-1))), ["placements.parquet", "device"]),
    # Rows that disagree on what the plan has once (export had taken the first row's, or a device's largest cost),
    # and a row's columns that contradict each other (a whole table marked `column` had been exported whole).
    "export-rows-disagree-on-the-estimate": lambda w, d: (
        _export(w, placements_with(w, d, lambda df: df.assign(
            balanced_estimate_ms=[1.0] + [9.6] * (len(df) - 1)))), ["placements.parquet", "balanced_estimate_ms"]),
    "export-rows-disagree-on-plan-meta": lambda w, d: (
        _export(w, placements_with(w, d, lambda df: df.assign(
            plan_meta=['{"other": 1}'] + ["{}"] * (len(df) - 1)))), ["placements.parquet", "plan_meta"]),
    "export-rows-of-a-device-disagree-on-its-cost": lambda w, d: (
        _export(w, placements_with(w, d, lambda df: df.assign(device=0, predicted_cost_ms=[99.0] + [1.0] * (
            len(df) - 1)))), ["placements.parquet", "predicted_cost_ms", "device 0"]),
    "export-kind-contradicts-the-sizes": lambda w, d: (
        _export(w, placements_with(w, d, lambda df: df.assign(kind=["column"] + [None] * (len(df) - 1)))),
        ["placements.parquet", "kind", "whole"]),
    "export-row-offset-without-row-size": lambda w, d: (
        _export(w, placements_with(w, d, lambda df: df.assign(row_offset=[5] + [None] * (len(df) - 1)))),
        ["placements.parquet", "row_size"]),
}


def _write_bytes(d, name, data: bytes) -> str:
    path = os.path.join(d, name)
    with open(path, "wb") as f:
        f.write(data)
    return path


def _tasks(tables, *extra):
    args = {"--num-tasks": "1", "--tables-per-task": "3", "--devices": "2", "--memory-gb": "64"}
    for k, v in zip(extra[::2], extra[1::2]):
        args[k] = v
    return ["tasks", "--tables", tables, *[x for kv in args.items() for x in kv]]


def _place(w, *extra, planner="size_greedy", tables=None):
    return ["place", "--tables", tables or w["tables"], "--planner", planner, *extra]


def _evaluate(w, tasks, *extra, planners="size_greedy"):
    return ["evaluate", "--tables", w["tables"], "--tasks", tasks, "--planners", planners, *extra]


def _bench(w, d, *extra, shards="random:2", tables=None):
    return ["bench", "--tables", tables or w["tables"], "--shards", shards, "--batch-size", "64", "--iterations",
            "10", "--warmup", "1", "--comm-bandwidth-gbps", "10", "--comm-latency-us", "20", "--no-progress",
            *extra]


def _piece_shards(w, d, pieces) -> str:
    """A shards file of one shard: the first table of the world with the given piece columns (rows, dim -> dict)."""
    t = pq.read_table(w["tables"]).to_pandas().iloc[0]
    return raw_parquet(pd.DataFrame({"sample_id": ["s0"], "table_ids": [[str(t["table_id"])]], "num_devices": [2],
                                     "origin": ["given"], **pieces(int(t["rows"]), int(t["dim"]))}),
                       os.path.join(d, "shards.parquet"))


def _export(w, placements, tasks=None):
    return ["export", "--placements", placements, "--tables", w["tables"], "--no-torchrec",
            *(["--tasks", tasks] if tasks else [])]


def snapshot(*folders) -> dict:
    out = {}
    for folder in folders:
        for root, dirs, files in os.walk(folder):
            for name in dirs + files:
                p = os.path.join(root, name)
                out[p] = os.path.getmtime(p) if os.path.isfile(p) else "dir"
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input(case, world, tmp_path, capsys):
    inputs = tmp_path / "in"
    inputs.mkdir()
    argv, words, *code = CASES[case](world, str(inputs))  # a third item: the exit code, when not bad input's 2
    out = tmp_path / ("out.csv" if argv[0] == "predict" else "out")  # predict writes a .csv or .parquet file
    argv = argv + ["--out", str(out)]
    before = snapshot(str(inputs), world["root"])
    capsys.readouterr()
    try:
        rc = cli(argv)
    except SystemExit as exc:  # argparse
        rc = exc.code
    err = capsys.readouterr().err
    lines = [line for line in err.strip().splitlines() if line.strip() and not LOG_LINE.match(line)]
    assert rc == (code[0] if code else 2), f"exit {rc}: {err[-1500:]}"
    assert len(lines) == 1, err[-1500:]
    line = lines[0]
    assert line.startswith(f"embshard {argv[0]}: error:"), line
    for word in words:
        assert word in line, f"{word!r} not in: {line}"
    assert "np.float" not in line and "np.int" not in line and "\x1b" not in line and "Traceback" not in err
    assert not out.exists(), f"{case} left {sorted(os.listdir(out))}"
    assert snapshot(str(inputs), world["root"]) == before, "inputs changed or files were added next to them"


def test_the_battery_covers_every_stage():
    stages = {case.split("-")[0] for case in CASES} - {"spec", "dlrm", "synthetic"} | {"ingest"}
    assert {"ingest", "tasks", "place", "evaluate", "bench", "export"} <= stages
    assert len(CASES) >= 95


# -- a benchmark folder's fingerprint ----------------------------------------------------------------------------
def _bench_cmd(tables, out, batch="64", seed="0"):
    return [sys.executable, "-m", "embshard", "bench", "--tables", tables, "--shards", "random:8", "--out", out,
            "--max-tables", "3", "--batch-size", batch, "--warmup", "1", "--iterations", "10", "--seed", seed,
            "--comm-bandwidth-gbps", "10", "--comm-latency-us", "20", "--no-progress"]


def _bench_here(capsys, cmd) -> subprocess.CompletedProcess:
    """`cmd` (a _bench_cmd) run in this process: the refusals and the resume check what the job does, and a fresh
    interpreter costs seconds each (the kill itself needs a process of its own)."""
    capsys.readouterr()
    try:
        rc = cli(cmd[3:])
    except SystemExit as exc:  # argparse
        rc = exc.code
    out = capsys.readouterr()
    return subprocess.CompletedProcess(cmd, rc, out.out, out.err)


def test_killed_bench_resumes_to_the_same_result_and_other_settings_are_refused(world, tmp_path, capsys):
    out = str(tmp_path / "run")
    partial = os.path.join(out, "costs", ".partial", "part-00000-of-00001")
    proc = subprocess.Popen(_bench_cmd(world["tables"], out), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if os.path.isdir(partial) and len([f for f in os.listdir(partial) if f.endswith(".parquet")]) >= 2:
            break
        time.sleep(0.05)
    assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = sorted(f for f in os.listdir(partial) if f.endswith(".parquet"))
    assert 2 <= len(done) < 8
    before = pd.concat([schemas.read(os.path.join(partial, f), "costs") for f in done])

    # Another batch size after the kill: refused, nothing added to the partial results.
    res = _bench_here(capsys, _bench_cmd(world["tables"], out, batch="128"))
    assert res.returncode == 2, res.stderr[-2000:]
    assert "batch_size" in res.stderr and "64 there, 128 now" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    assert sorted(f for f in os.listdir(partial) if f.endswith(".parquet")) == done

    # The same settings resume: all shards, the ones measured before the kill kept as they were.
    res = _bench_here(capsys, _bench_cmd(world["tables"], out))
    assert res.returncode == 0, res.stderr[-2000:]
    costs = schemas.read(os.path.join(out, "costs"), "costs")
    assert len(costs) == 8 and costs["sample_id"].is_unique and (costs["batch_size"] == 64).all()
    merged = before.merge(costs, on="sample_id", suffixes=("_old", ""))
    assert len(merged) == len(before) and (merged["measured_at_old"] == merged["measured_at"]).all()
    finished = sorted(os.listdir(os.path.join(out, "costs")))

    # A finished folder: another seed, another batch size or other tables are refused, nothing changes.
    other_tables = os.path.join(str(tmp_path), "tables.parquet")
    df = world["tables_df"].copy()
    df.loc[0, "pooling_factor"] = df.loc[0, "pooling_factor"] + 1
    schemas.write(df, other_tables, "tables")
    for kw, what in (({"seed": "1"}, "seed 0 there, 1 now"), ({"batch": "128"}, "batch_size 64 there, 128 now")):
        res = _bench_here(capsys, _bench_cmd(world["tables"], out, **kw))
        assert res.returncode == 2 and what in res.stderr, res.stderr[-2000:]
    res = _bench_here(capsys, _bench_cmd(other_tables, out))
    assert res.returncode == 2 and "field 'tables'" in res.stderr, res.stderr[-2000:]
    assert sorted(os.listdir(os.path.join(out, "costs"))) == finished
    again = schemas.read(os.path.join(out, "costs"), "costs")
    assert again["measured_at"].equals(costs["measured_at"])


def test_reingest_removes_the_stale_tasks(world, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "tasks.parquet").write_bytes(Path(world["tasks"]).read_bytes())
    assert cli(["ingest", "--source", "synthetic", "--num-tables", "6", "--bins-batch-size", "256", "--out", str(out),
                "--no-progress"]) == 0
    assert (out / "tables.parquet").exists() and not (out / "tasks.parquet").exists()


def test_export_is_complete(world, tmp_path):
    out = tmp_path / "exp"
    assert cli(["export", "--placements", world["placements"], "--tables", world["tables"], "--tasks",
                world["tasks"], "--no-torchrec", "--out", str(out)]) == 0
    assert sorted(os.listdir(out)) == sorted(["placements.parquet", world["task_id"]])
    assert not [f for f in os.listdir(out) if f.startswith(".")]
    import json

    plan = json.loads((out / world["task_id"] / "plan.json").read_text())
    assert sorted(t["table_id"] for t in plan["tables"]) == sorted(first_ids(world, 3))


# -- issue 26 battery: outputs, export, plans, training --------------------------------------------------------
import json  # noqa: E402
import shutil  # noqa: E402

needs_torchrec = pytest.mark.skipif(
    __import__("importlib.util").util.find_spec("torchrec") is None, reason="torchrec not installed")


@pytest.fixture(scope="module")
def torchrec_plan_doc(world, tmp_path_factory):
    """The torchrec_plan.json `embshard export` writes for the world's test task (3 tables, 2 devices)."""
    out = tmp_path_factory.mktemp("trplan") / "exp"
    assert cli(["export", "--placements", world["placements"], "--tables", world["tables"], "--tasks",
                world["tasks"], "--out", str(out)]) == 0
    return json.loads((out / world["task_id"] / "torchrec_plan.json").read_text())


def _first_table(doc):
    return next(iter(doc["modules"][""]))


def _edit_param(key, value):
    def edit(doc):
        doc["modules"][""][_first_table(doc)][key] = value
        return doc
    return edit


def _rank99(doc):
    p = doc["modules"][""][_first_table(doc)]
    p["ranks"] = [99] * len(p["shards"])
    for s in p["shards"]:
        s["placement"] = "rank:99/cuda:99"
    return doc


def _drop_table(doc):
    del doc["modules"][""][_first_table(doc)]
    return doc


def _ranks_disagree(doc):
    p = doc["modules"][""][_first_table(doc)]
    p["ranks"] = [1 - r for r in p["ranks"]]
    return doc


def _slice_gap(doc):
    p = doc["modules"][""][_first_table(doc)]
    p["shards"][0]["offsets"] = [0, 4]
    return doc


PLAN_CASES = {
    # (edit of the exported document or raw text, words the one-line error must contain)
    "plan-table-missing": (_drop_table, ["modules", "the plan does not place"]),
    "plan-rank-99-on-2-devices": (_rank99, ["ranks", "rank 99", "world of 2 ranks"]),
    "plan-ranks-disagree-with-shards": (_ranks_disagree, ["ranks", "disagree"]),
    "plan-sharding-type-bogus": (_edit_param("sharding_type", "bogus"), ["sharding_type", "bogus"]),
    "plan-compute-kernel-bogus": (_edit_param("compute_kernel", "gpu_magic"), ["compute_kernel"]),
    # TorchRec's EBC runs a sharded table with a fused kernel only: dense is data_parallel's, quant inference's
    "plan-table-wise-with-dense-kernel": (_edit_param("compute_kernel", "dense"),
                                          ["compute_kernel", "cannot run the 'dense' kernel", "write 'fused'"]),
    "plan-table-wise-with-quant-kernel": (_edit_param("compute_kernel", "quant"), ["compute_kernel", "'quant'"]),
    "plan-no-shards": (_edit_param("shards", []), ["shards"]),
    "plan-column-gap": (_slice_gap, ["shards", "column"]),
    "plan-no-modules": (lambda doc: {k: v for k, v in doc.items() if k != "modules"}, ["modules"]),
    "plan-wrong-schema": (lambda doc: {**doc, "schema": "other/v9"}, ["schema"]),
    "plan-not-an-object": (lambda doc: [doc], ["schema"]),
    "plan-invalid-json": ("{\"schema\": ", ["json", "not valid JSON"]),
    "plan-empty-file": ("", ["json"]),
    # a plan written in YAML, as table specs may be: said as such, with how to write it as JSON
    "plan-yaml": ("schema: embshard.torchrec_plan/v1\nworld_size: 2\n", ["a YAML mapping, not JSON", "json.dump"]),
}


@needs_torchrec
@pytest.mark.parametrize("case", sorted(PLAN_CASES))
def test_bad_torchrec_plan_is_refused_before_training(case, torchrec_plan_doc, tmp_path):
    """What a training job loads: one EmbshardError naming the file and the field, never a plan TorchRec would
    shard wrongly (or a bare JSONDecodeError / KeyError)."""
    import copy

    from embshard.errors import EmbshardError
    from embshard.export.torchrec_plan import plan_from_json

    edit, words = PLAN_CASES[case]
    path = tmp_path / "torchrec_plan.json"
    path.write_text(edit if isinstance(edit, str) else json.dumps(edit(copy.deepcopy(torchrec_plan_doc))))
    with pytest.raises(EmbshardError) as err:
        plan_from_json(str(path))
    line = str(err.value)
    assert "\n" not in line and line.startswith(str(path)), line
    for word in words:
        assert word in line, f"{word!r} not in: {line}"


@needs_torchrec
def test_torchrec_plan_checked_against_the_callers_tables_and_world(world, torchrec_plan_doc, tmp_path):
    from embshard.errors import EmbshardError
    from embshard.export.torchrec_plan import plan_from_json, rank_layout
    from embshard.tableset import TableSet

    path = tmp_path / "torchrec_plan.json"
    path.write_text(json.dumps(torchrec_plan_doc))
    ts = TableSet.read(world["tables"])
    task_tables = ts.select(first_ids(world, 3))
    plan = plan_from_json(str(path), tables=task_tables, world_size=2)  # the right ones load
    assert sorted(rank_layout(plan)) == sorted(first_ids(world, 3))
    with pytest.raises(EmbshardError, match="field 'modules'.*9 table"):
        plan_from_json(str(path), tables=ts)  # the model has 12 tables, the plan places 3
    with pytest.raises(EmbshardError, match=r"field 'world_size'.*not 4 \(world_size=\)"):
        plan_from_json(str(path), world_size=4)
    # Another plan's tables (4 devices): only what disagrees with the file is named (not "not 2 (world_size=)").
    other = {"num_devices": 4, "tables": [{"table_id": str(t), "rows": int(r), "dim": int(d)} for t, r, d in
                                          zip(task_tables.table_ids, task_tables.rows, task_tables.dims)]}
    with pytest.raises(EmbshardError) as err:
        plan_from_json(str(path), tables=other, world_size=2)
    assert "a world of 2 ranks, not 4 (the tables' plan)" in str(err.value) and "not 2" not in str(err.value)
    # An older file without world_size/tables is still checked against what the caller gives.
    old = {k: v for k, v in torchrec_plan_doc.items() if k not in ("world_size", "tables")}
    path.write_text(json.dumps(_rank99(old)))
    with pytest.raises(EmbshardError, match="rank 99 is beyond a world of 2 ranks"):
        plan_from_json(str(path), world_size=2)
    with pytest.raises(EmbshardError, match=r"the world sizes disagree: 2 \(world_size=\), 4 \(the tables' plan\)"):
        plan_from_json(str(path), tables=other, world_size=2)


# Outputs: an output that is (or would overwrite) one of the command's inputs, an existing file given as a folder,
# a folder where a file is written, an unreachable store. Refused before any work (the command's main is never
# reached), one line, nothing written, the inputs untouched.
def _copy(w, d, key, name):
    path = os.path.join(d, name)
    shutil.copy(w[key], path)
    return path


def _shards_csv(w, d, name="shards.csv"):
    return spec(d, f"sample_id,table_ids,num_devices\ns0,{' '.join(first_ids(w, 2))},2\n", name)


def _costs_dir(d):
    os.makedirs(os.path.join(d, "costs"))
    return os.path.join(d, "costs")


OUTPUT_CASES = {
    # a file as the pipeline's --out or a stage's --root was a FileExistsError traceback
    "pipeline-out-is-a-file": lambda w, d: (["pipeline", "--out", _copy(w, d, "tables", "afile")],
                                            ["afile", "field 'out'", "is a file"]),
    "stage-root-is-a-file": lambda w, d: (["stage", "ingest", "--root", _copy(w, d, "tables", "afile")],
                                          ["afile", "field 'root'", "is a file"]),
    "predict-out-is-its-tables": lambda w, d: (
        ["predict", "--tables", _copy(w, d, "tables", "t.parquet"), "--shards", _shards_csv(w, d), "--out",
         os.path.join(d, "t.parquet")], ["t.parquet", "field 'out'", "--tables input"]),
    "predict-out-is-its-shards": lambda w, d: (
        ["predict", "--tables", w["tables"], "--shards", _shards_csv(w, d), "--out", os.path.join(d, "shards.csv")],
        ["shards.csv", "--shards input"]),
    "predict-out-json": lambda w, d: (
        ["predict", "--tables", w["tables"], "--shards", _shards_csv(w, d), "--out", os.path.join(d, "o.json")],
        ["o.json", "field 'out'", ".parquet or .csv"]),
    "ingest-out-under-proc": lambda w, d: (
        ["ingest", "--source", "synthetic", "--num-tables", "4", "--out", "/proc/embshard-out"],
        ["/proc/embshard-out", "field 'out'", "nothing can be created"]),
    "predict-out-is-a-folder": lambda w, d: (
        ["predict", "--tables", w["tables"], "--shards", _shards_csv(w, d), "--out", d], ["out", "is a folder"]),
    "place-out-is-its-tables": lambda w, d: (
        ["place", "--tables", _copy(w, d, "tables", "t.parquet"), "--planner", "size_greedy", "--devices", "2",
         "--memory-gb", "8", "--out", os.path.join(d, "t.parquet")], ["t.parquet", "--tables input"]),
    "place-out-overwrites-its-tasks": lambda w, d: (
        _place(w, "--tasks", _copy(w, d, "tasks", "placements.parquet"), "--task-id", w["task_id"], "--out", d),
        ["out", "would overwrite the --tasks input"]),
    "place-out-existing-file": lambda w, d: (
        _place(w, "--devices", "2", "--memory-gb", "8", "--out", spec(d, "x", "afile")), ["afile", "is a file"]),
    "place-out-under-a-file": lambda w, d: (
        _place(w, "--devices", "2", "--memory-gb", "8", "--out", os.path.join(spec(d, "x", "afile"), "sub")),
        ["afile", "is a file"]),
    "place-out-plan-json-is-a-folder": lambda w, d: (
        _place(w, "--devices", "2", "--memory-gb", "8", "--out", os.path.dirname(
            _mkdir(d, "o", "plan.json"))), ["plan.json", "is a folder"]),
    "tasks-out-is-its-tables": lambda w, d: (
        ["tasks", "--tables", _copy(w, d, "tables", "t.parquet"), "--num-tasks", "1", "--out",
         os.path.join(d, "t.parquet")], ["t.parquet", "--tables input"]),
    "tasks-out-overwrites-its-tables": lambda w, d: (
        ["tasks", "--tables", _copy(w, d, "tables", "tasks.parquet"), "--num-tasks", "1", "--out", d],
        ["would overwrite the --tables input"]),
    "tasks-out-existing-file": lambda w, d: (
        ["tasks", "--tables", w["tables"], "--num-tasks", "1", "--out", spec(d, "x", "afile")], ["afile", "is a file"]),
    "evaluate-out-existing-file": lambda w, d: (
        _evaluate(w, w["tasks"], "--out", spec(d, "x", "afile")), ["afile", "is a file"]),
    "evaluate-out-is-its-tasks": lambda w, d: (
        _evaluate(w, _copy(w, d, "tasks", "tasks.parquet"), "--out", os.path.join(d, "tasks.parquet")),
        ["--tasks input"]),
    "export-out-holds-its-placements": lambda w, d: (
        _export(w, _copy(w, d, "placements", "placements.parquet")) + ["--out", d],
        ["--placements input"]),
    "bench-out-overwrites-its-tables": lambda w, d: (
        _bench(w, d, "--out", d, tables=shutil.copy(w["tables"], _costs_dir(d))),
        ["would overwrite the --tables input"]),
    "ingest-out-is-its-input": lambda w, d: (
        ["ingest", "--source", "spec", "--input", spec(d, spec_row("a,10,4,1")), "--out", os.path.join(d, "spec.csv")],
        ["spec.csv", "--input input"]),
    "ingest-out-tables-parquet-is-a-folder": lambda w, d: (
        ["ingest", "--source", "synthetic", "--num-tables", "4", "--out", os.path.dirname(
            _mkdir(d, "o", "tables.parquet"))], ["tables.parquet", "is a folder"]),
    "train-cost-out-is-its-costs": lambda w, d: (
        ["train-cost", "--costs", _costs_dir(d), "--tables", w["tables"], "--out", os.path.join(d, "costs")],
        ["costs", "--costs input"]),
    "train-policy-out-is-its-tables": lambda w, d: (
        ["train-policy", "--tables", _copy(w, d, "tables", "t.parquet"), "--tasks", w["tasks"], "--out",
         os.path.join(d, "t.parquet")], ["--tables input"]),
}


def _mkdir(d, *parts):
    path = os.path.join(d, *parts)
    os.makedirs(path)
    return path


def _run_refused(argv, words, before_dirs, capsys, monkeypatch, code=2):
    """One CLI call that must be refused by the output check, before the command's main runs."""
    import importlib

    from embshard.cli import COMMANDS

    def no_work(args):
        raise AssertionError("the command started its work before its --out was checked")

    monkeypatch.setattr(importlib.import_module(COMMANDS[argv[0]][0]), "main", no_work)
    before = snapshot(*before_dirs)
    capsys.readouterr()
    try:
        rc = cli(argv)
    except SystemExit as exc:
        rc = exc.code
    err = capsys.readouterr().err
    lines = [line for line in err.strip().splitlines() if line.strip() and not LOG_LINE.match(line)]
    assert rc == code, f"exit {rc}: {err[-1500:]}"
    assert len(lines) == 1 and lines[0].startswith(f"embshard {argv[0]}: error:"), err[-1500:]
    for word in words:
        assert word in lines[0], f"{word!r} not in: {lines[0]}"
    assert snapshot(*before_dirs) == before, "inputs changed or files were written"
    return lines[0]


@pytest.mark.parametrize("case", sorted(OUTPUT_CASES))
def test_bad_output(case, world, tmp_path, capsys, monkeypatch):
    d = tmp_path / "in"
    d.mkdir()
    argv, words = OUTPUT_CASES[case](world, str(d))
    _run_refused(argv, words, [str(d), world["root"]], capsys, monkeypatch)


def test_out_in_a_read_only_folder(world, tmp_path, capsys, monkeypatch):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    if os.geteuid() == 0:  # root writes anyway: the folder is shown as read-only to the check instead
        real_access = os.access
        monkeypatch.setattr(os, "access", lambda p, mode, **kw: (os.path.realpath(p) != str(ro.resolve())
                                                                 and real_access(p, mode, **kw)))
    try:
        for argv in (_place(world, "--devices", "2", "--memory-gb", "8", "--out", str(ro / "plan")),
                     ["tasks", "--tables", world["tables"], "--num-tasks", "1", "--out", str(ro)],
                     _evaluate(world, world["tasks"], "--out", str(ro / "ev"))):
            _run_refused(argv, ["not writable", str(ro)], [str(tmp_path), world["root"]], capsys, monkeypatch)
    finally:
        ro.chmod(0o755)


def test_unreachable_s3_out_is_one_line(world, tmp_path, capsys, monkeypatch):
    # A store that refuses connections at once (hermetic: no network needed).
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "y")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    t0 = time.time()
    line = _run_refused(_place(world, "--devices", "2", "--memory-gb", "8", "--out", "s3://embshard-nosuch/x"),
                        ["s3://embshard-nosuch/x", "field 'out'", "cannot reach"], [world["root"]], capsys,
                        monkeypatch, code=75)  # try again (EX_TEMPFAIL): a cluster's stage pod is retried
    assert time.time() - t0 < 30, line


def test_an_s3_region_that_cannot_be_resolved_is_one_line(world, capsys, monkeypatch):
    """On AWS (no AWS_ENDPOINT_URL) pyarrow asks the store for the bucket's region while it resolves the URI: a store
    that did not answer there had been a traceback, exit 1 (the reachability checks came after it). Hermetic: the
    resolver fails as pyarrow's does without a network."""
    import types

    import pyarrow.fs as pafs

    from embshard import storage

    def no_region(uri):
        raise OSError(f"When resolving region for bucket '{uri.split('/')[2]}': AWS Error NETWORK_CONNECTION during "
                      "HeadBucket operation: curlCode: 6, Couldn't resolve host name")

    fake = types.SimpleNamespace(**{k: getattr(pafs, k) for k in dir(pafs) if not k.startswith("__")})
    fake.FileSystem = types.SimpleNamespace(from_uri=no_region)
    monkeypatch.setattr(storage, "pafs", fake)
    _run_refused(_place(world, "--devices", "2", "--memory-gb", "8", "--out", "s3://embshard-nosuch/x"),
                 ["s3://embshard-nosuch/x", "field 'out'", "cannot reach", "AWS_REGION"], [world["root"]], capsys,
                 monkeypatch, code=75)
    from embshard import schemas
    from embshard.errors import StoreUnreachableError

    with pytest.raises(StoreUnreachableError, match="cannot reach") as err:  # an input read the same way
        schemas.read("s3://embshard-nosuch/tables.parquet", "tables")
    assert err.value.exit_code == 75


def test_unreachable_s3_tables_are_one_line(world, tmp_path, capsys, monkeypatch):
    """`--tables s3://...` that does not answer ended in a 33-line traceback, exit 1 (place, evaluate, export,
    predict all read tables this way); an s3:// spec, which is read from a local path only, says so."""
    for key, value in (("AWS_ENDPOINT_URL", "http://127.0.0.1:9"), ("AWS_ACCESS_KEY_ID", "x"),
                       ("AWS_SECRET_ACCESS_KEY", "y"), ("AWS_EC2_METADATA_DISABLED", "true")):
        monkeypatch.setenv(key, value)
    cases = {"s3-tables": lambda w, d: (_place(w, "--devices", "2", "--memory-gb", "8",
                                               tables="s3://embshard-nosuch/tables.parquet"),
                                        ["s3://embshard-nosuch/tables.parquet", "cannot reach", "check the bucket"],
                                        75),  # a store that did not answer: try again (EX_TEMPFAIL), not bad input
             "s3-spec": lambda w, d: (_place(w, "--devices", "2", "--memory-gb", "8",
                                             tables="s3://embshard-nosuch/spec.csv"),
                                      ["s3://embshard-nosuch/spec.csv", "local path only"])}
    # a URI no file system takes is a mistake in the path (2), not a store to try again (75)
    cases["foo-uri-tables"] = lambda w, d: (_place(w, "--devices", "2", "--memory-gb", "8", tables="foo://x/t.parquet"),
                                            ["foo://x/t.parquet", "not a path or URI embshard reads"])
    for case, make in cases.items():
        monkeypatch.setitem(CASES, case, make)
        (tmp_path / case).mkdir()
        test_bad_input(case, world, tmp_path / case, capsys)
    from embshard import storage
    from embshard.errors import EmbshardError

    with pytest.raises(EmbshardError, match="not a path or URI embshard reads") as err:
        storage.check_output("s3:///x", field="out")
    assert err.value.exit_code == 2 and err.value.field == "out"


def test_champion_flags_without_set_are_refused_not_ignored(capsys):
    """`champion --reason x` or `--force` without `--set` had listed the versions, the flag ignored."""
    for flag in (["--reason", "because"], ["--force"]):
        assert cli(["champion", *flag]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"{flag[0]} goes with --set" in err[0] and "field 'set'" in err[0], err


def test_place_with_a_cost_model_as_policy_is_one_line(world, tmp_path, capsys, monkeypatch):
    """`place --model models:/embshard-cost@...`: the registry hands back a cost model, not a policy."""
    from embshard import registry
    from embshard.costmodel.pyfunc import CostModelPyfunc

    monkeypatch.setattr(registry, "load_python_model", lambda uri: CostModelPyfunc())
    out = tmp_path / "out"
    capsys.readouterr()
    rc = cli(_place(world, "--devices", "2", "--memory-gb", "8", "--model", "models:/embshard-cost@champion",
                    "--out", str(out), planner="learned"))
    err = capsys.readouterr().err
    lines = [line for line in err.strip().splitlines() if line.strip() and not LOG_LINE.match(line)]
    assert rc == 2 and len(lines) == 1, err[-1500:]
    assert "cost model" in lines[0] and "embshard-policy" in lines[0] and "field 'model'" in lines[0], lines[0]
    assert not out.exists()


# Side effects: nothing is written outside --out.
@pytest.mark.parametrize("planner", ["size_greedy", "learned", "learned@challenger"])
def test_place_writes_nothing_outside_out(planner, world, tmp_path, monkeypatch, capsys):
    """Without MLFLOW_TRACKING_URI, a heuristic planner does not create mlflow.db (or anything) in the working
    folder; a learned one with no store says so in one line, and creates nothing either."""
    import mlflow

    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    mlflow.set_tracking_uri(None)
    mlflow.set_registry_uri(None)
    try:
        rc = cli(_place(world, "--devices", "2", "--memory-gb", "64", "--out", str(tmp_path / "out"),
                        planner=planner))
    finally:
        mlflow.set_tracking_uri(None)
        mlflow.set_registry_uri(None)
    err = capsys.readouterr().err
    assert os.listdir(cwd) == []
    if planner.startswith("learned"):
        assert rc == 2 and "no MLflow store" in err, err[-1500:]
        # the error is located at the model the planner name asks for, not at --model's default
        uri = "models:/embshard-policy@" + ("challenger" if "@" in planner else "champion")
        assert f"error: {uri}: no registered learned planner" in err, err[-1500:]
        assert "set MLFLOW_TRACKING_URI" in err and "--planner size_lookup_greedy" in err, err[-1500:]
        assert not (tmp_path / "out").exists()
    else:
        assert rc == 0, err[-1500:]
        assert sorted(os.listdir(tmp_path / "out")) == ["devices.png", "placements.parquet", "plan.json"]


def test_failed_place_says_the_plan_in_out_is_an_older_one(world, tmp_path, capsys, caplog):
    """A failed `place` into an --out that holds an earlier plan leaves it as it was (nothing half-written) and
    says so: a script reading OUT/plan.json after the command could not tell it from this run's."""
    out = tmp_path / "out"
    assert cli(_place(world, "--devices", "2", "--memory-gb", "64", "--out", str(out))) == 0
    before = (out / "plan.json").read_bytes()
    made = json.loads(before)["created_at"]
    capsys.readouterr()
    rc = cli(_place(world, "--devices", "2", "--memory-gb", "0.000001", "--out", str(out)))
    err = capsys.readouterr().err
    assert rc == 2 and (out / "plan.json").read_bytes() == before, err[-1500:]
    assert (f"{out / 'plan.json'} is an older plan (made at {made}), left as it was: this run wrote nothing"
            in caplog.text), caplog.text
    assert "embshard place: error:" in err and "field 'memory_gb'" in err, err[-1500:]
    # into an empty folder: no such note
    caplog.clear()
    assert cli(_place(world, "--devices", "2", "--memory-gb", "0.000001", "--out", str(tmp_path / "new"))) == 2
    assert "older plan" not in caplog.text


# Export: the module path, stale files of an earlier export, what a killed export left.
CASES_26_EXPORT = {
    "export-module-path-parent": lambda w, d: (
        _export(w, w["placements"])[:-1] + ["--module-path", "../x"], ["module_path", "../x"]),
    "export-module-path-empty-part": lambda w, d: (
        _export(w, w["placements"])[:-1] + ["--module-path", "model..ebc"], ["module_path", "model..ebc"]),
    "export-module-path-space": lambda w, d: (
        _export(w, w["placements"])[:-1] + ["--module-path", "sparse arch"], ["module_path"]),
}


# -- issue 26 battery: tables, specs, traces, measurement --------------------------------------------------------
# Each row goes through test_bad_input's checks (exit 2, one line naming the input and the field, nothing written).
def _root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


def _fifo(d, name) -> str:
    path = os.path.join(d, name)
    os.mkfifo(path)
    return path


def _unreadable(d, name, data: bytes) -> str:
    if _root():
        pytest.skip("runs as root: chmod 000 does not stop root from reading, so permission denied cannot happen")
    path = _write_bytes(d, name, data)
    os.chmod(path, 0)
    return path


def _bool_trace(d, name="trace.pt") -> str:
    import torch

    path = os.path.join(d, name)
    torch.save((torch.ones(8, dtype=torch.bool), torch.arange(9, dtype=torch.int64),
                torch.ones(2, 4, dtype=torch.int64)), path)
    return path


def _train_tasks_with_unknown_table(w, d) -> str:
    df = w["tasks_df"].copy()
    df["table_ids"] = [["t_unknown"] if s == "train" else list(ids) for s, ids in zip(df["split"], df["table_ids"])]
    return raw_parquet(df, os.path.join(d, "tasks.parquet"))


def _predict(w, d, csv_text):
    return ["predict", "--tables", w["tables"], "--shards", spec(d, csv_text, "shards.csv"), "--model",
            os.path.join(d, "no-model")]


def _tables_with_width(w, d, width: int) -> str:
    """Table 0 with `width`-byte weights and a consistent size_bytes (only the width is wrong)."""
    df = w["tables_df"]
    return tables_with(w, d, bytes_per_element=(0, width), size_bytes=(0, int(df["rows"][0] * df["dim"][0] * width)))


CASES_26_DATA = {
    # measurement: only fp32 (4) and fp16 (2) weights exist; other widths were measured as fp32
    "i26-bench-table-8-byte-weights": lambda w, d: (
        _bench(w, d, tables=_tables_with_width(w, d, 8)), ["tables.parquet", "bytes_per_element", "fp32"]),
    "i26-tasks-table-1-byte-weights": lambda w, d: (_tasks(_tables_with_width(w, d, 1)),
                                                    ["tables.parquet", "bytes_per_element", "fp16"]),
    "i26-spec-data-type-fp64": ingest_spec(spec_row("a,10,4,1,fp64", ",data_type", ",fp32")),
    # dims FBGEMM cannot measure: refused at ingest, not an AssertionError in bench
    "i26-spec-dim-3": lambda w, d: (ingest_spec(spec_row("a,10,3,1"))(w, d)[0],
                                    ["spec.csv", "embedding_dim", "'a'", "line 3", "multiple of 4"]),
    "i26-dlrm-dim-6": lambda w, d: (["ingest", "--source", "dlrm", "--input", trace(d), "--dim", "6"],
                                    ["dim", "multiple of 4"]),
    "i26-bench-table-dim-6": lambda w, d: (_bench(w, d, tables=tables_with(w, d, dim=(0, 6))),
                                           ["tables.parquet", "dim", "multiple of 4"]),
    # ids match the whole string: a trailing newline is not allowed
    "i26-tasks-table-id-newline": lambda w, d: (_tasks(tables_with(w, d, table_id=(0, "t0000\n"))),
                                                ["tables.parquet", "table_id"]),
    "i26-evaluate-task-id-newline": lambda w, d: (_evaluate(w, tasks_with(w, d, task_id="evil\n")),
                                                  ["tasks.parquet", "task_id"]),
    # spec columns: twice, unknown (a typo), bins batch size
    "i26-spec-column-twice": lambda w, d: (ingest_spec(f"{HEAD},embedding_dim\na,10,4,1,8\n")(w, d)[0],
                                           ["spec.csv", "embedding_dim", "twice"]),
    "i26-spec-yaml-key-twice": lambda w, d: (ingest_spec(
        "tables:\n  - {name: a, num_embeddings: 10, embedding_dim: 4, embedding_dim: 8, pooling_factor: 1}\n",
        "spec.yaml")(w, d)[0], ["spec.yaml", "embedding_dim", "twice"]),
    "i26-spec-unknown-column-dtype": lambda w, d: (ingest_spec(spec_row("a,10,4,1,fp16", ",dtype", ",fp16"))(w, d)[0],
                                                   ["spec.csv", "'dtype'", "unknown column", "data_type"]),
    "i26-spec-unknown-column-zipf_alfa": lambda w, d: (
        ingest_spec(spec_row("a,10,4,1,0.5", ",zipf_alfa", ",0.5"))(w, d)[0],
        ["spec.csv", "'zipf_alfa'", "did you mean 'zipf_alpha'"]),
    "i26-spec-parquet-unknown-column": lambda w, d: (
        ["ingest", "--source", "spec", "--input", raw_parquet(pd.DataFrame(
            {"name": ["a"], "num_embeddings": [10], "embedding_dim": [4], "pooling_factor": [1.0], "dtype": ["fp16"]}),
            os.path.join(d, "spec.parquet"))], ["spec.parquet", "'dtype'"]),
    # a Parquet timestamp column had been read as its milliseconds: pooling factors 1 and 2 planned as 1000, 2000
    "spec-parquet-timestamp-column": lambda w, d: (
        ["ingest", "--source", "spec", "--input", raw_parquet(pd.DataFrame(
            {"name": ["a", "b"], "num_embeddings": [10, 20], "embedding_dim": [4, 4],
             "pooling_factor": pd.to_datetime([1, 2], unit="s")}), os.path.join(d, "spec.parquet"))],
        ["spec.parquet", "pooling_factor", "not numbers"]),
    "i26-spec-bins-batch-zero": lambda w, d: (ingest_spec(spec_row("a,10,4,1"))(w, d)[0] + ["--bins-batch-size", "0"],
                                              ["bins_batch_size"]),
    "i26-spec-bins-batch-negative": lambda w, d: (
        ingest_spec(spec_row("a,10,4,1"))(w, d)[0] + ["--bins-batch-size", "-5"], ["bins_batch_size"]),
    "i26-synthetic-bins-batch-zero": lambda w, d: (
        ["ingest", "--source", "synthetic", "--num-tables", "4", "--bins-batch-size", "0"], ["bins_batch_size"]),
    # traces: boolean indices are not ids
    "i26-dlrm-bool-indices": lambda w, d: (["ingest", "--source", "dlrm", "--input", _bool_trace(d)],
                                           ["trace.pt", "indices"]),
    # clear messages: the field count, the name, permission denied, the tasks file
    "i26-spec-extra-field": lambda w, d: (ingest_spec(spec_row("a,10,4,1,9"))(w, d)[0],
                                          ["spec.csv", "line 3 has 5 values", "4 columns"]),
    "i26-spec-hash-in-name": lambda w, d: (ingest_spec(spec_row("a#b,10,4,1"))(w, d)[0],
                                           ["spec.csv", "field 'name'", "a#b"]),
    "i26-tasks-tables-unreadable": lambda w, d: (
        _tasks(_unreadable(d, "tables.parquet", Path(w["tables"]).read_bytes())), ["tables.parquet", "permission"]),
    "i26-spec-unreadable": lambda w, d: (
        ["ingest", "--source", "spec", "--input", _unreadable(d, "spec.csv", spec_row("a,10,4,1").encode())],
        ["spec.csv", "permission"]),
    "i26-bench-tasks-unknown-table": lambda w, d: (
        _bench(w, d, "--tasks", _train_tasks_with_unknown_table(w, d)), ["tasks.parquet", "table_ids", "t_unknown"]),
    "i26-evaluate-task-unknown-table": lambda w, d: (_evaluate(w, tasks_with(w, d, table_ids=["t_unknown"])),
                                                     ["tasks.parquet", "table_ids", "t_unknown"]),
    "i26-bench-placements-unknown-table": lambda w, d: (
        _bench(w, d, "--placements", placements_with(w, d, lambda df: df.assign(
            table_id=["t_unknown"] + list(df["table_id"][1:])))), ["placements.parquet", "table_ids", "t_unknown"]),
    # non-regular files are refused at once (a FIFO used to block forever)
    "i26-tasks-tables-fifo": lambda w, d: (_tasks(_fifo(d, "tables.parquet")), ["tables.parquet", "FIFO"]),
    "i26-spec-fifo": lambda w, d: (["ingest", "--source", "spec", "--input", _fifo(d, "spec.csv")],
                                   ["spec.csv", "FIFO"]),
    "i26-dlrm-fifo": lambda w, d: (["ingest", "--source", "dlrm", "--input", _fifo(d, "t.pt")], ["t.pt", "FIFO"]),
    "i26-dlrm-rows-file-fifo": lambda w, d: (
        ["ingest", "--source", "dlrm", "--input", trace(d), "--rows-file", _fifo(d, "rows.txt")],
        ["rows.txt", "FIFO"]),
    "i26-predict-shards-fifo": lambda w, d: (["predict", "--tables", w["tables"], "--shards", _fifo(d, "s.csv"),
                                              "--model", os.path.join(d, "m")], ["s.csv", "FIFO"]),
    # seeds, a bound on tasks, a table listed three times in one shard
    "i26-ingest-seed-negative": lambda w, d: (["ingest", "--source", "synthetic", "--num-tables", "4", "--seed", "-1"],
                                              ["seed", "0 to"]),
    "i26-tasks-seed-negative": lambda w, d: (_tasks(w["tables"], "--seed", "-1"), ["seed"]),
    "i26-tasks-num-tasks-huge": lambda w, d: (_tasks(w["tables"], "--num-tasks", "100000000"),
                                              ["num_tasks", "10,000"]),
    "i26-predict-table-thrice": lambda w, d: (
        _predict(w, d, f"sample_id,table_ids,num_devices\ns0,{' '.join([first_ids(w, 1)[0]] * 3)},2\n"),
        ["shards.csv", "table_ids", "3 times"]),
}


def _trace_with_index(d, index: int) -> str:
    import torch

    indices = torch.arange(8, dtype=torch.int64) % 3
    indices[0] = index
    path = os.path.join(d, "t.pt")
    torch.save((indices, torch.arange(9, dtype=torch.int64), torch.ones(2, 4, dtype=torch.int64)), path)
    return path


def _placements_with_kind(w, d, kind: str) -> str:
    df = w["placements_df"].copy()
    df.loc[0, "kind"] = kind
    return raw_parquet(df, os.path.join(d, "placements.parquet"))


# Found by a user's session of bad inputs (the eleventh): each used to pass, or end in a traceback.
CASES_S11 = {
    "s11-dlrm-raw-id-index": lambda w, d: (["ingest", "--source", "dlrm", "--input", _trace_with_index(d, 2**63 - 1)],
                                           ["t.pt", "field 'indices'", "2^62"]),
    "s11-dlrm-rows-file-over-2^62": lambda w, d: (
        ["ingest", "--source", "dlrm", "--input", trace(d), "--rows-file", spec(d, "4611686018427387905 3", "r.txt")],
        ["r.txt", "field 'rows'", "over 2^62"]),
    "s11-dlrm-rows-file-extra-sizes": lambda w, d: (
        ["ingest", "--source", "dlrm", "--input", trace(d), "--rows-file", spec(d, "10 10 10", "r.txt")],
        ["r.txt", "3 hash sizes for 2 tables"]),
    "s11-dlrm-more-tables-than-the-trace": lambda w, d: (
        ["ingest", "--source", "dlrm", "--input", trace(d), "--num-tables", "5"],
        ["trace.pt", "num_tables", "holds 2"]),
    # rows x dim x bytes wraps around int64 to 512: the old check compared it with size_bytes 512 and passed
    "s11-tables-size-wraps-around": lambda w, d: (
        ["place", "--tables", tables_with(w, d, rows=(0, 4611686018427387905), dim=(0, 128),
                                          bytes_per_element=(0, 4), size_bytes=(0, 512)),
         "--planner", "size_greedy", "--devices", "2", "--memory-gb", "8"], ["tables.parquet", "field 'rows'"]),
    "s11-yaml-name-not-text": lambda w, d: (
        ingest_spec("tables:\n  - {name: yes, num_embeddings: 10, embedding_dim: 4, pooling_factor: 1}\n",
                    "spec.yaml")(w, d)[0], ["spec.yaml", "field 'name'", "not text"]),
    "s11-predict-devices-over-max": lambda w, d: (
        _predict(w, d, f"sample_id,table_ids,num_devices\ns0,{first_ids(w, 1)[0]},100000000000\n"),
        ["shards.csv", "num_devices"]),
    "s11-predict-devices-bool": lambda w, d: (
        _predict(w, d, f"sample_id,table_ids,num_devices\ns0,{first_ids(w, 1)[0]},true\n"),
        ["shards.csv", "num_devices", "boolean"]),
    "s11-export-unknown-kind": lambda w, d: (_export(w, _placements_with_kind(w, d, "bogus")),
                                             ["placements.parquet", "field 'kind'"]),
    "s11-synthetic-trace-batch-negative": lambda w, d: (
        ["ingest", "--source", "synthetic", "--num-tables", "4", "--write-traces", "--trace-batch-size", "-1"],
        ["trace_batch_size"]),
    "s11-place-refine-rounds-alone": lambda w, d: (
        _place(w, "--devices", "2", "--memory-gb", "8", "--refine-rounds", "3"), ["refine_rounds", "--refine K"]),
    "s11-synthetic-with-dlrm-dim": lambda w, d: (["ingest", "--source", "synthetic", "--num-tables", "4", "--dim", "8"],
                                                 ["--dim", "--source synthetic"]),
    # a TorchRec team's session (twenty-fourth): --batch-size 0 ran at the default batch, said nowhere
    "s24-evaluate-batch-size-0": lambda w, d: (_evaluate(w, w["tasks"], "--batch-size", "0", "--rounds", "1"),
                                               ["field 'batch_size'", "batch size 0"]),
}


def _trace_of(d, offsets, lengths) -> str:
    """A 2-table, 4-sample trace of 8 ids with the given offsets and lengths tensors."""
    import torch

    path = os.path.join(d, "t.pt")
    torch.save((torch.arange(8, dtype=torch.int64) % 3, offsets, lengths), path)
    return path


def _copied(d, name: str, copy: str) -> str:
    import shutil

    return shutil.copyfile(os.path.join(d, name), os.path.join(d, copy))


def _saved(d, obj) -> str:
    import torch

    path = os.path.join(d, "t.pt")
    torch.save(obj, path)
    return path


def _empty_trace(d) -> str:
    import torch

    path = os.path.join(d, "t.pt")
    torch.save((torch.zeros(0, dtype=torch.int64), torch.zeros(9, dtype=torch.int64),
                torch.zeros(2, 4, dtype=torch.int64)), path)
    return path


# A data engineer's session with their own DLRM traces (twenty-seventh): each had been ingested without an error.
CASES_S27 = {
    # flat offsets 5..13 over 8 ids: read as their differences alone (the first ids lost, or another file's offsets)
    "s27-dlrm-flat-offsets-not-from-0": lambda w, d: (
        ["ingest", "--source", "dlrm", "--input", _trace_of(d, torch_arange(5, 14), torch_ones(2, 4))],
        ["t.pt", "field 'offsets'", "start at 5, not 0"]),
    # per-table offsets: table 1's start at 7, neither 0 nor its position 4
    "s27-dlrm-table-offsets-odd-start": lambda w, d: (
        ["ingest", "--source", "dlrm", "--input",
         _trace_of(d, torch_tensor([[0, 1, 2, 3, 4], [7, 8, 9, 10, 11]]), torch_ones(2, 4))],
        ["t.pt", "field 'offsets'", "table 1's offsets start at 7"]),
    # every bag empty: 2 tables of 1 row, pooling 0, planned and measured as if real
    "s27-dlrm-no-lookups-at-all": lambda w, d: (["ingest", "--source", "dlrm", "--input", _empty_trace(d)],
                                                ["t.pt", "field 'lengths'", "no lookups"]),
    # a byte-identical copy of a trace file under another name: its batches had counted twice
    "s27-dlrm-a-copy-of-a-file": lambda w, d: (["ingest", "--source", "dlrm", "--input", trace(d, "a.pt"),
                                                _copied(d, "a.pt", "b.pt")],
                                               ["b.pt", "field 'input'", "the same bytes as", "a.pt"]),
    # a list of numbers saved, not tensors: it had said "field 'indices': is not an integer tensor (int)"
    "s27-dlrm-a-list-of-numbers": lambda w, d: (["ingest", "--source", "dlrm", "--input", _saved(d, [1, 2, 3])],
                                                ["t.pt", "holds a list of 3 int values, not the tensors"]),
    # an abbreviated option: `--rows 1000` had been taken as --rows-file ("1000: file not found")
    "s27-ingest-rows-is-no-abbreviation": lambda w, d: (
        ["ingest", "--source", "dlrm", "--input", trace(d), "--rows", "1000"],
        ["unrecognized arguments: --rows 1000", "embshard ingest --help"]),
}


def torch_arange(a, b):
    import torch

    return torch.arange(a, b, dtype=torch.int64)


def torch_ones(*shape):
    import torch

    return torch.ones(*shape, dtype=torch.int64)


def torch_tensor(values):
    import torch

    return torch.tensor(values, dtype=torch.int64)


CASES_26 = {**CASES_26_EXPORT, **CASES_26_DATA, **CASES_S11, **CASES_S27}


@pytest.mark.parametrize("case", sorted(CASES_26))
def test_bad_input_26(case, world, tmp_path, capsys, monkeypatch):
    """The issue 26 rows that fit the first battery's form: one CLI call on one bad input, --out appended."""
    monkeypatch.setitem(CASES, case, CASES_26[case])
    test_bad_input(case, world, tmp_path, capsys)


def test_export_accepts_a_dotted_module_path(world, tmp_path):
    out = tmp_path / "exp"
    assert cli(_export(world, world["placements"])[:-1] + ["--module-path", "sparse_arch.ebc", "--out",
                                                             str(out)]) == 0
    if (out / world["task_id"] / "torchrec_plan.json").exists():
        doc = json.loads((out / world["task_id"] / "torchrec_plan.json").read_text())
        assert list(doc["modules"]) == ["sparse_arch.ebc"]


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_rerun_export_leaves_only_its_own_files(world, tmp_path):
    """A re-export into the same folder: no TorchRec plan of the earlier export contradicts the new plan.json,
    no folder of a task no longer exported stays; files that are not the export's are kept. A stage folder a
    killed export into this folder left (named after it, its process gone) is removed at the start; another
    output's stage folder is not."""
    from embshard import storage

    out = tmp_path / "exp"
    tid = world["task_id"]
    assert cli(["export", "--placements", world["placements"], "--tables", world["tables"], "--out", str(out)]) == 0
    (out / "old-task").mkdir()
    (out / "old-task" / "plan.json").write_text('{"schema": "embshard.plan/v3"}')
    (out / "old-task" / "torchrec_plan.json").write_text("{}")
    # A user's folder of plan-named files that embshard did not write is theirs: it had been deleted whole.
    for mine, files in (("my-pt", {"torchrec_plan.pt": b"PK\x03\x04 my plan"}),
                        ("my-json", {"plan.json": b'{"note": "mine"}', "torchrec_plan.pt": b"x"})):
        (out / mine).mkdir()
        for name, data in files.items():
            (out / mine / name).write_bytes(data)
    (out / "notes.txt").write_text("mine")
    (out / "planned.parquet").write_bytes(b"not the export's")
    key = storage._target_key(str(out))
    killed = out / f"{storage.STAGE_PREFIX}{key}-{_dead_pid()}-abcd1234"
    (killed / tid).mkdir(parents=True)
    (killed / tid / "plan.json").write_text("{\"partial")
    other = out / f"{storage.STAGE_PREFIX}{storage._target_key(str(tmp_path / 'other'))}-{_dead_pid()}-x"
    other.mkdir()
    assert cli(_export(world, world["placements"]) + ["--out", str(out)]) == 0  # --no-torchrec now
    assert sorted(os.listdir(out)) == sorted(["placements.parquet", tid, "notes.txt", "planned.parquet", other.name,
                                              "my-pt", "my-json"])
    assert (out / "my-pt" / "torchrec_plan.pt").read_bytes() == b"PK\x03\x04 my plan"
    assert sorted(os.listdir(out / "my-json")) == ["plan.json", "torchrec_plan.pt"]
    assert os.listdir(out / tid) == ["plan.json"], "a TorchRec plan of the earlier export was kept"
    assert (out / "notes.txt").read_text() == "mine"


# Output size and progress of `place`.
def test_place_on_many_devices_prints_a_summary(world, tmp_path, capsys):
    """Beyond a screenful of devices: the first, last and busiest devices, and a line saying how many were left
    out and where the full table is (not one line per device: 65,536 devices printed 65,540 lines)."""
    out = tmp_path / "out"
    assert cli(_place(world, "--devices", "600", "--memory-gb", "64", "--out", str(out))) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    assert len(printed) <= 45, len(printed)
    assert any("devices not shown" in line and "plan.json" in line for line in printed), printed[-3:]
    assert any(line.split()[:1] == ["599"] for line in printed)  # the last device is shown
    plan = json.loads((out / "plan.json").read_text())
    assert len(plan["devices"]) == 600  # the full table


def test_place_at_the_device_limit_summarises(world):
    from embshard.placement_report import device_table
    from embshard.planners.baselines import make_baseline
    from embshard.tableset import TableSet

    ts = TableSet.read(world["tables"])
    p = make_baseline("size_greedy").plan(ts, 65_536, 64 * 2**30, "t")
    text = device_table(p, full_table="out/plan.json")
    assert len(text.splitlines()) < 45 and "65,516 of 65,536 devices not shown" in text and "out/plan.json" in text


def test_long_planning_prints_progress(world, tmp_path, capsys, monkeypatch):
    """A plan that takes long prints progress lines on stderr (periodic, with the planner's phase)."""
    from embshard.jobs import place
    from embshard.planners.baselines import make_baseline

    class SlowPlanner:
        cost_model = None
        on_phase = None

        def plan(self, *args, **kw):
            self.on_phase("search from size_greedy")
            time.sleep(0.5)
            return make_baseline("size_greedy").plan(*args, **kw)

    monkeypatch.setattr(place, "planner_for", lambda *a, **k: SlowPlanner())
    monkeypatch.setattr(place, "PROGRESS_AFTER_S", 0.1)
    monkeypatch.setattr(place, "PROGRESS_EVERY_S", 0.1)
    assert cli(_place(world, "--devices", "2", "--memory-gb", "64", "--out", str(tmp_path / "out"))) == 0
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("place: planning 12 tables on 2 devices")]
    assert len(lines) >= 2 and "search from size_greedy" in lines[-1], err[-1500:]


def test_learned_planner_reports_its_phases(world):
    from embshard.costmodel.ensemble import CostEnsemble
    from embshard.costmodel.model import CostModel, CostModelConfig
    from embshard.features import FeatureScaler
    from embshard.planners.learned import LearnedPlanner
    from embshard.policy.core import PolicyNet
    from embshard.tableset import TableSet

    ts = TableSet.read(world["tables"])
    model = CostEnsemble([CostModel.create(CostModelConfig(), FeatureScaler.fit(ts.features()))])
    planner = LearnedPlanner(PolicyNet(), model, search_evaluations=500)
    phases: list[str] = []
    planner.on_phase = phases.append
    planner.plan(ts, 2, 64 * 2**30, "t")
    assert phases[0].startswith("encoding") and "policy rollouts" in phases
    assert any(p.startswith("search from") for p in phases), phases


# Training and evaluation inputs, the pipeline's params, the UI's port.
CASES_26_TRAINING = {
    "train-policy-zero-iterations": lambda w, d: (
        ["train-policy", "--tables", w["tables"], "--tasks", w["tasks"], "--iterations", "0"], ["iterations", ">= 1"]),
    "train-policy-fewer-iterations-than-rounds": lambda w, d: (
        ["train-policy", "--tables", w["tables"], "--tasks", w["tasks"], "--iterations", "2", "--rounds", "3",
         "--costs", w["root"]], ["iterations", ">= 3"]),
    "train-policy-zero-rounds": lambda w, d: (
        ["train-policy", "--tables", w["tables"], "--tasks", w["tasks"], "--rounds", "0"], ["rounds"]),
    "train-policy-zero-rollouts": lambda w, d: (
        ["train-policy", "--tables", w["tables"], "--tasks", w["tasks"], "--rollouts", "0"], ["rollouts", ">= 2"]),
    "train-policy-shrinking-curriculum": lambda w, d: (
        ["train-policy", "--tables", w["tables"], "--tasks", w["tasks"], "--curriculum", "50-200,10-50"],
        ["policy_curriculum", "smaller"]),
    "train-policy-one-rollout": lambda w, d: (
        ["train-policy", "--tables", w["tables"], "--tasks", w["tasks"], "--rollouts", "1"], ["rollouts", ">= 2"]),
    "evaluate-zero-max-tasks": lambda w, d: (_evaluate(w, w["tasks"], "--max-tasks", "0"), ["max_tasks", "at least 1"]),
    "evaluate-negative-max-tasks": lambda w, d: (_evaluate(w, w["tasks"], "--max-tasks", "-2"), ["max_tasks"]),
}


@pytest.mark.parametrize("case", sorted(CASES_26_TRAINING))
def test_bad_training_input(case, world, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(CASES, case, CASES_26_TRAINING[case])
    test_bad_input(case, world, tmp_path, capsys)


@pytest.mark.parametrize("port", ["70000", "0", "-1", "http"])
def test_ui_port_out_of_range_is_one_line(port, tmp_path, capsys):
    """`embshard ui --port 70000` was an OverflowError traceback and `--port 0` never came up: 1..65535 only,
    refused before anything starts."""
    out = tmp_path / "ui"
    with pytest.raises(SystemExit) as exc:
        cli(["ui", "--out", str(out), "--port", port])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1 and "--port" in err[0] and "Traceback" not in err[0], err
    assert not out.exists()


def test_pipeline_bad_param_value_is_one_line(tmp_path, capsys, monkeypatch):
    """`embshard pipeline --param devices=-3` was Airflow's ParamValidationError traceback: one line naming the
    param, before the Airflow database is set up or a run is created."""
    from embshard import pipeline

    out = tmp_path / "pl"
    for key in pipeline.OUT_FOLDERS:  # --out's own folders, not the test session's
        monkeypatch.delenv(key, raising=False)
    for key, value in pipeline.local_environment(str(out)).items():  # restored after the test
        monkeypatch.setenv(key, value)
    capsys.readouterr()
    rc = cli(["pipeline", "--out", str(out), "--param", "devices=-3"])
    said = capsys.readouterr()
    err = [line for line in said.err.strip().splitlines() if line.strip()]
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith("embshard pipeline: error:") and "field 'devices'" in err[0] and "-3" in err[0], err
    assert "minimum" in err[0] and "fix: " in err[0]
    assert not (out / "airflow" / "airflow.db").exists(), "the database was set up for a run that cannot start"
    assert "note:" not in said.out  # the variables name --out's own folders: nothing to say
    # A shell's leftover AIRFLOW_HOME takes Airflow's state elsewhere: said before anything else.
    monkeypatch.setenv("AIRFLOW_HOME", str(tmp_path / "elsewhere"))
    assert cli(["pipeline", "--out", str(out), "--param", "devices=-3"]) == 2
    said = capsys.readouterr().out
    assert f"note: AIRFLOW_HOME is set ({tmp_path / 'elsewhere'}): Airflow state goes there" in said
    assert "MLFLOW_TRACKING_URI" not in said


def test_train_cost_publishes_its_model_folder_only_when_registered(measured_world, mlflow_uri, tmp_path,
                                                                    monkeypatch):
    """A train-cost that dies before its version is registered (killed with -9 left a model folder with no
    version) leaves no model folder; the stage folder a killed run left is removed by the next run into the
    same folder, which publishes its files with its version."""
    from embshard import registry, storage
    from embshard.jobs import train_cost

    out = tmp_path / "cm"
    kw = {"seed": 0, "max_epochs": 2, "patience": 2, "members": 1}

    def killed(*args, **kwargs):
        raise KeyboardInterrupt  # what a kill during registration looks like to the files: the run stops there

    monkeypatch.setattr(registry, "log_and_register", killed)
    with pytest.raises(KeyboardInterrupt):
        train_cost.run(measured_world["costs"], measured_world["tables"], str(out), **kw)
    assert not (out / "model").exists() and not (out / "report.json").exists()
    assert not [n for n in os.listdir(out) if n.startswith(storage.STAGE_PREFIX)]
    monkeypatch.undo()

    left = out / f"{storage.STAGE_PREFIX}{storage._target_key(str(out))}-{_dead_pid()}-x"
    (left / "model" / "member-0").mkdir(parents=True)  # what a SIGKILL in the middle leaves
    res = train_cost.run(measured_world["costs"], measured_world["tables"], str(out), **kw)
    assert res["model_version"] is not None
    assert (out / "model" / "ensemble.json").exists() and (out / "report.json").exists()
    assert not left.exists()


def test_id_rule_matches_the_whole_string():
    from embshard import checks

    assert checks.bad_id("t0000\n") and checks.bad_id("evil\n") and checks.bad_id("a\nb")
    assert not checks.bad_id("t0000")


def test_no_ingest_source_makes_dims_fbgemm_cannot_measure():
    import numpy as np

    from embshard.ingest import dlrm, synthetic

    assert (synthetic.DIMS % 4 == 0).all()
    assert (synthetic.generate_tables(200, seed=3, bins_batch_size=256)["dim"] % 4 == 0).all()
    assert (dlrm.choose_dims("mixed", 500, seed=1) % 4 == 0).all()
    assert np.array_equal(dlrm.choose_dims(8, 2, seed=0), [8, 8])


def test_fp16_tables_are_measured_with_fp16_weights(world, monkeypatch):
    """A table's bytes_per_element is the precision of the op that measures it (FBGEMM's and torch's), a mixed
    shard runs one FBGEMM op per precision, and the precision is recorded with the measurement."""
    import torch

    from embshard.bench import backends, runner
    from embshard.tableset import TableSet

    df = world["tables_df"].copy()
    df["bytes_per_element"] = [2 if i % 2 == 0 else 4 for i in range(len(df))]
    df["size_bytes"] = df["rows"] * df["dim"] * df["bytes_per_element"]
    ts = TableSet.from_frame(schemas.validate(df, "tables"))
    built = []
    real_build = backends.build
    monkeypatch.setattr(backends, "build", lambda *a, **k: built.append(real_build(*a, **k)) or built[-1])
    for backend in ("fbgemm", "torch"):
        cfg = runner.make_config(runner.MeasureSettings(backend=backend, batch_size=32, warmup=0, iterations=10,
                                                        min_time_ms=0.0, comm_bandwidth_gbps=10, comm_latency_us=20))
        for members, want, dtypes in (([0, 2], "fp16", {torch.float16}), ([1, 3], "fp32", {torch.float32}),
                                      ([0, 1], "fp16+fp32", {torch.float16, torch.float32})):
            m = runner.measure_shard(ts, members, cfg, num_devices=2)
            op = built[-1]
            weights = [o.weights_host for o in op.ops] if backend == "fbgemm" else op.weights
            assert {w.dtype for w in weights} == dtypes and m["weights_precision"] == want, (backend, members)
            if backend == "fbgemm":
                assert len(op.ops) == len(dtypes)  # one TBE op per precision
            assert m["fwd_compute_ms"] > 0 and m["bwd_compute_ms"] > 0


def test_rerun_removes_the_decompressed_trace_its_killed_run_left(tmp_path):
    """A dlrm ingest killed while decompressing leaves `.embshard-trace-<tag>-<pid>-*.pt` beside its output; the
    next ingest into the same output removes it (the other output's temp and a live process's temp stay)."""
    import torch

    from embshard.ingest import dlrm

    src = tmp_path / "trace.pt"
    torch.save((torch.arange(8, dtype=torch.int64) % 3, torch.arange(9, dtype=torch.int64),
                torch.ones(2, 4, dtype=torch.int64)), str(src))
    gz = tmp_path / "trace.pt.gz"
    gz.write_bytes(gzip.compress(src.read_bytes()))
    out = tmp_path / "run"
    out.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    tag = dlrm.temp_tag(str(out / "tables.parquet"))
    left = out / f".embshard-trace-{tag}-{dead.pid}-abc123.pt"
    left.write_bytes(b"\0" * 4096)
    live = out / f".embshard-trace-{tag}-{os.getppid()}-def456.pt"
    live.write_bytes(b"\0")
    other = out / f".embshard-trace-{dlrm.temp_tag(str(tmp_path / 'x' / 'tables.parquet'))}-{dead.pid}-x.pt"
    other.write_bytes(b"\0")
    assert cli(["ingest", "--source", "dlrm", "--input", str(gz), "--dim", "8", "--out", str(out),
                "--no-progress"]) == 0
    assert not left.exists() and live.exists() and other.exists()
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == ["tables.parquet"]
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == sorted([live.name, other.name])


def test_a_folder_the_pipeline_owns_is_measured_again_when_its_shards_changed(world, tmp_path):
    """An outer-loop round re-run after the round before it was retrained lists other plans' shards: its own costs
    folder is measured again (replace_changed), where a user's folder is refused."""
    from embshard.bench.runner import MeasureSettings
    from embshard.errors import EmbshardError
    from embshard.jobs.bench import run as bench_run

    out = str(tmp_path / "round")
    settings = MeasureSettings(batch_size=64, warmup=1, iterations=10, comm_bandwidth_gbps=10.0,
                               comm_latency_us=20.0)
    first = bench_run(world["tables"], "random:3", out, settings, max_tables=3, progress=False)
    assert len(schemas.read(os.path.join(out, "costs"), "costs")) == 3 and first
    with pytest.raises(EmbshardError, match="other settings"):  # other shards, a user's folder: refused
        bench_run(world["tables"], "random:5", out, settings, max_tables=3, progress=False)
    bench_run(world["tables"], "random:5", out, settings, max_tables=3, progress=False, replace_changed=True)
    costs = schemas.read(os.path.join(out, "costs"), "costs")
    assert len(costs) == 5 and costs["sample_id"].is_unique  # the new shards only, nothing of the first try
    bench_run(world["tables"], "random:5", out, settings, max_tables=3, progress=False, replace_changed=True)
    assert schemas.read(os.path.join(out, "costs"), "costs")["measured_at"].equals(costs["measured_at"])  # resumed


def test_a_library_message_is_cut_at_a_word_end():
    """Library exceptions quoted in one-line errors were cut mid-word ('...If yo)')."""
    from embshard.errors import first_line

    long = RuntimeError("PytorchStreamReader failed reading zip archive: failed finding central directory. "
                        "If you are loading a file saved with torch.save, check that it was not truncated\nline 2")
    cut = first_line(long, 100)
    assert cut.endswith("…") and len(cut) <= 101 and not cut[:-1].endswith("yo") and "line 2" not in cut
    assert cut[:-1] == long.args[0][:len(cut) - 1]
    assert first_line(ValueError("short")) == "short" and first_line(KeyError()) == "KeyError"


def test_memory_gb_takes_its_unit_and_refuses_gb():
    """`--memory-gb 16GiB` was 'invalid float value'; GB (10^9 bytes) is refused, not read as GiB."""
    import argparse

    from embshard.checks import gib_text

    assert gib_text("16GiB") == gib_text("16 gib") == gib_text("16") == 16.0
    assert gib_text("0.5") == 0.5 and gib_text("nan") != gib_text("nan")  # NaN reaches the range check's message
    for bad, says in (("16GB", "not GB"), ("16 G", "not G"), ("sixteen", "not a number of GiB")):
        with pytest.raises(argparse.ArgumentTypeError, match=says):
            gib_text(bad)


def test_a_list_column_written_as_text_is_named_not_read_as_letters():
    """A hand-made tasks file with table_ids 'user,item' had been read as the ids u, s, e, r, ','."""
    import pandas as pd

    from embshard.errors import EmbshardError

    df = pd.DataFrame([{"task_id": "t", "split": "train", "num_devices": 2, "memory_bytes_per_device": 2**30,
                        "table_ids": "user,item"}])
    with pytest.raises(EmbshardError, match=r"x.parquet: field 'table_ids': text 'user,item' in row 0 \(task_id 't'\), "
                                            r"not a list \(fix: write table_ids as a list column"):
        schemas.validate(df, "tasks", "x.parquet")


def test_a_bad_value_names_its_rows_id_not_only_its_number():
    """A trace's table over the pooling limit was 'invalid value 5000 in row 1': its table id is what a user can
    find (a trace numbers its tables by nothing they see)."""
    from embshard.errors import EmbshardError
    from embshard.ingest.synthetic import generate_tables

    df = generate_tables(3, seed=1, bins_batch_size=256)
    df.loc[1, "pooling_factor"] = 5000.0
    with pytest.raises(EmbshardError) as exc:
        schemas.validate(df, "tables", "t.parquet")
    assert exc.value.field == "pooling_factor" and f"in row 1 (table_id '{df.loc[1, 'table_id']}')" in str(exc.value)
    df = generate_tables(3, seed=1, bins_batch_size=256)
    df.loc[2, "size_bytes"] += 4
    with pytest.raises(EmbshardError, match=rf"in row 2 \(table_id '{df.loc[2, 'table_id']}'\)"):
        schemas.validate(df, "tables", "t.parquet")


def test_champion_without_a_store_is_one_line_and_creates_none(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/nowhere/mlflow.db")
    monkeypatch.chdir(tmp_path)
    assert cli(["champion"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "there is no MLflow store at" in err[0] and "MLFLOW_TRACKING_URI" in err[0]
    assert not (tmp_path / "nowhere").exists() and not (tmp_path / "mlflow.db").exists()
