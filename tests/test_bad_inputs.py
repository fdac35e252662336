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
    from embshard.jobs import tasks
    from embshard.ingest.synthetic import generate_tables
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
    "place-memory-1e30": lambda w, d: (_place(w, "--devices", "2", "--memory-gb", "1e30"), ["memory_gb"]),
    "place-memory-inf": lambda w, d: (_place(w, "--devices", "2", "--memory-gb", "inf"), ["memory_gb"]),
    "place-memory-too-small": lambda w, d: (_place(w, "--devices", "2", "--memory-gb", "0.000001"),
                                            ["tables.parquet", "memory_bytes_per_device"]),
    "place-no-devices": lambda w, d: (_place(w, "--memory-gb", "8"), ["devices"]),
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
    "evaluate-task-id-path": lambda w, d: (_evaluate(w, tasks_with(w, d, task_id="../x")), ["tasks.parquet", "task_id"]),
    "evaluate-missing-tasks": lambda w, d: (_evaluate(w, os.path.join(d, "no.parquet")), ["no.parquet", "not found"]),
    "evaluate-no-such-split": lambda w, d: (_evaluate(w, w["tasks"], "--split", "validation"),
                                            ["tasks.parquet", "split"]),
    "evaluate-unknown-planner": lambda w, d: (_evaluate(w, w["tasks"], planners="best"), ["planner"]),
    "evaluate-no-planners": lambda w, d: (_evaluate(w, w["tasks"], planners=","), ["planners"]),
    "evaluate-zero-rounds": lambda w, d: (_evaluate(w, w["tasks"], "--rounds", "0"), ["rounds"]),
    "evaluate-negative-rounds": lambda w, d: (_evaluate(w, w["tasks"], "--rounds", "-3"), ["rounds"]),
    "evaluate-baselines-is-not-a-planner": lambda w, d: (_evaluate(w, w["tasks"], planners="baselines"),
                                                         ["planners", "baselines"]),
    "evaluate-no-test-tasks": lambda w, d: (_evaluate(w, tasks_with(w, d, split="train")),
                                            ["tasks.parquet", "split"]),
    # bench
    "bench-max-shard-nan": lambda w, d: (_bench(w, d, "--max-shard-gb", "nan"), ["max_shard_gb"]),
    "bench-max-shard-zero": lambda w, d: (_bench(w, d, "--max-shard-gb", "0"), ["max_shard_gb"]),
    "bench-max-shard-negative": lambda w, d: (_bench(w, d, "--max-shard-gb", "-2"), ["max_shard_gb"]),
    "bench-batch-zero": lambda w, d: (_bench(w, d, "--batch-size", "0"), ["batch_size"]),
    "bench-iterations-few": lambda w, d: (_bench(w, d, "--iterations", "5"), ["iterations"]),
    "bench-warmup-negative": lambda w, d: (_bench(w, d, "--warmup", "-1"), ["warmup"]),
    "bench-shards-bogus": lambda w, d: (_bench(w, d, shards="bogus:2"), ["bogus"]),
    "bench-shards-random-zero": lambda w, d: (_bench(w, d, shards="random:0"), ["shards"]),
    "bench-shards-random-text": lambda w, d: (_bench(w, d, shards="random:x"), ["shards"]),
    "bench-shards-unknown-table": lambda w, d: (_bench(w, d, shards=raw_parquet(pd.DataFrame(
        {"sample_id": ["s0"], "table_ids": [["t_unknown"]], "num_devices": [2], "origin": ["given"]}),
        os.path.join(d, "shards.parquet"))), ["table_ids"]),
    "bench-chunk-out-of-range": lambda w, d: (_bench(w, d, "--chunk", "5", "--num-chunks", "2"), ["chunk"]),
    "bench-zero-chunks": lambda w, d: (_bench(w, d, "--num-chunks", "0"), ["num_chunks"]),
    "bench-missing-tables": lambda w, d: (_bench(w, d, tables=os.path.join(d, "no.parquet")), ["no.parquet"]),
    "bench-comm-bandwidth-nan": lambda w, d: (_bench(w, d, "--comm-bandwidth-gbps", "nan", "--comm-latency-us", "2"),
                                              ["comm_bandwidth_gbps"]),
    # export
    "export-task-misses-tables": lambda w, d: (
        _export(w, placements_with(w, d, lambda df: df.iloc[1:]), tasks=w["tasks"]), ["placements.parquet", "table_id"]),
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
        _export(w, placements_with(w, d, lambda df: df.assign(task_id="../../etc/x"))), ["placements.parquet", "task_id"]),
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


def _place(w, *extra, planner="size_greedy"):
    return ["place", "--tables", w["tables"], "--planner", planner, *extra]


def _evaluate(w, tasks, *extra, planners="size_greedy"):
    return ["evaluate", "--tables", w["tables"], "--tasks", tasks, "--planners", planners, *extra]


def _bench(w, d, *extra, shards="random:2", tables=None):
    return ["bench", "--tables", tables or w["tables"], "--shards", shards, "--batch-size", "64", "--iterations",
            "10", "--warmup", "1", "--comm-bandwidth-gbps", "10", "--comm-latency-us", "20", "--no-progress",
            *extra]


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
    argv, words = CASES[case](world, str(inputs))
    out = tmp_path / "out"
    argv = argv + ["--out", str(out)]
    before = snapshot(str(inputs), world["root"])
    capsys.readouterr()
    try:
        rc = cli(argv)
    except SystemExit as exc:  # argparse
        rc = exc.code
    err = capsys.readouterr().err
    lines = [line for line in err.strip().splitlines() if line.strip() and not LOG_LINE.match(line)]
    assert rc == 2, f"exit {rc}: {err[-1500:]}"
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


def test_killed_bench_resumes_to_the_same_result_and_other_settings_are_refused(world, tmp_path):
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
    res = subprocess.run(_bench_cmd(world["tables"], out, batch="128"), capture_output=True, text=True, timeout=300)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "batch_size" in res.stderr and "64 there, 128 now" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    assert sorted(f for f in os.listdir(partial) if f.endswith(".parquet")) == done

    # The same settings resume: all shards, the ones measured before the kill kept as they were.
    res = subprocess.run(_bench_cmd(world["tables"], out), capture_output=True, text=True, timeout=300)
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
        res = subprocess.run(_bench_cmd(world["tables"], out, **kw), capture_output=True, text=True, timeout=300)
        assert res.returncode == 2 and what in res.stderr, res.stderr[-2000:]
    res = subprocess.run(_bench_cmd(other_tables, out), capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and "field 'tables'" in res.stderr, res.stderr[-2000:]
    assert sorted(os.listdir(os.path.join(out, "costs"))) == finished
    again = schemas.read(os.path.join(out, "costs"), "costs")
    assert again["measured_at"].equals(costs["measured_at"])


def test_reingest_removes_the_stale_tasks(world, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "tasks.parquet").write_bytes(open(world["tasks"], "rb").read())
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


CASES_26 = {
    # measurement: only fp32 (4) and fp16 (2) weights exist; other widths were measured as fp32
    "i26-bench-table-8-byte-weights": lambda w, d: (
        _bench(w, d, tables=_tables_with_width(w, d, 8)), ["tables.parquet", "bytes_per_element", "fp32"]),
    "i26-tasks-table-1-byte-weights": lambda w, d: (_tasks(_tables_with_width(w, d, 1)),
                                                    ["tables.parquet", "bytes_per_element", "fp16"]),
    "i26-spec-data-type-fp64": ingest_spec(spec_row("a,10,4,1,fp64", ",data_type", ",fp32")),
    # dims FBGEMM cannot measure: refused at ingest, not an AssertionError in bench
    "i26-spec-dim-3": lambda w, d: (ingest_spec(spec_row("a,10,3,1"))(w, d)[0],
                                    ["spec.csv", "embedding_dim", "'a'", "row 1", "multiple of 4"]),
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
        _tasks(_unreadable(d, "tables.parquet", open(w["tables"], "rb").read())), ["tables.parquet", "permission"]),
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


@pytest.mark.parametrize("case", sorted(CASES_26))
def test_bad_input_issue26(case, world, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(CASES, case, CASES_26[case])
    test_bad_input(case, world, tmp_path, capsys)


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
        cfg = runner.make_config(backend=backend, batch_size=32, warmup=0, iterations=10, min_time_ms=0.0,
                                 comm_bandwidth_gbps=10, comm_latency_us=20)
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
