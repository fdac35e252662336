"""Task sampling: a seeded train/test split of unseen tables, tasks drawn from each, infeasible tasks refused."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from embshard import pools, schemas
from embshard.checks import GiB
from embshard.cli import main as cli
from embshard.errors import EmbshardError
from embshard.jobs import tasks


def _tables(sizes_gib):
    n = len(sizes_gib)
    rows = (np.asarray(sizes_gib, dtype=float) * 2**30 / (64 * 4)).astype(np.int64)
    df = pd.DataFrame({"table_id": [f"t{i:03d}" for i in range(n)], "rows": rows, "dim": 64,
                       "pooling_factor": 1.0, "bytes_per_element": 4})
    df["size_bytes"] = df["rows"] * 64 * 4
    for k, c in enumerate(schemas.BIN_COLUMNS):
        df[c] = 1.0 if k == 0 else 0.0
    df["source"] = "test"
    return df


@pytest.fixture()
def tables_path(tmp_path):
    path = tmp_path / "tables.parquet"
    schemas.write(_tables(np.linspace(0.01, 1.0, 41)), path, "tables")
    return path


def split(ids, seed):
    pool = pools.assign(ids, seed)
    return ({t for t, p in zip(ids, pool) if p == "train"}, {t for t, p in zip(ids, pool) if p == "test"})


def test_split_is_seeded_disjoint_and_covers_all():
    ids = [f"t{i}" for i in range(41)]
    train, test = split(ids, seed=0)
    assert len(train) == 21 and len(test) == 20 and train | test == set(ids)
    assert not train & test
    assert split(list(reversed(ids)), seed=0) == (train, test)  # row order does not matter
    assert split(ids, seed=1) != (train, test)


def test_tasks_follow_the_pool_column_of_the_tables(tmp_path):
    """The pools stored with the tables decide, not a second shuffle: flip them and the tasks follow."""
    df = _tables(np.ones(41))
    df["pool"] = np.where(pools.assign(df["table_id"], 0) == "train", "test", "train")
    path = tmp_path / "tables.parquet"
    schemas.write(df, path, "tables")
    out = schemas.read(tasks.run(str(path), str(tmp_path), 3, "3-5", 2, 4, seed=0), "tasks")
    pool_of = dict(zip(df["table_id"], df["pool"]))
    for r in out.itertuples():
        assert {pool_of[t] for t in r.table_ids} == {r.split}


def test_tasks_cli(tmp_path, tables_path):
    out = tmp_path / "out"
    assert cli(["tasks", "--tables", str(tables_path), "--out", str(out), "--num-tasks", "6",
                "--tables-per-task", "3-8", "--devices", "2,4", "--memory-gb", "4", "--seed", "7"]) == 0
    df = schemas.read(out / "tasks.parquet", "tasks")
    train, test = split(list(_tables(np.ones(41))["table_id"]), seed=7)
    assert df["task_id"].tolist() == [f"train-{k:04d}" for k in range(6)] + [f"test-{k:04d}" for k in range(6)]
    for r in df.itertuples():
        pool = set(train) if r.split == "train" else set(test)
        assert set(r.table_ids) <= pool and len(set(r.table_ids)) == len(r.table_ids)
        assert 3 <= len(r.table_ids) <= 8 and r.num_devices in (2, 4)
        assert r.memory_bytes_per_device == 4 * 2**30
    assert df["table_ids"].map(len).nunique() > 1 and df["num_devices"].nunique() == 2
    again = tasks.run(str(tables_path), str(tmp_path / "again"), 6, "3-8", "2,4", 4, seed=7)
    assert schemas.read(again, "tasks").equals(df)
    # a list of memories takes the unit as one memory does (place's --memory-gb 16GiB; a list had refused it)
    units = tasks.run(str(tables_path), str(tmp_path / "units"), 6, "3-8", "2,4", "4GiB", seed=7)
    assert schemas.read(units, "tasks").equals(df)
    mixed = tasks.run(str(tables_path), str(tmp_path / "mixed"), 6, "3-8", "2,4", "4GiB, 8", seed=7)
    assert set(schemas.read(mixed, "tasks")["memory_bytes_per_device"]) == {4 * 2**30, 8 * 2**30}


def test_tasks_on_hosts_carry_devices_per_host_and_draw_the_same_tasks(tmp_path, tables_path):
    """--devices-per-host: the same seeded tasks, each with its hosts (load_tasks gives the topology)."""
    from embshard.types import load_tasks

    plain = schemas.read(tasks.run(str(tables_path), str(tmp_path / "a"), 3, "3-8", "4,8", 4, seed=1), "tasks")
    on_hosts = schemas.read(tasks.run(str(tables_path), str(tmp_path / "b"), 3, "3-8", "4,8", 4, seed=1,
                                      devices_per_host=4), "tasks")
    assert on_hosts.drop(columns="devices_per_host").equals(plain) and (on_hosts["devices_per_host"] == 4).all()
    for t in load_tasks(str(tables_path), tmp_path / "b" / "tasks.parquet"):
        assert t.devices.hosts == tuple(k // 4 for k in range(t.num_devices))


def test_infeasible_tasks_are_errors_not_dropped(tmp_path, capsys):
    path = tmp_path / "tables.parquet"
    schemas.write(_tables([0.5] * 10 + [3.0] * 2), path, "tables")
    out = tmp_path / "out"
    # every table of 0.5 GiB fits a 1 GiB device, but 6 of them do not fit 2 devices x 1 GiB
    assert cli(["tasks", "--tables", str(path), "--out", str(out), "--num-tasks", "1", "--tables-per-task",
                "6", "--devices", "2", "--memory-gb", "1"]) == 2
    err = capsys.readouterr().err
    assert "cannot fit" in err and "field 'memory_gb'" in err and "memory_gb (--memory-gb) >=" in err, err
    assert not (out / "tasks.parquet").exists()
    # A 3 GiB table over a 2 GiB device, with plenty of devices, is cut by the planners: the tasks are made (they
    # had been refused, so a model that needs splitting could not train the planner on its own tables).
    tables = schemas.read(path, "tables")
    df = tasks.sample_tasks(tables, 4, 6, 64, 2.0, seed=0)
    assert any(tables.set_index("table_id").loc[ids, "size_bytes"].max() > 2 * GiB for ids in df["table_ids"])
    # the memory the error suggests makes every sampled task fit
    with pytest.raises(EmbshardError, match=r"\(--memory-gb\) >= ") as info:
        tasks.sample_tasks(tables, 4, 6, 2, 1.0, seed=0)
    enough = float(str(info.value).split("(--memory-gb) >= ")[1].split()[0])
    df = tasks.sample_tasks(tables, 4, 6, 2, enough, seed=0)
    assert len(df) == 8


@pytest.mark.parametrize("argv,words", [
    (["--tables-per-task", "30"], ["tables_per_task", "21 tables of the train pool"]),
    (["--tables-per-task", "9-3"], ["tables_per_task"]),
    (["--devices", "four"], ["devices"]),
    (["--memory-gb", "0"], ["memory_gb"]),
    (["--num-tasks", "0"], ["num_tasks"]),
    (["--devices", "4,6", "--devices-per-host", "4"], ["devices_per_host", "6 devices do not split into hosts of 4"]),
    (["--devices", "4,,8"], ["devices", "an empty item"]),  # a value left out, not the list 4,8
    (["--memory-gb", ",16"], ["memory_gb", "an empty item"]),
])
def test_bad_requests(tmp_path, tables_path, capsys, argv, words):
    base = ["tasks", "--tables", str(tables_path), "--out", str(tmp_path / "out"), "--num-tasks", "2"]
    assert cli(base + argv) == 2
    err = capsys.readouterr().err
    assert all(w in err for w in words), err
    assert not (tmp_path / "out" / "tasks.parquet").exists()


def test_a_trailing_comma_is_no_item():
    assert tasks.parse_list("4,8,", "devices") == [4, 8]


def test_missing_tables_file(tmp_path, capsys):
    assert cli(["tasks", "--tables", str(tmp_path / "nope.parquet"), "--out", str(tmp_path), "--num-tasks",
                "1"]) == 2
    assert "nope.parquet" in capsys.readouterr().err
