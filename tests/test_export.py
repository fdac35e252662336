"""Export: plan.json (embshard.plan/v3; v1/v2 read), placements.parquet round trips, and plans TorchRec accepts."""
from __future__ import annotations

import copy
import json
import sys
from dataclasses import replace

import numpy as np
import pandas as pd
import pytest

from embshard import schemas
from embshard.errors import EmbshardError
from embshard.export import placement_from_frame, placement_from_plan, read_plan_json, validate_plan, write_plan_json
from embshard.export.placements import device_costs_from_frame
from embshard.export.plan_json import _mini_validate, json_schema
from embshard.ingest.synthetic import generate_tables
from embshard.placement import Placement, Shard
from embshard.tableset import TableSet

D = 4


@pytest.fixture(scope="module")
def tables_df():
    df = generate_tables(10, seed=11, bins_batch_size=1024)
    df["dim"] = [64, 32, 128, 16, 64, 8, 32, 64, 16, 128]
    df["rows"] = np.minimum(df["rows"], 50_000)
    df.loc[3, "bytes_per_element"] = 2  # one fp16 table
    df["size_bytes"] = df["rows"] * df["dim"] * df["bytes_per_element"]
    return schemas.validate(df, "tables")


@pytest.fixture(scope="module")
def tables(tables_df) -> TableSet:
    return TableSet.from_frame(tables_df)


@pytest.fixture()
def placement(tables) -> Placement:
    # Mixed plan: whole tables, table 0 split evenly over two devices, table 2 split unevenly over three.
    shards = [Shard(0, 0, 0, 32), Shard(0, 1, 32, 32), Shard(1, 2), Shard(2, 3, 0, 64), Shard(2, 0, 64, 32),
              Shard(2, 2, 96, 32), Shard(3, 1), Shard(4, 3), Shard(5, 0), Shard(6, 1), Shard(7, 2), Shard(8, 3),
              Shard(9, 0)]
    mem = int(tables.size_bytes.sum())
    return Placement(tables, D, mem, shards, planner="size_greedy", task_id="task-a",
                     meta={"note": "test", "score": np.float32(1.5)})


COSTS = np.array([1.0, 2.5, 0.5, 3.0])


def test_plan_json_round_trip_and_fields(tmp_path, placement, tables):
    path = tmp_path / "plan.json"
    written = write_plan_json(placement, path, device_costs=COSTS, balanced_estimate=2.0)
    plan = read_plan_json(path)
    assert plan == written
    assert plan["schema"] == "embshard.plan/v3" and plan["cost"]["balanced_estimate_ms"] == 2.0
    assert plan["task_id"] == "task-a" and plan["num_devices"] == D and plan["planner"] == "size_greedy"
    assert plan["cost"]["overall_ms"] == 3.0 and plan["cost"]["gap"] == pytest.approx(0.5)
    assert [d["memory_bytes"] for d in plan["devices"]] == placement.memory_per_device().tolist()
    assert plan["devices"][0]["tables"] == [tables.table_ids[i] for i in (0, 2, 5, 9)]
    t2 = plan["tables"][2]
    assert [(s["device"], s["col_offset"], s["col_size"]) for s in t2["shards"]] == [(3, 0, 64), (0, 64, 32),
                                                                                     (2, 96, 32)]
    assert plan["meta"] == {"note": "test", "score": 1.5}
    back = placement_from_plan(plan, tables)
    assert back.memory_per_device().tolist() == placement.memory_per_device().tolist()
    assert sorted((s.table, s.device, s.col_offset, s.col_size) for s in back.shards) == \
        sorted((s.table, s.device, s.col_offset, s.col_size) for s in placement.shards)


def test_plan_json_without_costs(tmp_path, placement):
    plan = write_plan_json(placement, tmp_path / "p.json")
    assert plan["cost"] == {"unit": "ms", "device_costs_ms": None, "overall_ms": None,
                            "balanced_estimate_ms": None, "gap": None}


def test_a_v1_plan_json_with_its_lower_bound_ms_is_still_read(tmp_path, placement):
    """v1 called the balanced estimate `lower_bound_ms`: old files stay readable; each version names it its way."""
    import json

    from embshard.errors import EmbshardError

    plan = write_plan_json(placement, tmp_path / "new.json", device_costs=COSTS, balanced_estimate=2.0)
    old = _downgrade(plan, "embshard.plan/v1")
    old["cost"]["lower_bound_ms"] = old["cost"].pop("balanced_estimate_ms")
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert read_plan_json(tmp_path / "old.json")["cost"]["lower_bound_ms"] == 2.0
    mixed = copy.deepcopy(old)
    mixed["schema"] = "embshard.plan/v2"
    (tmp_path / "mixed.json").write_text(json.dumps(mixed))
    with pytest.raises(EmbshardError, match="balanced estimate") as err:
        read_plan_json(tmp_path / "mixed.json")
    assert err.value.field == "cost.lower_bound_ms"


def _downgrade(plan: dict, version: str) -> dict:
    """The plan as a v1/v2 file: no kind, row range, sharding type or hosts."""
    old = copy.deepcopy(plan)
    old["schema"] = version
    old.pop("hosts", None)
    for t in old["tables"]:
        t.pop("sharding_type")
        for s in t["shards"]:
            for k in ("kind", "row_offset", "row_size"):
                s.pop(k)
    return old


def test_a_v2_plan_json_is_still_read(tmp_path, placement, tables):
    plan = write_plan_json(placement, tmp_path / "new.json", device_costs=COSTS, balanced_estimate=2.0)
    assert [t["sharding_type"] for t in plan["tables"]][:3] == ["column_wise", "table_wise", "column_wise"]
    assert plan["tables"][1]["shards"][0]["kind"] == "whole"
    (tmp_path / "v2.json").write_text(json.dumps(_downgrade(plan, "embshard.plan/v2")))
    back = placement_from_plan(read_plan_json(tmp_path / "v2.json"), tables)
    assert sorted(map(repr, back.shards)) == sorted(map(repr, placement.shards))
    v3_in_v2 = _downgrade(plan, "embshard.plan/v2")
    v3_in_v2["hosts"] = [0, 0, 1, 1]
    with pytest.raises(EmbshardError, match="has no hosts"):
        validate_plan(v3_in_v2)


@pytest.fixture()
def split_placement(tables) -> Placement:
    """Row-wise over all 4 devices (table 0), table-row-wise on host 1 (table 1), a replica (table 3), whole rest."""
    from embshard.types import DeviceTopology, row_blocks

    shards = [Shard(0, d, row_offset=o, row_size=n) for d, (o, n) in enumerate(row_blocks(int(tables.rows[0]), 4))]
    shards += [Shard(1, 2 + d, row_offset=o, row_size=n) for d, (o, n) in enumerate(row_blocks(int(tables.rows[1]), 2))]
    shards += [Shard(3, d, kind="replicated") for d in range(D)]
    shards += [Shard(i, i % D) for i in (2, 4, 5, 6, 7, 8, 9)]
    mem = int(tables.size_bytes.sum())
    return Placement(tables, D, mem, shards, planner="split", task_id="task-s",
                     topology=DeviceTopology(D, mem, hosts=(0, 0, 1, 1)))


def test_plan_json_v3_rows_replicas_and_hosts_round_trip(tmp_path, split_placement, tables):
    plan = write_plan_json(split_placement, tmp_path / "p.json")
    assert plan["hosts"] == [0, 0, 1, 1]
    assert [t["sharding_type"] for t in plan["tables"][:4]] == ["row_wise", "table_row_wise", "table_wise",
                                                                "data_parallel"]
    s = plan["tables"][1]["shards"][1]
    assert (s["kind"], s["device"], s["col_size"], s["row_offset"] + s["row_size"]) == \
        ("row", 3, int(tables.dims[1]), int(tables.rows[1]))
    back = placement_from_plan(read_plan_json(tmp_path / "p.json"), tables)
    assert sorted(map(repr, back.shards)) == sorted(map(repr, split_placement.shards))
    assert back.devices.hosts == (0, 0, 1, 1)
    assert back.memory_per_device().tolist() == split_placement.memory_per_device().tolist()


@pytest.mark.parametrize("edit, match", [
    (lambda p: p["tables"][0]["shards"][1].update(row_offset=1), "rows"),
    (lambda p: p["tables"][0]["shards"][0].update(col_size=8, memory_bytes=0), "row range all columns"),
    (lambda p: p["tables"][0].update(sharding_type="table_wise"), "sharding_type"),
    (lambda p: p["tables"][3]["shards"].pop(), "replicas"),
    (lambda p: p["tables"][3]["shards"][0].update(kind="whole"), "mixes"),
    (lambda p: p["tables"][0]["shards"][0].pop("row_size"), "row_size"),
    (lambda p: p.update(hosts=[0, 1]), "hosts"),
])
def test_plan_json_v3_rejects_bad_splits(tmp_path, split_placement, edit, match):
    plan = write_plan_json(split_placement, tmp_path / "p.json")
    with pytest.raises(EmbshardError, match=match):
        validate_plan(_bad(plan, edit))


def _bad(plan, edit):
    bad = copy.deepcopy(plan)
    edit(bad)
    return bad


@pytest.mark.parametrize("edit, field", [
    (lambda p: p.pop("tables"), "tables"),
    (lambda p: p.update(schema="embshard.plan/v0"), "schema"),
    (lambda p: p.update(num_devices=0), "num_devices"),
    (lambda p: p["tables"][0]["shards"].pop(), "tables.0.shards"),
    (lambda p: p["tables"][1]["shards"][0].update(device=7), "tables.1.shards"),
    (lambda p: p["devices"][0].update(memory_bytes=1), "devices.0.memory_bytes"),
    (lambda p: p.update(memory_bytes_per_device=1000), "devices.0.memory_bytes"),
    (lambda p: p["devices"][1]["tables"].append("t_unknown"), "devices.1.tables"),
    (lambda p: p.update(extra=1), "<root>"),
])
def test_plan_json_validation_names_the_field(placement, tmp_path, edit, field):
    plan = write_plan_json(placement, tmp_path / "p.json", device_costs=COSTS)
    bad = _bad(plan, edit)
    with pytest.raises(EmbshardError) as err:
        validate_plan(bad)
    assert f"field '{field}'" in str(err.value)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(bad))
    with pytest.raises(EmbshardError, match="bad.json"):
        read_plan_json(path)


@pytest.mark.parametrize("edit, words", [
    # A hand edit that moves a table: devices[] is derived, and the message says how to bring it along.
    (lambda p: p["devices"][0].update(memory_bytes=p["devices"][0]["memory_bytes"] + 8),
     "devices[] is derived from tables[].shards"),
    (lambda p: p["devices"][1]["tables"].append("t_unknown"), "lists ['t_unknown'] without a shard there"),
    (lambda p: p["tables"].append(copy.deepcopy(p["tables"][1])), "duplicate table_id ["),
    # Overlapping column slices: the range in order, and what is wrong with it.
    (lambda p: p["tables"][0]["shards"][1].update(col_offset=24), "columns 24..32 are placed twice"),
])
def test_plan_json_errors_name_the_table_and_the_range_in_order(placement, tmp_path, edit, words):
    plan = write_plan_json(placement, tmp_path / "p.json", device_costs=COSTS)
    with pytest.raises(EmbshardError) as err:
        validate_plan(_bad(plan, edit))
    assert words in str(err.value) and "\n" not in str(err.value)


def test_a_small_memory_overrun_is_said_in_bytes(placement):
    over = copy.copy(placement)
    over.memory_bytes_per_device = int(placement.memory_per_device().max()) - 100
    with pytest.raises(EmbshardError, match=r"100 bytes over its [\d,]+ bytes|100 bytes over its [\d.]+ MiB"):
        over.check()


def test_builtin_schema_checker_agrees_with_jsonschema(placement, tmp_path):
    # Without jsonschema installed the built-in subset checker runs: it must catch the same structural errors.
    plan = write_plan_json(placement, tmp_path / "p.json", device_costs=COSTS)
    schema = json_schema()
    assert _mini_validate(plan, schema, "") is None
    cases = [lambda p: p.pop("meta"), lambda p: p.update(model_uri=3), lambda p: p["cost"].update(overall_ms=-1),
             lambda p: p["tables"][0].update(rows=True), lambda p: p["devices"][0].update(x=1),
             lambda p: p.update(tables=[])]
    jsonschema = pytest.importorskip("jsonschema")
    for edit in cases:
        bad = _bad(plan, edit)
        assert _mini_validate(bad, schema, "") is not None
        assert list(jsonschema.Draft202012Validator(schema).iter_errors(bad))


def test_validation_without_jsonschema(placement, tmp_path, monkeypatch):
    plan = write_plan_json(placement, tmp_path / "p.json", device_costs=COSTS)
    monkeypatch.setitem(sys.modules, "jsonschema", None)
    validate_plan(plan)
    with pytest.raises(EmbshardError, match="field 'tables.0.rows'"):
        validate_plan(_bad(plan, lambda p: p["tables"][0].update(rows="many")))
    with pytest.raises(EmbshardError, match="field 'cost.gap'"):
        validate_plan(_bad(plan, lambda p: p["cost"].pop("gap")))


def test_plan_from_json_says_what_a_file_is_when_it_is_not_a_torchrec_plan_json(tmp_path):
    """A missing file and the pickled torchrec_plan.pt had been told to re-export "(this file was edited or made
    for other tables/devices)"; each now gets its own fix."""
    pytest.importorskip("torchrec")
    import torch

    from embshard.export.torchrec_plan import plan_from_json

    with pytest.raises(EmbshardError) as err:
        plan_from_json(tmp_path / "nope" / "torchrec_plan.json")
    assert "file not found" in str(err.value) and "edited" not in err.value.fix
    assert "torchrec_plan.json that `embshard export` wrote" in err.value.fix
    torch.save({"a": 1}, tmp_path / "torchrec_plan.pt")
    with pytest.raises(EmbshardError) as err:
        plan_from_json(tmp_path / "torchrec_plan.pt")
    assert "a pickled TorchRec plan" in str(err.value) and "torch.load(path, weights_only=False)" in err.value.fix
    # the function the fix names exists there (it had named embshard.export.plan_to_json, an ImportError)
    import importlib
    import re

    module, name = re.search(r"(embshard[\w.]*)\.(\w+)\(plan, world_size", err.value.fix).groups()
    assert callable(getattr(importlib.import_module(module), name))
    (tmp_path / "bad.json").write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(EmbshardError, match="not UTF-8"):  # other binary: as before
        plan_from_json(tmp_path / "bad.json")


def test_read_plan_json_rejects_garbage(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text("{not json")
    with pytest.raises(EmbshardError, match="not valid JSON"):
        read_plan_json(path)
    with pytest.raises(EmbshardError, match="file not found"):
        read_plan_json(tmp_path / "missing.json")


def test_placement_from_frame_inverts_to_frame(placement, tables):
    df = placement.to_frame(device_costs=COSTS)
    df = schemas.validate(df, "placements")
    back = placement_from_frame(df, tables, D, placement.memory_bytes_per_device)
    assert [(s.device, s.col_offset, s.col_size) for s in back.shards] == \
        [(s.device, s.col_offset, s.col_size) for s in placement.shards]
    assert list(back.tables.table_ids) == list(tables.table_ids)
    assert device_costs_from_frame(df, D).tolist() == COSTS.tolist()
    own = placement_from_frame(df, tables)  # the rows carry the devices they were planned for
    assert (own.num_devices, own.memory_bytes_per_device) == (D, placement.memory_bytes_per_device)
    assert not own.meta
    with pytest.raises(EmbshardError, match="made for memory per device"):
        placement_from_frame(df, tables, D, 10)
    with pytest.raises(EmbshardError, match="made for devices 4, the tasks file gives 2"):
        placement_from_frame(df, tables, 2, placement.memory_bytes_per_device)
    old = df.drop(columns=["num_devices", "memory_bytes_per_device", "devices_per_host"])  # an older file
    inferred = placement_from_frame(old, tables)
    assert inferred.num_devices == D and inferred.meta["memory_bytes_per_device_inferred"]
    assert inferred.memory_bytes_per_device == int(placement.memory_per_device().max())
    with pytest.raises(EmbshardError, match="over"):
        placement_from_frame(old, tables, D, 10)
    with pytest.raises(EmbshardError, match="device 3 used"):
        placement_from_frame(old, tables, 2, placement.memory_bytes_per_device)
    with pytest.raises(EmbshardError, match="plans of 2 planners"):  # an evaluation's rows: export one planner's
        placement_from_frame(pd.concat([df, df.assign(planner="other")]), tables)


def test_placement_from_frame_keeps_the_hosts_its_rows_were_planned_for(tables):
    """placement_from_frame had dropped the rows' devices_per_host: a table-row-wise cut (rows on one host's
    devices) then read as rows over part of one host of all, and its TorchRec plan was refused, where `embshard
    export` of the same rows (which rebuilt the hosts itself) exported it."""
    from embshard.torchrec_compat import TABLE_ROW_WISE
    from embshard.types import DeviceTopology, row_blocks

    pytest.importorskip("torchrec")
    from embshard.export.torchrec_plan import to_torchrec_plan

    mem = int(tables.size_bytes.sum())
    rows = [Shard(0, d, row_offset=o, row_size=n) for d, (o, n) in enumerate(row_blocks(int(tables.rows[0]), 2))]
    placement = Placement(tables, D, mem, rows + [Shard(i, i % D) for i in range(1, len(tables))],
                          planner="learned", task_id="trw", topology=DeviceTopology.on_hosts(D, mem, 2))
    back = placement_from_frame(placement.to_frame(), tables)
    assert back.devices.hosts == placement.devices.hosts and back.devices.devices_per_host() == 2
    plan = to_torchrec_plan(back, compute_device="cpu")  # refused before: "not a layout TorchRec can run"
    assert next(iter(plan.plan.values()))[str(tables.table_ids[0])].sharding_type == TABLE_ROW_WISE
    one_host = placement_from_frame(placement.to_frame().assign(devices_per_host=D), tables)
    assert one_host.devices.hosts is None or len(set(one_host.devices.hosts)) == 1


def _write_inputs(tmp_path, tables_df, placement):
    schemas.write(tables_df, tmp_path / "tables.parquet", "tables")
    other = Placement(placement.tables, D, placement.memory_bytes_per_device,
                      [Shard(i, i % D) for i in range(len(placement.tables))], planner="round_robin",
                      task_id="task-b")
    import pandas as pd

    rows = pd.concat([placement.to_frame(COSTS), other.to_frame()], ignore_index=True)
    schemas.write(rows, tmp_path / "placements.parquet", "placements")
    tasks = pd.DataFrame({"task_id": ["task-a", "task-b"], "split": ["test", "test"], "num_devices": [D, D],
                          "memory_bytes_per_device": [placement.memory_bytes_per_device] * 2,
                          "table_ids": [list(placement.tables.table_ids)] * 2})
    schemas.write(tasks, tmp_path / "tasks.parquet", "tasks")
    return rows


def test_cli_writes_every_file(tmp_path, tables_df, placement):
    from embshard.cli import main

    rows = _write_inputs(tmp_path, tables_df, placement)
    out = tmp_path / "out"
    code = main(["export", "--placements", str(tmp_path / "placements.parquet"), "--tables",
                 str(tmp_path / "tables.parquet"), "--tasks", str(tmp_path / "tasks.parquet"), "--out", str(out)])
    assert code == 0
    again = schemas.read(out / "placements.parquet", "placements")
    assert len(again) == len(rows) and set(again["task_id"]) == {"task-a", "task-b"}
    plan_a = read_plan_json(out / "task-a" / "plan.json")
    assert plan_a["cost"]["device_costs_ms"] == COSTS.tolist()
    assert read_plan_json(out / "task-b" / "plan.json")["planner"] == "round_robin"
    if _has_torchrec():
        assert (out / "task-a" / "torchrec_plan.json").exists() and (out / "task-a" / "torchrec_plan.pt").exists()
    # Bad input: one line on stderr, exit code 2.
    code = main(["export", "--placements", str(tmp_path / "nope.parquet"), "--tables",
                 str(tmp_path / "tables.parquet"), "--out", str(out)])
    assert code == 2


def test_export_refuses_a_plan_whose_tables_changed_since_it_was_made(tmp_path, tables_df, placement, capsys):
    """The rows record each table as planned (table_sha256): tables re-ingested with another pooling or access
    pattern since planning are an error naming them, and nothing is written; the same tables export."""
    from embshard.cli import main

    rows = _write_inputs(tmp_path, tables_df, placement)
    assert rows["table_sha256"].str.fullmatch("[0-9a-f]{16}").all()
    changed = tables_df.copy()
    first = str(placement.tables.table_ids[0])
    changed.loc[changed["table_id"] == first, "pooling_factor"] *= 3
    schemas.write(changed, tmp_path / "changed.parquet", "tables")
    out = tmp_path / "out"
    args = ["export", "--placements", str(tmp_path / "placements.parquet"), "--out", str(out), "--tables"]
    assert main(args + [str(tmp_path / "changed.parquet")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"table(s) {first} changed since the plan was made" in err
    assert "table_sha256" in err and "plan again" in err and not out.exists()
    assert main(args + [str(tmp_path / "tables.parquet")]) == 0
    # Rows written before the column (or without a hash) are not checked.
    schemas.write(rows.drop(columns="table_sha256"), tmp_path / "old.parquet", "placements")
    assert main(["export", "--placements", str(tmp_path / "old.parquet"), "--out", str(tmp_path / "out2"),
                 "--tables", str(tmp_path / "changed.parquet")]) == 0


@pytest.mark.skipif("not _has_torchrec()")
def test_table_ids_torchrec_cannot_key_and_one_host_of_over_128_gpus_are_one_line_errors(tmp_path, tables_df, caplog):
    """'items' (an nn.ModuleDict attribute) passes `place` with a warning and stops `export` in one line; so does a
    plan on 256 devices of one host (torch numbers a host's GPUs 0-127), which --devices-per-host or
    --compute-device cpu exports."""
    import logging

    from embshard.cli import main

    df = tables_df.copy()
    df.loc[0, "table_id"] = "items"
    schemas.write(df, tmp_path / "tables.parquet", "tables")
    args = ["--tables", str(tmp_path / "tables.parquet"), "--memory-gb", "1", "--planner", "size_greedy"]
    with caplog.at_level(logging.WARNING):
        assert main(["place", *args, "--devices", "2", "--out", str(tmp_path / "p")]) == 0
    assert "table ids ['items'] cannot name TorchRec tables ('items' is an nn.ModuleDict attribute)" in caplog.text
    assert main(["export", "--placements", str(tmp_path / "p" / "placements.parquet"), "--tables",
                 str(tmp_path / "tables.parquet"), "--out", str(tmp_path / "x")]) == 2
    assert not (tmp_path / "x").exists()
    # 256 devices on one host.
    ok = tables_df.copy()
    schemas.write(ok, tmp_path / "ok.parquet", "tables")
    many = Placement(TableSet.from_frame(ok), 256, int(ok["size_bytes"].max()),
                     [Shard(i, 200 + i) for i in range(len(ok))], planner="hand", task_id="big")
    schemas.write(many.to_frame(), tmp_path / "many.parquet", "placements")
    base = ["export", "--placements", str(tmp_path / "many.parquet"), "--tables", str(tmp_path / "ok.parquet")]
    assert main([*base, "--out", str(tmp_path / "y")]) == 2 and not (tmp_path / "y").exists()
    assert main([*base, "--out", str(tmp_path / "y"), "--devices-per-host", "8"]) == 0
    doc = json.loads((tmp_path / "y" / "big" / "torchrec_plan.json").read_text())
    assert "rank:200/cuda:0" in json.dumps(doc)  # rank 200 is the first GPU of host 25
    assert main([*base, "--out", str(tmp_path / "z"), "--compute-device", "cpu"]) == 0
    assert "rank:200/cpu" in (tmp_path / "z" / "big" / "torchrec_plan.json").read_text()


def test_place_on_more_than_128_gpus_of_one_host_warns_that_export_needs_the_hosts(tmp_path, tables_df, caplog):
    import logging

    from embshard.cli import main

    schemas.write(tables_df, tmp_path / "tables.parquet", "tables")
    args = ["place", "--tables", str(tmp_path / "tables.parquet"), "--memory-gb", "1", "--planner", "size_greedy"]
    with caplog.at_level(logging.WARNING):
        assert main([*args, "--devices", "256", "--out", str(tmp_path / "a")]) == 0
    assert "256 devices on one host: the TorchRec export needs the GPUs per host" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert main([*args, "--devices", "256", "--devices-per-host", "8", "--out", str(tmp_path / "b")]) == 0
    assert "on one host" not in caplog.text


def test_the_reserved_table_names_are_the_installed_torchs():
    """`place` warns about ids nn.ModuleDict refuses without importing torch (a frozen list): it must be the
    installed torch's list."""
    import torch

    from embshard.torchrec_compat import MODULE_DICT_ATTRIBUTES

    assert set(dir(torch.nn.ModuleDict())) == MODULE_DICT_ATTRIBUTES


def test_run_without_torchrec_still_exports(tmp_path, tables_df, placement, monkeypatch):
    from embshard.export.torchrec_plan import require_torchrec
    from embshard.jobs.export import run

    _write_inputs(tmp_path, tables_df, placement)
    monkeypatch.setitem(sys.modules, "torchrec", None)  # what a machine without the extra sees
    with pytest.raises(EmbshardError, match="torchrec==1.8.0"):
        require_torchrec()
    result = run(str(tmp_path / "placements.parquet"), str(tmp_path / "tables.parquet"), str(tmp_path / "out"))
    assert result["torchrec"] is False and "torchrec" in result["torchrec_note"]
    assert set(result["plans"]["task-a"]) == {"plan_json"}
    read_plan_json(result["plans"]["task-a"]["plan_json"])


# ---- TorchRec accepts our plans -------------------------------------------------------------------------


def _has_torchrec() -> bool:
    try:
        import torchrec  # noqa: F401
    except ImportError:
        return False
    return True


needs_torchrec = pytest.mark.skipif(not _has_torchrec(), reason="torchrec extra not installed")


@needs_torchrec
def test_sharding_plan_is_well_formed(placement):
    from torchrec.distributed.planner.planners import validate_rank_assignment
    from torchrec.distributed.types import ParameterSharding, ShardingPlan

    from embshard.export import to_torchrec_plan
    from embshard.export.torchrec_plan import plan_layout, rank_layout, topology

    plan = to_torchrec_plan(placement)
    assert isinstance(plan, ShardingPlan)
    module_plan = plan.plan[""]
    t = placement.tables
    assert set(module_plan) == set(t.table_ids)
    for i, name in enumerate(t.table_ids):
        ps = module_plan[name]
        assert isinstance(ps, ParameterSharding) and ps.compute_kernel == "fused"
        ours = sorted((s.col_offset, s.col_size or int(t.dims[i]), s.device) for s in placement.shards
                      if s.table == i)
        assert ps.ranks == [r for _, _, r in ours]
        assert ps.sharding_type == ("table_wise" if len(ours) == 1 else "column_wise")
        # The shards cover the table: all rows, and the column slices tile [0, dim).
        assert all(m.shard_sizes[0] == t.rows[i] and m.shard_offsets[0] == 0 for m in ps.sharding_spec.shards)
        assert sum(m.shard_sizes[1] for m in ps.sharding_spec.shards) == t.dims[i]
    assert rank_layout(plan) == plan_layout(placement)
    validate_rank_assignment(plan, topology(D, placement.memory_bytes_per_device))


@needs_torchrec
def test_torchrec_shards_the_module_with_our_plan(placement):
    """DistributedModelParallel shards a meta-device EBC with the plan (fake process group, no GPUs)."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel

    from embshard.export import to_torchrec_plan
    from embshard.export.torchrec_plan import build_module

    class Model(torch.nn.Module):
        def __init__(self, ebc):
            super().__init__()
            self.sparse = torch.nn.ModuleList([ebc])  # its name is an index path: sparse.0

    plan = to_torchrec_plan(placement, module_path="sparse.0")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=D)
    try:
        model = DistributedModelParallel(Model(build_module(placement.tables)), device=torch.device("meta"),
                                         plan=plan, sharders=[EmbeddingBagCollectionSharder()],
                                         init_data_parallel=False, init_parameters=False)
        sharded = model.module.sparse[0]
        assert type(sharded).__name__ == "ShardedEmbeddingBagCollection"
        # Every rank's local tables, as TorchRec's sharding computed them, are exactly ours.
        got = {r: set() for r in range(D)}
        for sharding in sharded._embedding_shardings:
            for rank, groups in enumerate(sharding._grouped_embedding_configs_per_rank):
                for group in groups:
                    for table in group.embedding_tables:
                        got[rank].add((table.name, int(table.local_metadata.shard_offsets[1]), table.local_cols))
    finally:
        dist.destroy_process_group()
    t = placement.tables
    want = {r: set() for r in range(D)}
    for s in placement.shards:
        want[s.device].add((t.table_ids[s.table], s.col_offset, s.col_size or int(t.dims[s.table])))
    assert got == want


@needs_torchrec
def test_torchrec_planner_with_our_constraints_reproduces_our_ranks(tables):
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

    from embshard.export.torchrec_plan import (
        build_module,
        plan_layout,
        rank_layout,
        torchrec_constraints,
        torchrec_planner_for,
    )

    # Equal column blocks (what TorchRec's enumerator makes): table 2 in two 64-column slices.
    shards = [Shard(i, (i * 3) % D) for i in range(len(tables)) if i != 2] + [Shard(2, 1, 0, 64), Shard(2, 3, 64, 64)]
    p = Placement(tables, D, int(tables.size_bytes.sum()), shards, task_id="c")
    constraints = torchrec_constraints(p)
    assert constraints[tables.table_ids[2]].sharding_types == ["column_wise"]
    assert constraints[tables.table_ids[2]].min_partition == 64
    assert constraints[tables.table_ids[0]].sharding_types == ["table_wise"]
    plan = torchrec_planner_for(p).plan(build_module(tables), [EmbeddingBagCollectionSharder()])
    assert rank_layout(plan) == plan_layout(p)


@needs_torchrec
def test_uneven_slices_cannot_be_constraints(placement):
    from embshard.export.torchrec_plan import torchrec_constraints

    with pytest.raises(EmbshardError, match="equal column blocks"):
        torchrec_constraints(placement)


@needs_torchrec
def test_pickle_free_plan_round_trip(tmp_path, placement):
    import torch

    from embshard.export import to_torchrec_plan
    from embshard.export.torchrec_plan import plan_from_json, plan_to_json, rank_layout

    plan = to_torchrec_plan(placement)
    path = tmp_path / "torchrec_plan.json"
    path.write_text(json.dumps(plan_to_json(plan)))
    again = plan_from_json(str(path))
    assert rank_layout(again) == rank_layout(plan)
    assert str(again) == str(plan)
    torch.save(plan, tmp_path / "plan.pt")
    assert str(torch.load(tmp_path / "plan.pt", weights_only=False)) == str(plan)


@needs_torchrec
def test_a_plan_exported_for_one_host_loads_with_the_jobs_gpu_names(placement, split_placement, caplog):
    """A plan exported without hosts names rank R's GPU cuda:R; a job on hosts of L runs rank R on cuda:R % L
    (TorchRec's naming) and DistributedModelParallel fails on the mismatch deep inside. plan_from_json names
    the GPUs for the job's hosts (local_world_size; TorchRec's own in a job), warning that it did; the ranks
    are unchanged. A table-row-wise plan is still refused on other hosts than its own."""
    from embshard.export import to_torchrec_plan
    from embshard.export.torchrec_plan import plan_from_json, plan_to_json, rank_layout

    doc = plan_to_json(to_torchrec_plan(placement), world_size=D)
    assert "rank:3/cuda:3" in json.dumps(doc)
    with caplog.at_level("WARNING"):
        on_hosts = plan_from_json(doc, local_world_size=2)
    places = [str(s.placement) for ps in on_hosts.plan[""].values() for s in ps.sharding_spec.shards]
    assert "rank:3/cuda:1" in places and "rank:2/cuda:0" in places
    assert all(int(p.split(":")[-1]) == int(p.split("/")[0][5:]) % 2 for p in places)
    assert rank_layout(on_hosts) == rank_layout(plan_from_json(doc))  # who holds what: unchanged
    assert "renamed as TorchRec names them" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):
        assert str(plan_from_json(doc, local_world_size=D)) == str(plan_from_json(doc))  # one host: as written
    assert "renamed" not in caplog.text
    cpu = plan_to_json(to_torchrec_plan(placement, compute_device="cpu"), world_size=D)
    assert str(plan_from_json(cpu, local_world_size=2)) == str(plan_from_json(cpu))  # no GPU index to name
    caplog.clear()
    with caplog.at_level("WARNING"):  # a reader of ranks only (evaluate --plan): names as written, no warning
        assert str(plan_from_json(doc, local_world_size=2, rename_gpus=False)) == str(plan_from_json(doc))
    assert "renamed" not in caplog.text
    twrw = plan_to_json(to_torchrec_plan(split_placement, local_world_size=2), world_size=D)
    with pytest.raises(EmbshardError, match="table-row-wise over hosts of 2"):
        plan_from_json(twrw, local_world_size=4)
    with pytest.raises(EmbshardError, match="no ranks per host"):
        plan_from_json(doc, local_world_size=0)
    with pytest.raises(EmbshardError, match="4 ranks do not split into hosts of 3"):
        plan_from_json(doc, local_world_size=3, world_size=D)


@needs_torchrec
def test_inside_a_job_gpus_are_renamed_only_for_hosts_its_launcher_set(placement, monkeypatch, caplog):
    """In a job, TorchRec's ranks per host fall back to a guess (8, or the world) when no launcher variable says
    them (srun, mp.spawn): a plan for hosts of 2 must then load as written, not be renamed for that guess. With
    LOCAL_WORLD_SIZE set (torchrun), the GPUs follow it."""
    from embshard.export import to_torchrec_plan
    from embshard.export import torchrec_plan as tp

    doc = tp.plan_to_json(to_torchrec_plan(placement, local_world_size=2), world_size=D)
    assert "rank:3/cuda:1" in json.dumps(doc)
    monkeypatch.setattr(tp, "_job_world_size", lambda: D)  # a job of D ranks (no process group needed)
    for k in tp._LOCAL_SIZE_ENV:
        monkeypatch.delenv(k, raising=False)
    with caplog.at_level("WARNING"):
        assert str(tp.plan_from_json(doc)) == str(tp.plan_from_json(doc, local_world_size=2))
    assert "renamed" not in caplog.text
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # one host of 4 (the job's): rank 3 is cuda:3 there
    places = [str(s.placement) for ps in tp.plan_from_json(doc).plan[""].values() for s in ps.sharding_spec.shards]
    assert "rank:3/cuda:3" in places and "renamed" in caplog.text
    # torchrun's job before init_process_group (no group yet, the world size given): the same names
    monkeypatch.setattr(tp, "_job_world_size", lambda: None)
    places = [str(s.placement) for ps in tp.plan_from_json(doc, world_size=D).plan[""].values()
              for s in ps.sharding_spec.shards]
    assert "rank:3/cuda:3" in places
    monkeypatch.delenv("LOCAL_WORLD_SIZE")  # no launcher, no group: as written
    assert str(tp.plan_from_json(doc, world_size=D)) == str(tp.plan_from_json(doc, local_world_size=2))


@needs_torchrec
def test_plan_names_must_be_valid_module_keys(tables):
    from embshard.export import to_torchrec_plan

    bad = TableSet(*(getattr(tables, f) for f in tables.__dataclass_fields__))
    object.__setattr__(bad, "table_ids", np.array(["a.b"] + list(tables.table_ids[1:]), dtype=object))
    p = Placement(bad, D, int(bad.size_bytes.sum()), [Shard(i, 0) for i in range(len(bad))])
    with pytest.raises(EmbshardError, match="without '.'"):
        to_torchrec_plan(p)


def test_place_reports_a_balanced_estimate_not_a_bound(placement):
    """Measured plans fall below the old "lower bound" (fused compute in its own context, one-shot noise): it is
    printed, recorded and documented as an estimate, and a plan below it reads as a negative gap."""
    from pathlib import Path

    from embshard.placement_report import device_table

    above = device_table(placement, COSTS, balanced_estimate=2.0)
    assert "balanced estimate 2.000 ms (not a bound), gap +50.0%" in above and "lower bound" not in above
    assert "gap -14.3%" in device_table(placement, COSTS, balanced_estimate=3.5)
    # far above it (one small table on thousands of devices) a multiple reads better than "+398734.2%"
    assert "balanced estimate 1.00e-04 ms (not a bound), 30,000x it" in device_table(placement, COSTS,
                                                                                     balanced_estimate=1e-4)
    docs = Path(__file__).resolve().parents[1] / "docs" / "method.md"
    text = docs.read_text()
    assert "## Balanced estimate (not a lower bound)" in text and "Why it is called an estimate" in text


@needs_torchrec
def test_torchrec_plan_of_row_ranges_and_replicas(split_placement, tables):
    """RW = row_blocks over all ranks, TWRW = row_blocks over host 1's ranks 2-3, DP = a replica on every rank."""
    from embshard.export import to_torchrec_plan
    from embshard.export.torchrec_plan import check_plan_doc, plan_from_json, plan_to_json
    from embshard.types import row_blocks

    plan = to_torchrec_plan(split_placement)
    mp = plan.plan[""]
    ids = tables.table_ids
    assert [mp[ids[i]].sharding_type for i in range(4)] == ["row_wise", "table_row_wise", "table_wise",
                                                            "data_parallel"]
    rw = [(int(m.shard_offsets[0]), int(m.shard_sizes[0]), m.placement.rank()) for m in mp[ids[0]].sharding_spec.shards]
    assert rw == [(o, n, d) for d, (o, n) in enumerate(row_blocks(int(tables.rows[0]), 4))]
    twrw = [(int(m.shard_offsets[0]), m.placement.rank()) for m in mp[ids[1]].sharding_spec.shards]
    assert twrw == [(0, 2), (row_blocks(int(tables.rows[1]), 2)[1][0], 3)]
    assert mp[ids[1]].compute_kernel == "fused" and mp[ids[3]].ranks == [0, 1, 2, 3]
    doc = plan_to_json(plan, world_size=D, tables={str(n): (int(r), int(d)) for n, r, d in
                                                    zip(tables.table_ids, tables.rows, tables.dims)})
    check_plan_doc(doc)
    assert str(plan_from_json(json.loads(json.dumps(doc)))) == str(plan)
    bad = copy.deepcopy(doc)
    bad["modules"][""][ids[0]]["shards"][1]["offsets"][0] += 1
    with pytest.raises(EmbshardError, match="cover the rows once"):
        check_plan_doc(bad, "torchrec_plan.json")


def test_a_loaded_plan_whose_row_ranges_are_not_torchrecs_blocks_is_refused(split_placement, tables):
    """TorchRec routes a row-wise table's ids by blocks of ceil(rows / ranks): a torchrec_plan.json edited to other
    ranges (or a row_wise table on some ranks only) would send ids to ranks without their rows, so the check a
    training job runs (check_plan_doc, in plan_from_json) refuses it as export does; TorchRec's own layout of a
    table of fewer rows than ranks (the last rank empty) still loads."""
    from embshard.export.torchrec_plan import check_plan_doc, plan_to_json, to_torchrec_plan

    doc = plan_to_json(to_torchrec_plan(split_placement), world_size=D)
    rw = doc["modules"][""][str(tables.table_ids[0])]
    assert rw["sharding_type"] == "row_wise"
    moved = copy.deepcopy(doc)  # a row moved from rank 0's block to rank 1's: still every row once
    shards = moved["modules"][""][str(tables.table_ids[0])]["shards"]
    shards[0]["sizes"][0] -= 1
    shards[1]["offsets"][0] -= 1
    shards[1]["sizes"][0] += 1
    with pytest.raises(EmbshardError, match="not TorchRec's blocks") as err:
        check_plan_doc(moved, "torchrec_plan.json")
    assert "torchrec_plan.json" in str(err.value) and "embshard export" in str(err.value)
    half = copy.deepcopy(doc)  # row_wise over ranks 0-1 of a 4-rank world (blocks of 2)
    rows = int(tables.rows[0])
    block = -(-rows // 2)
    half["modules"][""][str(tables.table_ids[0])].update(ranks=[0, 1], shards=[
        {"offsets": [0, 0], "sizes": [block, int(tables.dims[0])], "placement": "rank:0/cuda:0"},
        {"offsets": [block, 0], "sizes": [rows - block, int(tables.dims[0])], "placement": "rank:1/cuda:1"}])
    with pytest.raises(EmbshardError, match="row_wise table on 2 of 4 ranks"):
        check_plan_doc(half, "torchrec_plan.json")
    small = tables.rows.copy()
    small[5] = 3
    tiny = replace(tables, rows=small, size_bytes=small * tables.dims * tables.bytes_per_element)
    placed = [Shard(5, d, row_offset=d, row_size=1) for d in range(3)] + [Shard(i, i % D) for i in range(10) if i != 5]
    p = Placement(tiny, D, int(tiny.size_bytes.sum()), placed, task_id="tiny")
    check_plan_doc(plan_to_json(to_torchrec_plan(p), world_size=D), "torchrec_plan.json", world_size=D)


def test_a_loaded_plan_is_checked_against_a_tables_parquet_and_an_unknown_path_is_a_clear_error(
        split_placement, tables_df, tmp_path):
    from embshard.export.torchrec_plan import check_plan_doc, plan_to_json, to_torchrec_plan

    doc = plan_to_json(to_torchrec_plan(split_placement), world_size=D)
    schemas.write(tables_df, tmp_path / "tables.parquet", "tables")
    check_plan_doc(doc, "torchrec_plan.json", tables=str(tmp_path / "tables.parquet"))
    other = tables_df.copy()
    other.loc[0, "rows"] += 1
    other["size_bytes"] = other["rows"] * other["dim"] * other["bytes_per_element"]
    schemas.write(other, tmp_path / "other.parquet", "tables")
    with pytest.raises(EmbshardError, match="the 10 tables given have it as"):
        check_plan_doc(doc, "torchrec_plan.json", tables=str(tmp_path / "other.parquet"))
    with pytest.raises(EmbshardError, match="tables= takes") as err:  # it said a CSV was corrupt JSON
        check_plan_doc(doc, "torchrec_plan.json", tables=str(tmp_path / "model.txt"))
    assert "table spec" in str(err.value) and err.value.field == "tables"


@needs_torchrec
def test_an_exported_plan_records_data_types_and_refuses_a_model_of_other_ones(tmp_path, tables_df, placement):
    """A plan balanced for an fp16 table would put twice its bytes on its device in an fp32 model."""
    from embshard.export.torchrec_plan import plan_from_json

    _write_inputs(tmp_path, tables_df, placement)
    from embshard.jobs.export import run

    res = run(str(tmp_path / "placements.parquet"), str(tmp_path / "tables.parquet"), str(tmp_path / "out"))
    path = res["plans"]["task-a"]["torchrec_plan_json"]
    with open(path) as f:
        doc = json.load(f)
    fp16 = str(placement.tables.table_ids[3])
    assert doc["tables"][fp16]["bytes_per_element"] == 2
    # What made it, as its plan.json says: a job that logs only this file can be traced to the plan and model.
    beside = read_plan_json(res["plans"]["task-a"]["plan_json"])
    assert doc["source"] == {"task_id": "task-a", "planner": "size_greedy", "model_uri": None,
                             "created_at": beside["created_at"], "embshard_version": beside["embshard_version"],
                             "plan_json": "plan.json", "compute_device": "cuda"}
    plan_from_json(path, tables=placement.tables)  # the tables it was made for
    wide = tables_df.copy()
    wide.loc[3, "bytes_per_element"] = 4
    wide["size_bytes"] = wide["rows"] * wide["dim"] * wide["bytes_per_element"]
    with pytest.raises(EmbshardError, match=f"table {fp16} was planned with 2-byte weights, the 10 tables given have "
                                            "4-byte ones"):
        plan_from_json(path, tables=TableSet.from_frame(wide))
    with pytest.raises(EmbshardError, match="an embshard plan.json .* not a TorchRec plan") as err:
        plan_from_json(res["plans"]["task-a"]["plan_json"])
    assert "torchrec_plan.json" in str(err.value)


@needs_torchrec
def test_row_layouts_torchrec_cannot_run_are_refused(split_placement, tables):
    from embshard.export import to_torchrec_plan
    from embshard.types import DeviceTopology

    p = copy.deepcopy(split_placement)
    rows = int(tables.rows[0])
    # Even halves on devices 1 and 3: not row_blocks over all devices, nor over one host.
    p.shards = [s for s in p.shards if s.table != 0] + [Shard(0, 1, row_offset=0, row_size=rows // 2),
                                                         Shard(0, 3, row_offset=rows // 2, row_size=rows - rows // 2)]
    with pytest.raises(EmbshardError, match="not a layout TorchRec can run.*row_blocks"):
        to_torchrec_plan(p)
    odd = copy.deepcopy(split_placement)
    odd.topology = DeviceTopology(D, odd.memory_bytes_per_device, hosts=(0, 1, 0, 1))
    with pytest.raises(EmbshardError, match="hosts"):
        to_torchrec_plan(odd)


@needs_torchrec
def test_export_job_writes_split_plans_with_hosts(tmp_path, tables_df, split_placement):
    """placements.parquet rows of every kind -> plan.json v3 with hosts and a TorchRec plan; the table-row-wise
    table needs the hosts: the rows' own, or --devices-per-host for rows without them (an older file), and
    without any nothing is written."""
    import pandas as pd

    from embshard.jobs.export import run

    schemas.write(tables_df, tmp_path / "tables.parquet", "tables")
    rows = split_placement.to_frame()
    assert set(rows["devices_per_host"]) == {2}
    schemas.write(rows.drop(columns="devices_per_host"), tmp_path / "placements.parquet", "placements")
    tasks = pd.DataFrame({"task_id": ["task-s"], "split": ["test"], "num_devices": [D],
                          "memory_bytes_per_device": [split_placement.memory_bytes_per_device],
                          "table_ids": [list(split_placement.tables.table_ids)]})
    schemas.write(tasks, tmp_path / "tasks.parquet", "tasks")
    args = (str(tmp_path / "placements.parquet"), str(tmp_path / "tables.parquet"))
    with pytest.raises(EmbshardError, match="not a layout TorchRec can run"):
        run(*args, str(tmp_path / "one_host"), tasks=str(tmp_path / "tasks.parquet"))
    assert not (tmp_path / "one_host").exists()
    result = run(*args, str(tmp_path / "out"), tasks=str(tmp_path / "tasks.parquet"), devices_per_host=2)
    plan = read_plan_json(result["plans"]["task-s"]["plan_json"])
    assert plan["hosts"] == [0, 0, 1, 1] and plan["tables"][1]["sharding_type"] == "table_row_wise"
    doc = json.loads((tmp_path / "out" / "task-s" / "torchrec_plan.json").read_text())
    kinds = {n: p["sharding_type"] for n, p in doc["modules"][""].items()}
    assert [kinds[str(t)] for t in split_placement.tables.table_ids[:4]] == ["row_wise", "table_row_wise",
                                                                            "table_wise", "data_parallel"]
    schemas.write(rows, tmp_path / "own.parquet", "placements")  # the rows' own hosts: no flag, no tasks file
    own = run(str(tmp_path / "own.parquet"), args[1], str(tmp_path / "own"))
    assert read_plan_json(own["plans"]["task-s"]["plan_json"])["hosts"] == [0, 0, 1, 1]


def test_place_on_hosts_writes_hosts_and_refuses_an_uneven_layout(tmp_path, tables_df):
    """`embshard place --devices-per-host L`: the plan is made for (and plan.json records) hosts of L devices, so
    a table-row-wise cut can be exported without restating them; L that does not divide the devices is a one-line
    error naming the field, before any planning, and writes nothing."""
    from embshard.jobs.place import place

    schemas.write(tables_df, tmp_path / "tables.parquet", "tables")
    mem = int(tables_df["size_bytes"].sum())
    out = place(str(tmp_path / "tables.parquet"), str(tmp_path / "on_hosts"), devices=D, memory_bytes=mem,
                planner="size_lookup_greedy", devices_per_host=2)
    assert out["placement"].devices.hosts == (0, 0, 1, 1)
    assert read_plan_json(out["plan_json"])["hosts"] == [0, 0, 1, 1]
    with pytest.raises(EmbshardError, match="4 devices do not split into hosts of 3") as err:
        place(str(tmp_path / "tables.parquet"), str(tmp_path / "bad"), devices=D, memory_bytes=mem,
              planner="size_lookup_greedy", devices_per_host=3)
    # the flag's mistake: named by its field, not blamed on the tables file (a user read it as the file's)
    assert err.value.field == "devices_per_host" and err.value.path is None
    assert not (tmp_path / "bad").exists()


def test_place_then_export_keeps_the_devices_without_a_tasks_file(tmp_path, tables_df):
    """`place` on 8 devices (the last ones left empty) then `export` of its placements.parquet: the plan stays one
    for 8 devices of the asked memory on hosts of 4 (it became 4 or fewer devices of the fullest one's memory)."""
    from embshard.jobs.export import run
    from embshard.jobs.place import place

    schemas.write(tables_df.head(3), tmp_path / "tables.parquet", "tables")
    mem = 4 * int(tables_df["size_bytes"].sum())
    out = place(str(tmp_path / "tables.parquet"), str(tmp_path / "placed"), devices=8, memory_bytes=mem,
                planner="size_greedy", devices_per_host=4)
    assert out["placement"].memory_per_device()[3:].sum() == 0  # 3 tables: most devices are empty
    res = run(out["placements"], str(tmp_path / "tables.parquet"), str(tmp_path / "exported"), torchrec=False)
    plan = read_plan_json(next(iter(res["plans"].values()))["plan_json"])
    assert (plan["num_devices"], plan["memory_bytes_per_device"]) == (8, mem)
    assert plan["hosts"] == [0] * 4 + [1] * 4 and not plan["meta"].get("num_devices_inferred")


def test_tasks_devices_per_host_gives_the_task_its_hosts(tmp_path, tables_df):
    """tasks.parquet's optional devices_per_host: a task on hosts of 2 plans for them (`place --task-id` too) and
    is exported on them, null means one host, and a value that does not divide num_devices names the file, the task
    and the field."""
    import pandas as pd

    from embshard.jobs.place import place
    from embshard.types import load_tasks

    schemas.write(tables_df, tmp_path / "tables.parquet", "tables")
    mem = int(tables_df["size_bytes"].sum())
    ids = list(tables_df["table_id"])
    tasks = pd.DataFrame({"task_id": ["hosts-2", "one-host"], "split": ["test", "test"], "num_devices": [D, D],
                          "memory_bytes_per_device": [mem, mem], "table_ids": [ids, ids],
                          "devices_per_host": pd.array([2, None], dtype="Int32")})
    schemas.write(tasks, tmp_path / "tasks.parquet", "tasks")
    got = {t.task_id: t.devices.hosts for t in load_tasks(str(tmp_path / "tables.parquet"), tmp_path / "tasks.parquet")}
    assert got == {"hosts-2": (0, 0, 1, 1), "one-host": None}
    out = place(str(tmp_path / "tables.parquet"), str(tmp_path / "p"), tasks=str(tmp_path / "tasks.parquet"),
                task_id="hosts-2", planner="size_lookup_greedy")
    assert read_plan_json(out["plan_json"])["hosts"] == [0, 0, 1, 1]
    # The export reads the task's hosts from the same tasks file (placements.parquet carries none).
    from embshard.jobs.export import run

    exported = run(out["placements"], str(tmp_path / "tables.parquet"), str(tmp_path / "exp"),
                   tasks=str(tmp_path / "tasks.parquet"), torchrec=False)
    assert read_plan_json(exported["plans"]["hosts-2"]["plan_json"])["hosts"] == [0, 0, 1, 1]
    tasks["devices_per_host"] = pd.array([3, None], dtype="Int32")
    schemas.write(tasks, tmp_path / "bad.parquet", "tasks")
    with pytest.raises(EmbshardError, match=r"bad.parquet \(task hosts-2\).*do not split into hosts of 3"):
        load_tasks(str(tmp_path / "tables.parquet"), tmp_path / "bad.parquet")


@needs_torchrec
def test_a_rank_holding_slices_of_one_table_of_unequal_widths_is_refused(placement):
    """TorchRec 1.8 views a rank's rows of a table at one width: a plan giving a rank slices of 32 and 32 columns
    runs, slices of 64 and 32 fail in DistributedModelParallel (a shape error). `export` and the check a training
    job runs on torchrec_plan.json refuse them, naming the table and the rank."""
    from embshard.export import to_torchrec_plan
    from embshard.export.torchrec_plan import check_plan_doc, plan_to_json

    equal = copy.deepcopy(placement)  # table 0's two halves on one rank: one width, TorchRec runs it
    equal.shards = [s.on(0) if s.table == 0 else s for s in equal.shards]
    to_torchrec_plan(equal)
    mixed = copy.deepcopy(placement)  # table 2: 64 columns on device 3, then its 32-column slice from device 0
    mixed.shards = [s.on(3) if (s.table, s.col_offset) == (2, 64) else s for s in mixed.shards]
    with pytest.raises(EmbshardError, match=r"device 3 holds column slices of widths \[64, 32\]") as err:
        to_torchrec_plan(mixed)
    assert err.value.field == "col_size"
    name = str(placement.tables.table_ids[2])
    doc = plan_to_json(to_torchrec_plan(placement), world_size=D)
    shards = doc["modules"][""][name]["shards"]
    moved = next(k for k, s in enumerate(shards) if s["offsets"][1] == 64)
    shards[moved]["placement"] = shards[moved]["placement"].replace("rank:0/", "rank:3/").replace("cpu:0", "cpu:3")
    doc["modules"][""][name]["ranks"][moved] = 3
    with pytest.raises(EmbshardError, match=r"rank 3 holds column slices of widths") as err:
        check_plan_doc(doc, "torchrec_plan.json")
    assert "torchrec_plan.json" in str(err.value)
    # Widths that are no multiples of 4 (62 + 66): FBGEMM cannot run them; a training job's check refuses them.
    odd = plan_to_json(to_torchrec_plan(placement), world_size=D)
    shards = sorted(odd["modules"][""][name]["shards"], key=lambda s: s["offsets"][1])
    shards[0]["sizes"][1] -= 2
    shards[1]["offsets"][1] -= 2
    shards[1]["sizes"][1] += 2
    with pytest.raises(EmbshardError, match=r"column slices of \d+ columns \(slices must be multiples of 4"):
        check_plan_doc(odd, "torchrec_plan.json")


@needs_torchrec
def test_a_table_of_fewer_rows_than_devices_row_wise_as_torchrec_lays_it_out(tables):
    """TorchRec's own row_wise() of a 3-row table on 4 ranks gives ranks 0-2 a row each and rank 3 nothing (its
    planner, torchrec_full, does this): the export hands it on as row_wise."""
    from dataclasses import replace

    from embshard.export import to_torchrec_plan
    from embshard.torchrec_compat import ROW_WISE, row_layout

    assert row_layout(3, [(2, 1, 2), (0, 1, 0), (1, 1, 1)], 4) == (ROW_WISE, None)
    assert row_layout(3, [(0, 1, 1), (1, 1, 2), (2, 1, 3)], 4) is None  # not from rank 0
    rows = tables.rows.copy()
    rows[5] = 3
    tiny = replace(tables, rows=rows, size_bytes=rows * tables.dims * tables.bytes_per_element)
    shards = [Shard(5, d, row_offset=d, row_size=1) for d in range(3)] + [Shard(i, i % D) for i in range(10) if i != 5]
    p = Placement(tiny, D, int(tiny.size_bytes.sum()), shards, task_id="tiny")
    ps = to_torchrec_plan(p).plan[""][str(tiny.table_ids[5])]
    assert ps.sharding_type == "row_wise"
    assert [(int(m.shard_offsets[0]), int(m.shard_sizes[0]), m.placement.rank()) for m in ps.sharding_spec.shards
            if int(m.shard_sizes[0])] == [(0, 1, 0), (1, 1, 1), (2, 1, 2)]


def test_export_refuses_devices_per_host_other_than_the_placements_own(tmp_path, tables_df, split_placement):
    """A placements file planned for hosts of 2, exported with --devices-per-host 1: a one-line error naming the
    conflict and the fix (it read as a row layout TorchRec cannot run), nothing written."""
    from embshard.jobs.export import run

    schemas.write(tables_df, tmp_path / "tables.parquet", "tables")
    schemas.write(split_placement.to_frame(), tmp_path / "placements.parquet", "placements")
    with pytest.raises(EmbshardError, match="gives 1 devices per host, but the placements were planned for hosts "
                                            "of 2") as err:
        run(str(tmp_path / "placements.parquet"), str(tmp_path / "tables.parquet"), str(tmp_path / "out"),
            devices_per_host=1, torchrec=False)
    assert err.value.field == "devices_per_host" and not (tmp_path / "out").exists()


def test_the_export_stage_plan_json_says_what_place_would(tables_df, tmp_path):
    """The pipeline's export stage writes plan.json from placements.parquet: it used to lose the planner's meta
    and the balanced estimate (an empty `meta`, a null `balanced_estimate_ms`); the rows carry both now."""
    from fixed_models import analytic

    from embshard.jobs import export
    from embshard.planners.learned import LearnedPlanner

    tables_path = tmp_path / "tables.parquet"
    schemas.write(tables_df, tables_path, "tables")
    tasks = pd.DataFrame([{"task_id": "t0", "split": "test", "num_devices": D,
                           "memory_bytes_per_device": 1 << 30, "table_ids": list(tables_df["table_id"])}])
    tasks_path = tmp_path / "tasks.parquet"
    schemas.write(tasks, tasks_path, "tasks")
    planner = LearnedPlanner(None, analytic(), composition_name="no_policy", search_evaluations=2000)
    placed = export.place_tasks(str(tables_path), str(tasks_path), planner, str(tmp_path / "planned.parquet"))
    rows = schemas.read(placed, "placements")
    out = export.run(placed, str(tables_path), str(tmp_path / "export"), tasks=str(tasks_path), torchrec=False)
    plan = read_plan_json(out["plans"]["t0"]["plan_json"])
    assert plan["meta"]["search_evaluations"] > 0 and plan["meta"] == json.loads(rows["plan_meta"].iloc[0])
    estimate = plan["cost"]["balanced_estimate_ms"]
    assert estimate is not None and 0 < estimate <= plan["cost"]["overall_ms"]
    assert estimate == pytest.approx(rows["balanced_estimate_ms"].iloc[0])


@pytest.mark.parametrize("text, says", [("{not json", "is not JSON"), ("[1, 2]", "not an object")])
def test_a_placements_file_whose_plan_meta_is_not_a_json_object_is_refused(placement, tables, text, says):
    rows = placement.to_frame().assign(plan_meta=text)
    with pytest.raises(EmbshardError, match=says) as err:
        placement_from_frame(rows, tables, where="p.parquet")
    assert "plan_meta" in str(err.value) and "p.parquet" in str(err.value)


def _spec(tables_df, path, drop: int | None = None):
    """tables_df as a TorchRec-named table spec (CSV or YAML by `path`'s suffix), without table `drop`."""
    spec = pd.DataFrame({"name": tables_df["table_id"], "num_embeddings": tables_df["rows"],
                         "embedding_dim": tables_df["dim"], "pooling_factor": tables_df["pooling_factor"],
                         "data_type": tables_df["bytes_per_element"].map({4: "fp32", 2: "fp16"})})
    if drop is not None:
        spec = spec.drop(index=drop)
    if str(path).endswith(".csv"):
        spec.to_csv(path, index=False)
    else:
        import yaml

        path.write_text(yaml.safe_dump({"tables": spec.to_dict("records")}))
    return path


class _Sparse:
    """A model whose EBC sits at sparse_arch.embedding_bag_collection, as in TorchRec's DLRM."""

    @staticmethod
    def model(ebc):
        import torch

        class Sparse(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.embedding_bag_collection = ebc

        class Model(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.sparse_arch = Sparse()
                self.dense = torch.nn.Linear(4, 4)

        return Model()


@needs_torchrec
def test_plan_from_json_with_the_model_puts_each_table_where_dmp_will_shard_it(placement, tmp_path):
    """DistributedModelParallel leaves a module the plan does not name unsharded, without an error: every rank then
    holds every full table. With `module=model`, plan_from_json puts each table under the model's
    EmbeddingBagCollection that holds it, whatever module path the plan was exported with (a model of several EBCs,
    a weighted one among them, loads one plan); a table no EBC holds is refused, naming the model's EBCs."""
    from embshard.export.torchrec_plan import build_module, plan_from_json, plan_to_json, to_torchrec_plan

    t = placement.tables
    model = _Sparse.model(build_module(t))
    right = "sparse_arch.embedding_bag_collection"
    for path in ("sparse_arch.ebc", "", "sparse_arch", right):  # the default path "" with a nested model too
        doc = plan_to_json(to_torchrec_plan(placement, module_path=path), world_size=D)
        assert {p: set(m) for p, m in plan_from_json(doc, world_size=D, module=model).plan.items()} == {
            right: set(t.table_ids)}
        assert set(plan_from_json(doc, world_size=D, module=build_module(t)).plan) == {""}  # the model is the EBC
    # Two EBCs (TorchRec's is_weighted is per EBC): each gets its own tables from one plan.
    two = _Sparse.model(build_module(t.subset(np.arange(7))))
    two.sparse_arch.weighted = build_module(t.subset(np.arange(7, 10)))
    routed = plan_from_json(doc, world_size=D, module=two).plan
    assert {p: set(m) for p, m in routed.items()} == {right: set(t.table_ids[:7]),
                                                      "sparse_arch.weighted": set(t.table_ids[7:])}
    # A table that no EBC holds: named, with the model's EBCs.
    with pytest.raises(EmbshardError, match=f"the plan places table {t.table_ids[9]}, which no "
                                            f"EmbeddingBagCollection of the model holds \\(the model's: '{right}'"):
        plan_from_json(plan_to_json(to_torchrec_plan(placement, module_path="sparse_arch"), world_size=D),
                       module=_Sparse.model(build_module(t.subset(np.arange(9)))))
    doc = plan_to_json(to_torchrec_plan(placement, module_path=right), world_size=D)
    # The EBC at the right path, but holding other tables: the table and both shapes are named.
    first = str(t.table_ids[0])
    other = build_module(replace(t, rows=t.rows * 2))
    with pytest.raises(EmbshardError, match=f"table {first}: the plan's shards hold {int(t.rows[0]):,} rows x "
                                            f"{int(t.dims[0])} columns, the 10 tables of the model's module "
                                            f"'{right}' have it as {2 * int(t.rows[0]):,} x {int(t.dims[0])}"):
        plan_from_json(doc, module=_Sparse.model(other))
    with pytest.raises(EmbshardError, match=f"the plan places table {t.table_ids[9]}, which is not among the 9 "
                                            f"tables of the model's module '{right}'"):
        plan_from_json(doc, module=_Sparse.model(build_module(t.subset(np.arange(9)))))
    with pytest.raises(EmbshardError, match="not a torch.nn.Module"):
        plan_from_json(doc, module="sparse_arch")


@needs_torchrec
def test_plan_from_json_takes_path_likes_spec_files_and_torchrec_tables(placement, tables_df, tmp_path):
    """A pathlib.Path as the plan or the tables (it said 'the plan is a JSON PosixPath' / a bare TypeError), a table
    spec read as the CLI reads it, TorchRec's EmbeddingBagConfigs or the EBC itself; anything else is one
    EmbshardError naming tables= and what it takes."""
    from pathlib import Path

    from embshard.export.torchrec_plan import build_module, plan_from_json, plan_to_json, to_torchrec_plan

    t = placement.tables
    path = tmp_path / "torchrec_plan.json"
    path.write_text(json.dumps(plan_to_json(to_torchrec_plan(placement), world_size=D)))
    schemas.write(tables_df, tmp_path / "tables.parquet", "tables")
    ebc = build_module(t)
    for tables in (None, tmp_path / "tables.parquet", _spec(tables_df, tmp_path / "model.csv"),
                   _spec(tables_df, tmp_path / "model.yaml"), list(ebc.embedding_bag_configs()), ebc):
        plan = plan_from_json(path, world_size=D, tables=tables)
        assert set(plan.plan[""]) == set(t.table_ids)
    fewer = _spec(tables_df, tmp_path / "fewer.yaml", drop=4)
    with pytest.raises(EmbshardError, match=f"the plan places table {t.table_ids[4]}, which is not among the 9 "
                                            "tables given"):
        plan_from_json(Path(path), tables=fewer)
    wide = build_module(replace(t, dims=t.dims * 2))
    with pytest.raises(EmbshardError, match=f"table {t.table_ids[0]}: the plan's shards hold .* columns, the 10 "
                                            "tables given have it as"):
        plan_from_json(path, tables=list(wide.embedding_bag_configs()))
    fp32 = build_module(replace(t, bytes_per_element=np.full(len(t), 4)))
    doc = plan_to_json(to_torchrec_plan(placement), world_size=D,
                       tables={str(n): (int(r), int(d), int(b))
                               for n, r, d, b in zip(t.table_ids, t.rows, t.dims, t.bytes_per_element)})
    with pytest.raises(EmbshardError, match=f"table {t.table_ids[3]} was planned with 2-byte weights"):
        plan_from_json(doc, tables=fp32)
    for bad in (42, [1, 2], {"rows": 3}):
        with pytest.raises(EmbshardError, match="tables= is a") as err:
            plan_from_json(path, tables=bad)
        assert err.value.field == "tables" and "EmbeddingBagConfig" in err.value.fix


@needs_torchrec
def test_a_table_on_one_side_only_is_said_the_right_way_round(placement, tables_df):
    """The plan places a table the model lacks: it said 'table X is not one of the 9 tables the plan is for' (the
    other way round). Each direction now says which side has the table."""
    from embshard.export.torchrec_plan import plan_from_json, plan_to_json, to_torchrec_plan

    t = placement.tables
    doc = plan_to_json(to_torchrec_plan(placement), world_size=D)
    lacking = TableSet.from_frame(tables_df.drop(index=9).reset_index(drop=True))
    with pytest.raises(EmbshardError, match=f"the plan places table {t.table_ids[9]}, which is not among the 9 "
                                            "tables given") as err:
        plan_from_json(doc, tables=lacking)
    assert err.value.field == f"modules.{t.table_ids[9]}"
    more = pd.concat([tables_df, tables_df.iloc[[0]].assign(table_id="extra_table")], ignore_index=True)
    with pytest.raises(EmbshardError, match="the 11 tables given include 1 table.s. the plan does not place "
                                            r"\(extra_table\)") as err:
        plan_from_json(doc, tables=TableSet.from_frame(more))
    assert err.value.field == "modules" and "every table of the model must be placed" in err.value.fix


@needs_torchrec
@pytest.mark.parametrize("change, says", [
    ("fewer_rows", "the plan's shards hold {rows:,} rows x {dim} columns, the 10 tables of the module given have "
                   "it as {half:,} x {dim}"),
    ("wider", "the plan's shards hold {rows:,} rows x {dim} columns, the 10 tables of the module given have it "
              "as {rows:,} x {wide}"),
    ("missing", "the plan places table {name}, which is not among the 9 tables of the module given"),
    ("extra", "the 11 tables of the module given include 1 table.s. the plan does not place"),
    ("fp32", "table {fp16} was planned with 2-byte weights, the 10 tables of the module given have 4-byte ones"),
])
@pytest.mark.parametrize("plan", ["placement", "split_placement"])
def test_to_torchrec_plan_refuses_a_module_that_is_not_the_plans(plan, change, says, request):
    """It built a plan for any module it was given (fewer rows, wider dims, a row-wise plan of another table's
    shape), which DistributedModelParallel then rejected deep inside TorchRec or ran with columns unplaced."""
    from torchrec import EmbeddingBagCollection

    from embshard.export import to_torchrec_plan
    from embshard.export.torchrec_plan import build_module

    p = request.getfixturevalue(plan)
    t = p.tables
    to_torchrec_plan(p, module=build_module(t))  # the plan's own tables
    first = str(t.table_ids[0])
    module = {"fewer_rows": lambda: build_module(replace(t, rows=t.rows // 2)),
              "wider": lambda: build_module(replace(t, dims=t.dims * 2)),
              "missing": lambda: build_module(t.subset(np.arange(1, 10))),
              "extra": lambda: EmbeddingBagCollection(
                  tables=list(build_module(t).embedding_bag_configs()) + list(build_module(
                      replace(t.subset([0]), table_ids=np.array(["extra_table"]))).embedding_bag_configs()),
                  device=__import__("torch").device("meta")),
              "fp32": lambda: build_module(replace(t, bytes_per_element=np.full(len(t), 4)))}[change]()
    words = says.format(rows=int(t.rows[0]), half=int(t.rows[0]) // 2, dim=int(t.dims[0]), wide=2 * int(t.dims[0]),
                        name=first, fp16=t.table_ids[3])
    with pytest.raises(EmbshardError, match=words) as err:
        to_torchrec_plan(p, module=module)
    assert err.value.field.startswith("tables") and len(str(err.value).splitlines()) == 1
    with pytest.raises(EmbshardError, match="not an EmbeddingBagCollection"):
        to_torchrec_plan(p, module=_Sparse.model(build_module(t)))


def test_export_refuses_a_spec_table_the_plan_does_not_place_and_names_the_spec_given(tmp_path, tables_df, capsys):
    """A spec lists the model's tables: a table the plan leaves out was silently left out of the export; a plan's
    table the spec lacks said 'use ids present in tables.parquet' of a YAML spec."""
    from embshard.cli import main
    from embshard.ingest.spec import read_tables

    spec = _spec(tables_df, tmp_path / "model.yaml")
    ts = read_tables(spec)  # the tables place would plan (the same seed: the same access features)
    nine = Placement(ts.subset(np.arange(9)), D, int(ts.size_bytes.sum()), [Shard(i, i % D) for i in range(9)],
                     planner="round_robin", task_id="t")
    schemas.write(nine.to_frame(), tmp_path / "placements.parquet", "placements")
    out = tmp_path / "out"
    args = ["export", "--placements", str(tmp_path / "placements.parquet"), "--out", str(out), "--no-torchrec"]
    assert main(args + ["--tables", str(spec)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"table(s) of the spec {spec} are not placed" in err
    assert f"({ts.table_ids[9]})" in err and "plan again with these tables" in err and not out.exists()
    assert main(args + ["--tables", str(_spec(tables_df, tmp_path / "nine.yaml", drop=9))]) == 0
    # The plan places a table the spec lacks: the fix names the spec given.
    assert main(args + ["--tables", str(_spec(tables_df, tmp_path / "eight.yaml", drop=8))]) == 2
    err = capsys.readouterr().err.strip()
    assert f"unknown table ids ['{ts.table_ids[8]}']" in err and f"use ids present in {tmp_path / 'eight.yaml'}" in err
    assert "tables.parquet" not in err
    # The same through a plan.json (a user's hand-written plan): the fix names the spec given, too.
    from embshard.export.plan_json import write_plan_json

    write_plan_json(nine, tmp_path / "plan.json")
    json_args = ["export", "--placements", str(tmp_path / "plan.json"), "--out", str(out), "--no-torchrec"]
    assert main(json_args + ["--tables", str(tmp_path / "eight.yaml")]) == 2
    err = capsys.readouterr().err.strip()
    assert f"use ids present in {tmp_path / 'eight.yaml'}" in err and "tables.parquet" not in err
    # A tables.parquet is a pool that tasks take some tables of: its other tables are no error.
    from embshard.ingest.spec import tables_from_spec

    schemas.write(tables_from_spec(str(spec), progress=False), tmp_path / "tables.parquet", "tables")
    assert main(args + ["--tables", str(tmp_path / "tables.parquet")]) == 0


@needs_torchrec
def test_in_a_job_plan_from_json_checks_the_process_groups_world_and_cuda(placement, tables, tmp_path):
    """Inside a training job (a process group), a plan for another world size is refused without world_size=
    (TorchRec failed with an IndexError in its column-wise sharding), and a plan on CUDA devices is refused where
    there is no CUDA (TorchRec failed deep in DMP: 'Local shard tensor device does not match'). Outside a job both
    load: reading a GPU job's plan on a CPU machine is fine."""
    import torch
    import torch.distributed as dist

    from embshard.export.torchrec_plan import plan_from_json, plan_to_json, to_torchrec_plan

    four = plan_to_json(to_torchrec_plan(placement))  # no world_size in the file
    one = Placement(tables, 1, int(tables.size_bytes.sum()), [Shard(i, 0) for i in range(len(tables))],
                    planner="x", task_id="one")
    on_cuda, on_cpu = (plan_to_json(to_torchrec_plan(one, compute_device=c)) for c in ("cuda", "cpu"))
    plan_from_json(four)
    plan_from_json(on_cuda)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        with pytest.raises(EmbshardError, match=r"rank [1-3] is beyond a world of 1 ranks") as err:
            plan_from_json(four)
        assert "load the plan exported for this job's number of devices" in str(err.value)
        if not torch.cuda.is_available():
            with pytest.raises(EmbshardError, match="the plan puts table t0000 on rank:0/cuda:0, and this process "
                                                    "has no CUDA device") as err:
                plan_from_json(on_cuda)
            assert "--compute-device cpu" in str(err.value)
        assert set(plan_from_json(on_cpu).plan[""]) == set(tables.table_ids)
    finally:
        dist.destroy_process_group()


@needs_torchrec
def test_export_takes_a_hand_edited_plan_json(placement, tables_df, tmp_path):
    """A plan.json edited by hand (a table moved to another device) exports like placements.parquet: its plan.json,
    TorchRec plans and rows carry the edit. An edit that breaks the plan (a device over its memory) is one error
    naming the file, and nothing is written."""
    from embshard.jobs.export import run as export

    schemas.write(tables_df, tmp_path / "tables.parquet", "tables")
    plan = write_plan_json(placement, tmp_path / "plan.json", device_costs=COSTS)
    moved = next(t for t in plan["tables"] if len(t["shards"]) == 1)
    old_device = moved["shards"][0]["device"]
    moved["shards"][0]["device"] = (old_device + 1) % D
    for dev, sign in ((plan["devices"][old_device], -1), (plan["devices"][(old_device + 1) % D], 1)):
        dev["memory_bytes"] += sign * moved["size_bytes"]  # devices[] follows the shards (its error says how)
        dev["memory_used_fraction"] = dev["memory_bytes"] / plan["memory_bytes_per_device"]
        dev["tables"] = [n for n in dev["tables"] if n != moved["table_id"]] + ([moved["table_id"]] if sign > 0
                                                                                 else [])
    plan.update(created_at="2026-01-02T03:04:05+00:00", embshard_version="0.1.0+gplanningcode",
                meta={**plan["meta"], "time_cap_hit": False, "cut": "t1 in 2 column slices"})
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(plan))
    res = export(str(edited), str(tmp_path / "tables.parquet"), str(tmp_path / "out"), compute_device="cpu")
    out = read_plan_json(res["plans"]["task-a"]["plan_json"])
    # when, by which code and how it was made stay the plan's (meta had been dropped, the others made the export's)
    assert (out["created_at"], out["embshard_version"]) == ("2026-01-02T03:04:05+00:00", "0.1.0+gplanningcode")
    assert out["meta"]["time_cap_hit"] is False and out["meta"]["cut"] == "t1 in 2 column slices"
    assert next(t for t in out["tables"] if t["table_id"] == moved["table_id"])["shards"][0]["device"] == \
        (old_device + 1) % D
    rows = schemas.read(tmp_path / "out" / "placements.parquet", "placements")
    assert int(rows.loc[rows.table_id == moved["table_id"], "device"].iloc[0]) == (old_device + 1) % D
    with open(res["plans"]["task-a"]["torchrec_plan_json"], encoding="utf-8") as f:
        doc = json.load(f)
    assert doc["modules"][""][moved["table_id"]]["ranks"] == [(old_device + 1) % D]

    # A plan.json of other traffic is refused, as a placements.parquet's table_sha256 is (it had exported).
    changed = tables_df.copy()
    changed.loc[changed["table_id"] == moved["table_id"], "pooling_factor"] *= 4.5
    schemas.write(changed, tmp_path / "changed.parquet", "tables")
    with pytest.raises(EmbshardError, match=f"table {moved['table_id']} changed since the plan was made "
                                            r"\(pooling_factor"):
        export(str(edited), str(tmp_path / "changed.parquet"), str(tmp_path / "out3"))
    # A TorchRec plan given as --placements: the plan.json beside it is what export reads.
    with pytest.raises(EmbshardError, match="a TorchRec plan, not a plan.json .*the plan.json beside it"):
        export(res["plans"]["task-a"]["torchrec_plan_json"], str(tmp_path / "tables.parquet"),
               str(tmp_path / "out3"))
    assert not (tmp_path / "out3").exists()

    plan["memory_bytes_per_device"] = max(dev["memory_bytes"] for dev in plan["devices"]) - 1  # one byte short
    edited.write_text(json.dumps(plan))
    with pytest.raises(EmbshardError, match=r"device 0 holds [\d,]+ bytes \([\d.]+ [KMG]i?B\), 1 bytes over its "
                                            r"[\d.]+ [KMG]iB") as err:
        export(str(edited), str(tmp_path / "tables.parquet"), str(tmp_path / "out2"))
    assert str(edited) in str(err.value) and len(str(err.value).splitlines()) == 1
    assert not (tmp_path / "out2").exists()


@needs_torchrec
def test_a_data_parallel_table_reads_with_null_or_no_shards_and_only_the_dense_kernel(tables):
    """TorchRec's own plans give a data_parallel table sharding_spec=None: `shards: null` reads like the export's
    `[]`; a data_parallel table with the fused kernel is refused (TorchRec runs it dense only)."""
    from embshard.export.torchrec_plan import plan_from_json, plan_to_json, to_torchrec_plan

    n = len(tables)
    shards = [Shard(i, i % D) for i in range(n - 1)] + [Shard(n - 1, d, kind="replicated") for d in range(D)]
    doc = plan_to_json(to_torchrec_plan(Placement(tables, D, int(tables.size_bytes.sum()), shards, task_id="dp")),
                       world_size=D)
    last = str(tables.table_ids[n - 1])
    assert doc["modules"][""][last]["shards"] == [] and doc["modules"][""][last]["compute_kernel"] == "dense"
    doc["modules"][""][last]["shards"] = None
    assert plan_from_json(doc).plan[""][last].sharding_type == "data_parallel"
    doc["modules"][""][last]["compute_kernel"] = "fused"
    with pytest.raises(EmbshardError, match="a data_parallel table cannot run the 'fused' kernel.*write 'dense'"):
        plan_from_json(doc)


@needs_torchrec
def test_routing_keeps_a_table_listed_twice_an_error_and_cpu_plans_take_cpu_kernels(placement):
    """A table under two module paths is refused with module= too (routing had merged it, the last one winning);
    a CPU plan (rank:R/cpu) with a kernel TorchRec's EBC runs only on CUDA (fused_uvm) is refused."""
    import copy

    from embshard.export.torchrec_plan import build_module, plan_from_json, plan_to_json, to_torchrec_plan

    t = placement.tables
    doc = plan_to_json(to_torchrec_plan(placement), world_size=D)
    first = str(t.table_ids[0])
    twice = copy.deepcopy(doc)
    twice["modules"]["ebc"] = {first: copy.deepcopy(doc["modules"][""][first])}
    with pytest.raises(EmbshardError, match=f"table {first} is in more than one module"):
        plan_from_json(twice, module=build_module(t))
    cpu = plan_to_json(to_torchrec_plan(placement, compute_device="cpu"), world_size=D)
    whole = next(n for n, p in cpu["modules"][""].items() if p["sharding_type"] == "table_wise")
    cpu["modules"][""][whole]["compute_kernel"] = "fused_uvm"
    with pytest.raises(EmbshardError, match=f"{whole}.compute_kernel.*cannot run the 'fused_uvm' kernel"):
        plan_from_json(cpu)
    doc["modules"][""][whole]["compute_kernel"] = "fused_uvm"  # on CUDA ranks it runs
    plan_from_json(doc)


def test_a_hand_edit_that_overfills_a_device_is_told_so_first(placement, tmp_path):
    """Moving a shard onto a full device without updating devices[]: the error is the memory over the budget (it
    had been 'devices[] ... hold 0', which hid the real problem)."""
    plan = write_plan_json(placement, tmp_path / "plan.json", device_costs=COSTS)
    fullest = max(plan["devices"], key=lambda dev: dev["memory_bytes"])["device"]
    plan["memory_bytes_per_device"] = max(dev["memory_bytes"] for dev in plan["devices"])
    moved = next(t for t in plan["tables"] if len(t["shards"]) == 1 and t["shards"][0]["device"] != fullest)
    moved["shards"][0]["device"] = fullest
    with pytest.raises(EmbshardError, match=f"field 'devices.{fullest}.memory_bytes': device {fullest} holds .* "
                                            "over its"):
        validate_plan(plan, "edited.json")


@needs_torchrec
def test_a_plan_passed_as_a_dict_is_named_by_where(placement):
    """Rank 0 reads the file and broadcasts the dict: its errors can name that file (they said '<torchrec plan>')."""
    from embshard.export.torchrec_plan import plan_from_json, plan_to_json, to_torchrec_plan

    doc = plan_to_json(to_torchrec_plan(placement), world_size=D)
    with pytest.raises(EmbshardError, match=r"^plans/task-a/torchrec_plan.json: field 'world_size'"):
        plan_from_json(doc, world_size=D + 1, where="plans/task-a/torchrec_plan.json")
    with pytest.raises(EmbshardError, match=r"^<torchrec plan>: field 'world_size'"):
        plan_from_json(doc, world_size=D + 1)


@needs_torchrec
def test_a_torchrec_plan_cut_table_row_wise_is_measured_only_on_its_hosts(tmp_path, split_placement, tables):
    """A TorchRec plan records no hosts: its table-row-wise table (2 ranks here) is measured only on a task whose
    hosts hold that many devices (evaluate --devices-per-host), not as rows spread over another layout."""
    from embshard.export.torchrec_plan import plan_to_json, to_torchrec_plan
    from embshard.export.user_plan import UserPlan
    from embshard.types import DeviceTopology

    doc = plan_to_json(to_torchrec_plan(split_placement), world_size=D,
                       tables={str(n): (int(r), int(d)) for n, r, d in zip(tables.table_ids, tables.rows, tables.dims)})
    path = tmp_path / "torchrec_plan.json"
    path.write_text(json.dumps(doc))
    plan, mem = UserPlan(str(path)), split_placement.memory_bytes_per_device
    with pytest.raises(EmbshardError, match="table-row-wise over hosts of 2 ranks, task t has 4 devices per host") as e:
        plan._plan(tables, DeviceTopology(D, mem), "t")
    assert e.value.field == "devices_per_host" and "--devices-per-host 2" in e.value.fix
    assert plan.task_frame(mem, devices_per_host=2)["devices_per_host"].tolist() == [2]
    placed = plan._plan(tables, DeviceTopology.on_hosts(D, mem, 2), "t")
    assert placed.devices.hosts == (0, 0, 1, 1)
    assert sorted(map(repr, placed.shards)) == sorted(map(repr, split_placement.shards))
    with pytest.raises(EmbshardError, match=r"4 devices \(torchrec_plan.json\) do not split into hosts of 3") as e:
        plan.task_frame(mem, devices_per_host=3)
    assert e.value.path is None and e.value.field == "devices_per_host"  # the flag's mistake, not the file's


def test_a_torchrec_plan_with_a_uvm_table_is_refused_not_measured_as_held_in_memory(tmp_path, placement, tables):
    """A team's TorchRec plan put a table in UVM (fused_uvm_caching: rows in host memory behind a cache):
    `evaluate --plan` counted it whole against the device, or measured it as if it were in device memory."""
    from embshard.export.torchrec_plan import plan_to_json, to_torchrec_plan
    from embshard.export.user_plan import UserPlan
    from embshard.types import DeviceTopology

    doc = plan_to_json(to_torchrec_plan(placement), world_size=D)
    topology = DeviceTopology(D, placement.memory_bytes_per_device)
    path = tmp_path / "torchrec_plan.json"
    path.write_text(json.dumps(doc))
    assert UserPlan(str(path))._plan(tables, topology, "t").num_devices == D  # fused: measured
    name = str(tables.table_ids[0])
    doc["modules"][""][name]["compute_kernel"] = "fused_uvm_caching"
    path.write_text(json.dumps(doc))
    with pytest.raises(EmbshardError, match=f"table {name} runs compute kernel 'fused_uvm_caching'") as e:
        UserPlan(str(path))._plan(tables, topology, "t")
    assert e.value.field == "compute_kernel" and "compute_kernels=['fused']" in e.value.fix


def test_a_torchrec_plan_of_a_model_with_two_ebcs_is_measured_as_its_tables(tmp_path, placement, tables):
    """A team's model keeps its weighted features in an EBC of their own (TorchRec's is_weighted is per EBC): its
    plan has two modules, and `evaluate --plan` refused it ("exactly one module")."""
    from embshard.export.torchrec_plan import plan_to_json, to_torchrec_plan
    from embshard.export.user_plan import UserPlan
    from embshard.types import DeviceTopology

    doc = plan_to_json(to_torchrec_plan(placement), world_size=D)
    topology = DeviceTopology(D, placement.memory_bytes_per_device)
    one = tmp_path / "one.json"
    one.write_text(json.dumps(doc))
    names = list(doc["modules"][""])
    doc["modules"] = {"sparse.ebc": {n: doc["modules"][""][n] for n in names[:2]},
                      "sparse.weighted_ebc": {n: doc["modules"][""][n] for n in names[2:]}}
    two = tmp_path / "two.json"
    two.write_text(json.dumps(doc))
    placed = UserPlan(str(two))._plan(tables, topology, "t")
    assert sorted(map(repr, placed.shards)) == sorted(map(repr, UserPlan(str(one))._plan(tables, topology, "t").shards))
    doc["modules"]["sparse.weighted_ebc"][names[0]] = doc["modules"]["sparse.ebc"][names[0]]
    two.write_text(json.dumps(doc))
    with pytest.raises(EmbshardError, match=f"table {names[0]} is in more than one module"):
        UserPlan(str(two))._plan(tables, topology, "t")


def test_a_plan_json_from_inside_out_is_refused_not_rewritten(tmp_path):
    """`export --placements OUT/<task>/plan.json --out OUT` had replaced the (hand-edited) input in place."""
    from embshard.jobs.export import _check_not_inside_out

    plan = tmp_path / "out" / "task-a" / "plan.json"
    plan.parent.mkdir(parents=True)
    plan.write_text("{}")
    with pytest.raises(EmbshardError, match="inside --out") as err:
        _check_not_inside_out(str(plan), str(tmp_path / "out"))
    assert err.value.field == "placements"
    _check_not_inside_out(str(plan), str(tmp_path / "elsewhere"))  # another folder: fine


def test_an_out_that_is_a_dangling_link_is_refused_before_any_work(tmp_path):
    from embshard import storage

    (tmp_path / "dang").symlink_to(tmp_path / "nowhere")
    with pytest.raises(EmbshardError, match="is a link to .*nowhere, which does not exist"):
        storage.check_output(str(tmp_path / "dang"), field="out")


def test_a_probe_folder_a_killed_command_left_is_removed_by_the_next_one(tmp_path):
    import os
    import time

    from embshard import storage

    old, new = tmp_path / ".embshard-probe-old", tmp_path / ".embshard-probe-new"
    old.mkdir()
    new.mkdir()
    stale = time.time() - 2 * storage.PROBE_STALE_S
    os.utime(old, (stale, stale))
    storage.check_output(str(tmp_path / "out"), field="out")
    assert not old.exists() and new.exists()  # a probe of this moment (another command's) is left alone


def test_unnamable_ids_are_listed_with_the_attributes_among_them_and_user_log_levels_kept():
    """With ids items, a.b, keys, ok1, type the list stopped at 3 and the attributes named 'type' outside it; and
    quieting TorchRec's loggers had overwritten a level the user set (INFO became ERROR)."""
    import logging

    from embshard.torchrec_compat import check_names, quiet_torchrec

    ids = ["items", "a.b", "keys", "ok1", "type"] + [f"x.{i}" for i in range(4)]
    with pytest.raises(EmbshardError) as err:
        check_names(ids)
    text = str(err.value)
    assert "table ids ['items', 'a.b', 'keys', 'type', 'x.0', 'x.1'] and 2 more cannot name TorchRec tables" in text
    assert "('items', 'keys', 'type' are nn.ModuleDict attributes)" in text
    mine = logging.getLogger("torchrec.distributed.planner")
    before = mine.level
    try:
        mine.setLevel(logging.INFO)
        quiet_torchrec()
        assert mine.level == logging.INFO
    finally:
        mine.setLevel(before)
