"""`embshard evaluate --plan FILE`: a user's plan file (plan.json of any version, or the exported TorchRec JSON) is
read back as the exact placement for the task, refused in one line when it is not a plan of the task, and measured
beside the planners as `user_plan`."""
from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import numpy as np
import pytest

from embshard import schemas
from embshard.errors import EmbshardError, InfeasiblePlacementError
from embshard.export import write_plan_json
from embshard.export.user_plan import UserPlan
from embshard.ingest.synthetic import generate_tables
from embshard.placement import Placement, Shard
from embshard.tableset import TableSet
from embshard.types import DeviceTopology, Task, row_blocks

D = 4


@pytest.fixture(scope="module")
def tables() -> TableSet:
    df = generate_tables(6, seed=5, bins_batch_size=512)
    df["rows"] = np.minimum(df["rows"], 4000).clip(lower=16)
    df["dim"] = [16, 32, 8, 16, 8, 64]
    df["size_bytes"] = df["rows"] * df["dim"] * df["bytes_per_element"]
    return TableSet.from_frame(schemas.validate(df, "tables"))


@pytest.fixture()
def placement(tables) -> Placement:
    """Every kind: whole, column slices, row-wise over all devices, table-row-wise on host 1, a replica."""
    shards = [Shard(0, 0), Shard(1, 1, 0, 16), Shard(1, 2, 16, 16)]
    shards += [Shard(2, d, row_offset=o, row_size=n) for d, (o, n) in enumerate(row_blocks(int(tables.rows[2]), D))]
    shards += [Shard(3, 2 + d, row_offset=o, row_size=n) for d, (o, n) in enumerate(row_blocks(int(tables.rows[3]), 2))]
    shards += [Shard(4, d, kind="replicated") for d in range(D)] + [Shard(5, 3)]
    mem = int(tables.size_bytes.sum())
    return Placement(tables, D, mem, shards, planner="someone", task_id="task-u",
                     topology=DeviceTopology(D, mem, hosts=(0, 0, 1, 1)))


def _task(tables, memory=None, devices=D, per_host=2) -> Task:
    # The task lists its tables in another order than the plan: the plan is matched by table id. Its hosts are the
    # plan's (2 devices each): a table-row-wise cut is measured only there.
    return Task("task-u", tables.subset(np.arange(len(tables))[::-1]),
                DeviceTopology.on_hosts(devices, int(memory or tables.size_bytes.sum()),
                                        per_host if per_host and devices % per_host == 0 else None))


def _same(a: Placement, b: Placement) -> bool:
    def key(p):
        return sorted((str(p.tables.table_ids[s.table]), s.device, s.kind, s.col_offset, s.col_size, s.row_offset,
                       s.row_size) for s in p.shards)

    return key(a) == key(b)


def test_plan_json_round_trip_is_the_original(tmp_path, placement, tables):
    path = tmp_path / "plan.json"
    write_plan_json(placement, path)
    got = UserPlan(path).plan_task(_task(tables))
    assert _same(got, placement) and got.planner == "user_plan" and got.task_id == "task-u"
    assert got.memory_per_device().max() == placement.memory_per_device().max()
    with pytest.raises(EmbshardError, match="table-row-wise over hosts of 2 devices, task task-u has 4 devices per"):
        UserPlan(path).plan_task(_task(tables, per_host=None))  # the plan records its hosts: measured only there


def test_a_v2_plan_json_is_read(tmp_path, tables):
    p = Placement(tables, D, int(tables.size_bytes.sum()), [Shard(i, i % D) for i in range(len(tables))],
                  task_id="task-u")
    plan = write_plan_json(p, tmp_path / "v3.json")
    plan["schema"] = "embshard.plan/v2"
    for t in plan["tables"]:
        t.pop("sharding_type")
        for s in t["shards"]:
            for k in ("kind", "row_offset", "row_size"):
                s.pop(k)
    (tmp_path / "v2.json").write_text(json.dumps(plan))
    assert _same(UserPlan(tmp_path / "v2.json").plan_task(_task(tables)), p)


def test_exported_torchrec_json_round_trip_is_the_original(tmp_path, placement, tables):
    pytest.importorskip("torchrec")
    from embshard.export.torchrec_plan import plan_to_json, to_torchrec_plan

    doc = plan_to_json(to_torchrec_plan(placement), world_size=D,
                       tables={str(n): (int(r), int(d)) for n, r, d in zip(tables.table_ids, tables.rows, tables.dims)})
    path = tmp_path / "torchrec_plan.json"
    path.write_text(json.dumps(doc))
    assert _same(UserPlan(path).plan_task(_task(tables)), placement)
    # its table-row-wise table (ranks 2-3: one host of 2) is not measured as spread over one host of 4
    with pytest.raises(EmbshardError, match="table-row-wise over hosts of 2 ranks, task task-u has 4 devices per"):
        UserPlan(path).plan_task(_task(tables, per_host=None))


def test_a_plan_that_is_not_the_tasks_is_one_line_naming_the_file(tmp_path, placement, tables):
    path = tmp_path / "plan.json"
    write_plan_json(placement, path)
    other = Task("other", tables.subset(np.arange(1, len(tables))), DeviceTopology(D, int(tables.size_bytes.sum())))
    with pytest.raises(EmbshardError, match=r"plan.json: field 'tables': .*missing|not in the task") as err:
        UserPlan(path).plan_task(other)
    assert "\n" not in str(err.value) and str(tables.table_ids[0]) in str(err.value)
    with pytest.raises(EmbshardError, match="plan.json: field 'num_devices': the plan is for 4 devices"):
        UserPlan(path).plan_task(_task(tables, devices=8))
    small = int(placement.memory_per_device().max()) - 1
    with pytest.raises(InfeasiblePlacementError, match=r"plan.json \(task task-u\).*over its") as err:
        UserPlan(path).plan_task(_task(tables, memory=small))
    assert "fits this task's memory" in str(err.value)
    bad = copy.deepcopy(json.loads(path.read_text()))
    bad["tables"][1]["shards"].pop()
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(EmbshardError, match="bad.json.*columns"):
        UserPlan(tmp_path / "bad.json").plan_task(_task(tables))
    (tmp_path / "other.json").write_text(json.dumps({"schema": "x"}))
    with pytest.raises(EmbshardError, match="neither embshard.plan nor"):
        UserPlan(tmp_path / "other.json").plan_task(_task(tables))


def _edited(tmp_path, placement, name: str, edit) -> str:
    """A plan.json of `placement` changed by `edit` (a function of the JSON document), written as NAME."""
    write_plan_json(placement, tmp_path / "plan.json")
    doc = json.loads((tmp_path / "plan.json").read_text())
    edit(doc)
    (tmp_path / name).write_text(json.dumps(doc))
    return str(tmp_path / name)


def _slices(doc, widths):
    t = doc["tables"][1]  # 32 columns in two slices of 16
    off = 0
    for s, w in zip(t["shards"], widths):
        s["col_offset"], s["col_size"] = off, w
        s["memory_bytes"] = w * t["rows"] * t["bytes_per_element"]
        off += w
    _recount(doc)


def _other_table(doc, **fields):
    """Table 0 (whole on device 0) made another table, its sizes consistent: a plan of other tables."""
    t = doc["tables"][0]
    t.update(fields)
    t["size_bytes"] = t["rows"] * t["dim"] * t["bytes_per_element"]
    t["shards"][0].update(col_size=t["dim"], row_size=t["rows"], memory_bytes=t["size_bytes"])
    _recount(doc)


def _recount(doc):
    for dev in doc["devices"]:  # the devices' memory agrees with their shards again
        dev["memory_bytes"] = sum(s["memory_bytes"] for t in doc["tables"] for s in t["shards"]
                                  if s["device"] == dev["device"])
        dev["memory_used_fraction"] = dev["memory_bytes"] / doc["memory_bytes_per_device"]


@pytest.mark.parametrize("name, edit, match", [
    ("not4.json", lambda d: _slices(d, [14, 18]), r"field 'col_size': table \S+: a column slice of 14 columns"),
    ("rows.json", lambda d: _other_table(d, rows=7), r"field 'tables.0.rows': .*plan's rows is 7"),
    ("bpe.json", lambda d: _other_table(d, bytes_per_element=2), "field 'tables.0.bytes_per_element'"),
    ("nan.json", lambda d: d["tables"][2].update(pooling_factor=float("nan")),
     "field 'tables.2.pooling_factor': not a finite number"),
    ("huge.json", lambda d: d.update(memory_bytes_per_device=10**30),
     "field 'memory_bytes_per_device': .*greater than the maximum"),
    ("relabelled.json", lambda d: d.update(schema="embshard.torchrec_plan/v1"), "field 'modules'"),
])
def test_a_plan_of_other_tables_or_unrunnable_is_one_line_before_measuring(tmp_path, placement, tables, name, edit,
                                                                           match):
    """Refused as plans of other tables, widths FBGEMM and TorchRec cannot run, numbers out of range, and a plan
    labelled a TorchRec plan: each one line naming the file and the field (they used to be measured, or crash
    mid-measurement)."""
    path = _edited(tmp_path, placement, name, edit)
    with pytest.raises(EmbshardError, match=f"{name}.*{match}") as err:
        UserPlan(path).plan_task(_task(tables))
    assert "\n" not in str(err.value)


def test_a_torchrec_plan_with_a_bad_world_size_or_a_folder_is_one_line(tmp_path, placement, tables):
    pytest.importorskip("torchrec")
    from embshard.export.torchrec_plan import plan_to_json, to_torchrec_plan

    doc = plan_to_json(to_torchrec_plan(placement), world_size=D,
                       tables={str(n): (int(r), int(d)) for n, r, d in zip(tables.table_ids, tables.rows, tables.dims)})
    for world in ("two", [2], True):
        (tmp_path / "w.json").write_text(json.dumps({**doc, "world_size": world}))
        with pytest.raises(EmbshardError, match="w.json: field 'world_size'"):
            UserPlan(tmp_path / "w.json").plan_task(_task(tables))
    with pytest.raises(EmbshardError, match="field 'plan': is a folder, not a file"):
        UserPlan(tmp_path).plan_task(_task(tables))
    (tmp_path / "placements.parquet").write_bytes(b"PAR1....PAR1")  # a placements file given as the plan
    with pytest.raises(EmbshardError, match="a Parquet file .*, not a plan file .*embshard export --placements"):
        UserPlan(tmp_path / "placements.parquet").plan_task(_task(tables))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Six small tables, one test task of 3 tables on 2 devices, and a size_greedy plan of it."""
    from embshard.jobs import tasks
    from embshard.planners.baselines import make_baseline
    from embshard.types import load_tasks

    root = tmp_path_factory.mktemp("tiny")
    df = generate_tables(6, seed=2, bins_batch_size=512)
    df["rows"] = np.minimum(df["rows"], 2000).clip(lower=16)
    df["size_bytes"] = df["rows"] * df["dim"] * df["bytes_per_element"]
    tables = str(root / "tables.parquet")
    schemas.write(df, tables, "tables")
    tasks_path = tasks.run(tables, str(root), num_tasks=1, tables_per_task=3, devices=2, memory_gb=1, seed=0)
    task = load_tasks(tables, tasks_path, "test")[0]
    plan = str(root / "plan.json")
    write_plan_json(make_baseline("round_robin").plan_task(task), plan)
    return {"tables": tables, "tasks": tasks_path, "plan": plan, "task": task, "root": root}


def test_a_plan_json_whose_num_devices_exceeds_its_devices_is_said(tiny, tmp_path, caplog):
    """num_devices typed larger than the devices a plan.json uses was measured without a word (its all-to-all
    priced for the larger world, the planners planning it), where a TorchRec plan's idle ranks are said."""
    doc = json.loads(Path(tiny["plan"]).read_text())
    used = 1 + max(s["device"] for t in doc["tables"] for s in t["shards"])
    with caplog.at_level("WARNING"):
        UserPlan(tiny["plan"]).task_frame()
    assert "idle" not in caplog.text  # its own world: nothing said
    doc["num_devices"] = used + 3
    doc.pop("devices", None)  # derived again from the shards (a hand-written plan leaves them out)
    wide = tmp_path / "wide.json"
    wide.write_text(json.dumps(doc))
    caplog.clear()
    with caplog.at_level("WARNING"):
        frame = UserPlan(str(wide)).task_frame()
    assert frame["num_devices"].tolist() == [used + 3]
    assert (f"the plan's num_devices is {used + 3}, its tables are on devices 0-{used - 1} only: it is measured on "
            f"{used + 3} devices, 3 of them idle") in caplog.text


def test_evaluate_measures_the_plan_beside_the_planners(tiny, tmp_path, capsys):
    import pandas as pd

    from embshard.cli import main

    out = tmp_path / "ev"
    assert main(["evaluate", "--tables", tiny["tables"], "--tasks", tiny["tasks"], "--planners", "size_greedy",
                 "--plan", tiny["plan"], "--rounds", "2", "--batch-size", "32", "--out", str(out)]) == 0
    # stderr is no terminal here (a log): the progress bar comes as lines, not carriage-return redraws
    captured = capsys.readouterr()
    assert "evaluate (measured rounds)" in captured.err and "\r" not in captured.err
    ev = pd.read_parquet(out / "evaluation.parquet")
    # the user's plan twice: the ruler's A/A floor of this very run (a 0.93 had read "faster" inside [0.89, 1.04])
    assert list(ev["planner"]) == ["size_greedy", "user_plan", "user_plan#2"]
    row = ev[ev["planner"] == "user_plan"].iloc[0]
    assert row["feasible"] and row["measured_cost_ms"] > 0
    # The question --plan asks, answered paired per round: each planner over the user's plan, with its interval.
    greedy = ev[ev["planner"] == "size_greedy"].iloc[0]
    want = np.exp(np.median(np.log(np.array(greedy["round_costs_ms"]) / np.array(row["round_costs_ms"]))))
    assert greedy["ratio_to_user_plan"] == pytest.approx(want)  # the ruler's median (of logs) of paired rounds
    assert greedy["ratio_user_plan_ci_low"] <= greedy["ratio_to_user_plan"] <= greedy["ratio_user_plan_ci_high"]
    ratios = pd.read_parquet(out / "ratios.parquet")
    assert len(ratios[(ratios["planner"] == "size_greedy") & (ratios["versus"] == "user_plan")]) == 1
    assert f"size_greedy: {greedy['ratio_to_user_plan']:.3f} [" in captured.out
    assert "against your plan (user_plan), paired over 2 round(s)" in captured.out
    assert "the ruler's A/A floor, user_plan against itself: [" in captured.out and "user_plan#2:" not in captured.out
    assert "no verdict from 2 rounds (--rounds 5 or more)" in captured.out  # a 2-round range misses half the time
    # what the answer holds for: this hardware, this batch (a CPU answer had carried no label)
    assert f"measured on {row['measured_on']}, batch 32: it holds for this hardware" in captured.out
    # A planner named twice: its A/A floor is said and judged against (the repeat itself is no answer).
    assert main(["evaluate", "--tables", tiny["tables"], "--tasks", tiny["tasks"], "--planners",
                 "size_greedy,size_greedy", "--plan", tiny["plan"], "--rounds", "2", "--batch-size", "32",
                 "--out", str(tmp_path / "aa")]) == 0
    printed = capsys.readouterr().out
    assert "the ruler's A/A floor, size_greedy against itself: [" in printed and "size_greedy#2:" not in printed
    assert list(pd.read_parquet(tmp_path / "aa" / "evaluation.parquet")["planner"]) == [
        "size_greedy", "size_greedy#2", "user_plan"]  # a floor already: the plan is measured once
    placed = pd.read_parquet(out / "placements.parquet")
    assert set(placed[placed["planner"] == "user_plan"]["table_id"]) == set(tiny["task"].tables.table_ids)


def test_the_answer_to_a_users_plan_gives_a_verdict_only_from_enough_rounds():
    """Below 5 rounds the interval is the rounds' range (it misses the median a quarter to half of the time) and
    one round has none: the ratio is printed, the verdict is not (a user read 'faster' off 2 rounds, and 'not
    measured' off a measured round)."""
    import pandas as pd

    from embshard.jobs.evaluate import _against_user_plan

    def summary(lo, hi):
        return pd.DataFrame({"median_ratio_user_plan": [0.8, 1.0], "user_plan_ci_low": [lo, np.nan],
                             "user_plan_ci_high": [hi, np.nan]}, index=["size_greedy", "user_plan"])

    assert "size_greedy: 0.800 [0.700, 0.900] faster" in _against_user_plan(summary(0.7, 0.9), 5)
    assert "size_greedy: 0.800 [0.700, 0.900] no verdict from 2 rounds (--rounds 5 or more)" in \
        _against_user_plan(summary(0.7, 0.9), 2)
    one = _against_user_plan(summary(np.nan, np.nan), 1)
    assert "size_greedy: 0.800 [no interval] no verdict from 1 round (" in one and "not measured" not in one
    # with the plan measured twice in one round, its A/A floor has no interval: said, not printed as [nan, nan]
    repeated = pd.concat([summary(np.nan, np.nan), pd.DataFrame({"median_ratio_user_plan": [1.0]},
                                                                index=["user_plan#2"])])
    ratios = pd.DataFrame([{"task_id": "t", "planner": "user_plan#2", "versus": "user_plan", "median_ratio": 1.0,
                            "ci_low": np.nan, "ci_high": np.nan, "rounds": 1, "round_ratios": [1.0]}])
    one = _against_user_plan(repeated, 1, ratios)
    assert "no A/A floor from 1 round" in one and "nan" not in one.split(":")[0], one


def test_no_difference_says_what_it_did_not_clear_and_a_wide_floor_is_said():
    """'no difference' had read the same for [0.85, 1.15] and for [1.108, 1.902] (clear of 1, inside a wide floor),
    and a floor of [0.668, 1.597] was printed without a word on what it hides."""
    import pandas as pd

    from embshard.jobs.evaluate import _against_user_plan

    summary = pd.DataFrame({"median_ratio_user_plan": [1.37, 0.95, 1.0, 1.0],
                            "user_plan_ci_low": [1.108, 0.85, np.nan, np.nan],
                            "user_plan_ci_high": [1.902, 1.15, np.nan, np.nan]},
                           index=["size_lookup_greedy", "learned", "user_plan", "user_plan#2"])
    def floor(rounds):  # the plan against itself, per round (the floor: [0.65, 2.0] and [0.98, 1.02] here)
        return pd.DataFrame([{"task_id": "t", "planner": "user_plan#2", "versus": "user_plan", "median_ratio": 1.0,
                              "rounds": len(rounds), "round_ratios": rounds}])

    text = _against_user_plan(summary, 7, floor([0.6, 0.7, 1.0, 1.5, 2.0, 2.1, 0.65]))
    assert "size_lookup_greedy: 1.370 [1.108, 1.902] no difference: its interval clears 1 but not the A/A floor" \
        in text
    assert "learned: 0.950 [0.850, 1.150] no difference: its interval holds 1" in text
    assert "the A/A floor is wide (1.35): this machine's noise hides differences smaller than that" in text
    narrow = _against_user_plan(summary, 5, floor([0.99, 1.0, 1.01, 0.98, 1.02]))
    assert "is wide" not in narrow and "size_lookup_greedy: 1.370 [1.108, 1.902] slower" in narrow


def test_evaluate_refuses_a_plan_of_another_task_before_measuring(tiny, tmp_path, capsys):
    from pathlib import Path

    from embshard.cli import main

    plan = json.loads(Path(tiny["plan"]).read_text())
    plan["num_devices"] = 3
    plan["devices"].append({"device": 2, "memory_bytes": 0, "memory_used_fraction": 0.0, "predicted_cost_ms": None,
                            "tables": []})
    bad = tmp_path / "three.json"
    bad.write_text(json.dumps(plan))
    out = tmp_path / "ev"
    assert main(["evaluate", "--tables", tiny["tables"], "--tasks", tiny["tasks"], "--planners", "size_greedy",
                 "--plan", str(bad), "--rounds", "1", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "three.json" in err[0] and "3 devices" in err[0]
    assert not out.exists()


def test_evaluate_without_a_tasks_file_measures_the_plan_on_its_own_task(tiny, tmp_path, capsys):
    """A team's question (is our plan better than yours?) needs no tasks file: the plan.json's tables, devices and
    memory make the task. With a tasks file, the plan's own task_id picks its task; --task-id picks another;
    without --plan and --tasks there is nothing to evaluate."""
    import pandas as pd

    from embshard.cli import main

    common = ["--planners", "size_greedy", "--rounds", "1", "--batch-size", "32"]
    out = tmp_path / "own"
    assert main(["evaluate", "--tables", tiny["tables"], "--plan", tiny["plan"], *common, "--out", str(out)]) == 0
    ev = pd.read_parquet(out / "evaluation.parquet")
    assert set(ev["task_id"]) == {tiny["task"].task_id} and list(ev["planner"]) == ["size_greedy", "user_plan",
                                                                                   "user_plan#2"]
    # Two tasks in the file: the plan's own is evaluated (the other has other tables), and said so.
    from embshard.jobs import tasks

    two = tasks.run(tiny["tables"], str(tmp_path / "two"), num_tasks=2, tables_per_task=3, devices=2, memory_gb=1,
                    seed=0)
    assert main(["evaluate", "--tables", tiny["tables"], "--tasks", two, "--plan", tiny["plan"], *common,
                 "--out", str(tmp_path / "picked")]) == 0
    assert f"evaluating task {tiny['task'].task_id}" in capsys.readouterr().out
    assert set(pd.read_parquet(tmp_path / "picked" / "evaluation.parquet")["task_id"]) == {tiny["task"].task_id}
    assert main(["evaluate", "--tables", tiny["tables"], "--tasks", two, "--task-id", "nope", *common,
                 "--out", str(tmp_path / "x")]) == 2
    assert "no task 'nope'" in capsys.readouterr().err
    assert main(["evaluate", "--tables", tiny["tables"], *common, "--out", str(tmp_path / "y")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no tasks to evaluate" in err[0] and "--plan FILE" in err[0]


def test_evaluate_of_a_plan_on_other_tables_names_the_plan_not_a_scratch_file(tiny, tmp_path, capsys):
    """Without --tasks the plan's own task is written to a scratch folder; a plan of tables that --tables does not
    hold named that scratch tasks.parquet."""
    from embshard.cli import main

    other = generate_tables(4, seed=9, bins_batch_size=512)
    other["table_id"] = [f"other_{i}" for i in range(4)]
    others = str(tmp_path / "others.parquet")
    schemas.write(other, others, "tables")
    out = tmp_path / "ev"
    assert main(["evaluate", "--tables", others, "--plan", tiny["plan"], "--planners", "size_greedy", "--rounds", "1",
                 "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "embshard-evaluate-" not in err[0], err
    assert tiny["plan"] in err[0] and "unknown table ids" in err[0] and "give --tables the tables" in err[0], err
    assert not out.exists()


def test_evaluate_of_a_plan_that_leaves_out_a_table_of_the_spec_is_refused(tiny, tmp_path, capsys):
    """A spec lists the model's tables: a plan that leaves one out is not a plan of that model. Without --tasks it
    had been measured on the tables it places, and its ratio read as the model's (export refuses the same)."""
    from embshard.cli import main

    with open(tiny["plan"], encoding="utf-8") as f:
        plan = json.load(f)
    names = [t["table_id"] for t in plan["tables"]]
    spec = tmp_path / "model.csv"
    spec.write_text("name,num_embeddings,embedding_dim,pooling_factor\n"
                    + "".join(f"{n},{r},{d},{p}\n" for n, r, d, p in zip(
                        names, [t["rows"] for t in plan["tables"]], [t["dim"] for t in plan["tables"]],
                        tiny["task"].tables.pooling_factor))
                    + "geo,500,8,1.0\n")
    out = tmp_path / "ev"
    assert main(["evaluate", "--tables", str(spec), "--plan", tiny["plan"], "--planners", "size_greedy",
                 "--rounds", "1", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "1 table(s) of the spec" in err[0] and "not placed by the plan (geo)" in err[0], err
    assert tiny["plan"] in err[0] and not out.exists()


def test_a_plan_that_misses_a_few_tables_of_a_tables_file_is_said(tiny, tmp_path, caplog):
    """A tables.parquet may be a run's pool (a task's plan of some of its tables is normal), so a plan that leaves
    tables out is not refused; but a plan of 3 of a file's 4 tables had been measured and exported as 3 tables
    with nothing said. Now evaluate and export name the tables not placed; a task of a pool is not said."""
    import pandas as pd

    from embshard.cli import main

    pool = pd.read_parquet(tiny["tables"])
    own = list(tiny["task"].tables.table_ids)
    extra = next(t for t in pool["table_id"] if t not in own)
    four = str(tmp_path / "four.parquet")
    schemas.write(pool[pool["table_id"].isin(own + [extra])].reset_index(drop=True), four, "tables")
    assert main(["evaluate", "--tables", four, "--plan", tiny["plan"], "--planners", "size_greedy", "--rounds", "1",
                 "--batch-size", "32", "--out", str(tmp_path / "ev")]) == 0
    said = [r.getMessage() for r in caplog.records if "not placed" in r.getMessage()]
    assert len(said) == 1 and f"the plan places 3 of the 4 tables of {four} (not placed: {extra})" in said[0], said
    assert "only the plan's tables are measured" in said[0] and "fix:" in said[0]
    caplog.clear()
    assert main(["export", "--placements", tiny["plan"], "--tables", four, "--no-torchrec",
                 "--out", str(tmp_path / "ex")]) == 0
    assert [r.getMessage() for r in caplog.records if f"not placed: {extra}" in r.getMessage()]
    caplog.clear()
    assert main(["export", "--placements", tiny["plan"], "--tables", tiny["tables"], "--no-torchrec",
                 "--out", str(tmp_path / "ex2")]) == 0  # 3 of a pool of 6: a task's plan, nothing said
    assert not [r for r in caplog.records if "not placed" in r.getMessage()]


def test_a_plan_written_by_hand_needs_only_its_tables_and_shards(tiny, tmp_path, capsys):
    """What a team asks first (is our layout better?) starts from a plan.json they write themselves: the task, the
    devices and each table's shards are enough; what derives from them (kinds, sizes, devices[], sharding types,
    cost, provenance) is filled in, and a contradiction in what is given is still refused."""
    import pandas as pd

    from embshard.cli import main
    from embshard.export.plan_json import HAND_WRITTEN, read_plan_json

    t = tiny["task"].tables
    first = t.table_ids[0]
    tables = []
    for k, name in enumerate(t.table_ids):
        rows, dim = int(t.rows[k]), int(t.dims[k])
        shards = ([{"device": 0, "col_offset": 0, "col_size": dim // 2},
                   {"device": 1, "col_offset": dim // 2, "col_size": dim - dim // 2}] if name == first
                  else [{"device": k % 2}])
        tables.append({"table_id": str(name), "rows": rows, "dim": dim,
                       "bytes_per_element": int(t.bytes_per_element[k]), "pooling_factor": float(t.pooling_factor[k]),
                       "shards": shards})
    doc = {"schema": "embshard.plan/v3", "task_id": "ours", "num_devices": 2,
           "memory_bytes_per_device": int(tiny["task"].memory_bytes_per_device), "tables": tables}
    mine = tmp_path / "ours.json"
    mine.write_text(json.dumps(doc))
    plan = read_plan_json(mine)
    assert plan["planner"] == HAND_WRITTEN and len(plan["devices"]) == 2
    assert plan["tables"][0]["sharding_type"] == "column_wise" and plan["tables"][1]["sharding_type"] == "table_wise"
    out = tmp_path / "ev"
    assert main(["evaluate", "--tables", tiny["tables"], "--plan", str(mine), "--planners", "size_greedy",
                 "--rounds", "2", "--batch-size", "32", "--out", str(out)]) == 0
    ev = pd.read_parquet(out / "evaluation.parquet")
    assert ev.set_index("planner").loc["user_plan", "feasible"]
    doc["tables"][1]["shards"][0]["device"] = 5  # a device the task does not have: one line, as before
    mine.write_text(json.dumps(doc))
    capsys.readouterr()
    assert main(["evaluate", "--tables", tiny["tables"], "--plan", str(mine), "--planners", "size_greedy",
                 "--rounds", "2", "--out", str(tmp_path / "ev2")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "device 5 >= num_devices 2" in err[0], err
    # A wrong value in what a person writes is named, not a field derived from it (it had said "'planner' is a
    # required property" for a word as col_size, and a negative devices[].memory_used_fraction for row_size -3).
    doc["tables"][1]["shards"][0]["device"] = 1
    for field, value, words in (("col_size", "sixty-four", "'sixty-four' is not of type 'integer'"),
                                ("row_size", -3, "-3 is less than the minimum"),
                                ("device", 1.0, "1.0 is not of type 'integer'")):
        bad = json.loads(json.dumps(doc))
        bad["tables"][0]["shards"][0][field] = value
        mine.write_text(json.dumps(bad))
        with pytest.raises(EmbshardError, match=f"field 'tables.0.shards.0.{field}': {words}"):
            read_plan_json(mine)
    # Slices or ranges past the table are named as such (both had said "a table needs its sharding_type"), a
    # table without shards names its shards (it had said "'planner' is a required property"), and a num_devices the
    # schema refuses is refused at once (10**7 had built ten million device entries first: minutes, gigabytes).
    dim, rows = int(t.dims[0]), int(t.rows[0])
    for edit, words in (
            (lambda b: b["tables"][0]["shards"][1].update(col_size=dim), f"shards cover {dim + dim // 2} of {dim} "
                                                                         "columns"),
            (lambda b: b["tables"][0].update(shards=[{"device": 0, "row_offset": rows // 2, "row_size": rows},
                                                     {"device": 1, "row_offset": 0, "row_size": rows // 2}]),
             f"shards cover {rows + rows // 2} of {rows} rows"),
            (lambda b: b["tables"][1].pop("shards"), "field 'tables.1.shards': 'shards' is a required property"),
            (lambda b: b.update(num_devices=10**9), "field 'num_devices': 1000000000 is greater than the maximum")):
        bad = json.loads(json.dumps(doc))
        edit(bad)
        mine.write_text(json.dumps(bad))
        with pytest.raises(EmbshardError) as err:
            read_plan_json(mine)
        assert words in str(err.value) and "sharding_type" not in str(err.value), str(err.value)


def test_a_hand_written_plan_exports_as_hand_written(tiny, tmp_path):
    """A TorchRec team's session (twenty-seventh): an exported hand-written plan kept no record of being one (the
    export's time and code were written as when and by what it was made); a v2 file written by hand was told only
    that 'planner' is required; a shard moved by hand was told to redo devices[]'s bytes, not to leave it out."""
    from embshard.cli import main
    from embshard.export.plan_json import read_plan_json

    t = tiny["task"].tables
    tables = [{"table_id": str(name), "rows": int(t.rows[k]), "dim": int(t.dims[k]),
               "bytes_per_element": int(t.bytes_per_element[k]), "pooling_factor": float(t.pooling_factor[k]),
               "shards": [{"device": k % 2}]} for k, name in enumerate(t.table_ids)]
    doc = {"schema": "embshard.plan/v3", "task_id": "ours", "num_devices": 2,
           "memory_bytes_per_device": int(tiny["task"].memory_bytes_per_device), "tables": tables}
    mine = tmp_path / "ours.json"
    mine.write_text(json.dumps(doc))
    assert main(["export", "--placements", str(mine), "--tables", tiny["tables"], "--no-torchrec",
                 "--out", str(tmp_path / "exp")]) == 0
    out = read_plan_json(tmp_path / "exp" / "ours" / "plan.json")
    assert (out["created_at"], out["embshard_version"], out["planner"]) == ("not recorded", "", "hand-written")
    v2 = dict(doc, schema="embshard.plan/v2")
    mine.write_text(json.dumps(v2))
    with pytest.raises(EmbshardError, match=r"of embshard.plan/v2 plans \(only embshard.plan/v3 fills in"):
        read_plan_json(mine)
    moved = read_plan_json(tmp_path / "exp" / "ours" / "plan.json")
    moved["tables"][0]["shards"][0]["device"] = 1 - moved["tables"][0]["shards"][0]["device"]
    mine.write_text(json.dumps(moved))
    with pytest.raises(EmbshardError, match=r"leave devices\[\] and cost out of the plan"):
        read_plan_json(mine)
    for key in ("devices", "cost"):  # as the fix says: derived again
        moved.pop(key)
    mine.write_text(json.dumps(moved))
    assert read_plan_json(mine)["devices"][1 - tables[0]["shards"][0]["device"]]["tables"][0] == tables[0]["table_id"]


def test_a_plan_measured_on_other_traffic_says_so(tiny, caplog):
    """evaluate --plan measures a plan on the tables given even when their pooling is not what the plan was made
    for (how does our old layout do on today's traffic?), with one warning naming the table (export refuses)."""
    import logging
    from dataclasses import replace

    task = tiny["task"]
    busier = replace(task, tables=replace(task.tables, pooling_factor=task.tables.pooling_factor * 3))
    with caplog.at_level(logging.WARNING, logger="embshard.export.user_plan"):
        plan = UserPlan(tiny["plan"])
        plan.check_tasks([busier])  # evaluate checks every task first, then plans it: one warning, not two
        plan.plan_task(busier)
    lines = [r.getMessage() for r in caplog.records if "other traffic" in r.getMessage()]
    assert len(lines) == 1 and f"table {task.tables.table_ids[0]} and 2 more" in lines[0], lines
    assert "`embshard export` refuses it with these tables" in lines[0]  # it had exited 0, then export refused
    caplog.clear()
    UserPlan(tiny["plan"]).plan_task(task)
    assert not [r for r in caplog.records if "other traffic" in r.getMessage()]


def test_evaluate_of_a_torchrec_plan_without_tasks_takes_its_memory_from_memory_gb(tiny, tmp_path, capsys):
    """A team's TorchRec plan records no memory per device: `--memory-gb` makes its task (its tables, its world
    size); without it, or beside --tasks, one line says what to give."""
    pytest.importorskip("torchrec")
    import pandas as pd

    from embshard.cli import main
    from embshard.export.torchrec_plan import plan_to_json, to_torchrec_plan
    from embshard.planners.baselines import make_baseline

    task = tiny["task"]
    t = task.tables
    doc = plan_to_json(to_torchrec_plan(make_baseline("size_greedy").plan_task(task)), world_size=task.num_devices,
                       tables={str(n): (int(r), int(d)) for n, r, d in zip(t.table_ids, t.rows, t.dims)})
    plan = tmp_path / "team plan (1).json"  # a name that is no id: the task is named after it, made one
    plan.write_text(json.dumps(doc))
    common = ["--tables", tiny["tables"], "--plan", str(plan), "--planners", "round_robin", "--rounds", "1",
              "--batch-size", "32"]
    assert main(["evaluate", *common, "--out", str(tmp_path / "no-mem")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "records no memory per device" in err[0] and "--memory-gb" in err[0]
    assert main(["evaluate", *common, "--tasks", tiny["tasks"], "--memory-gb", "1",
                 "--out", str(tmp_path / "both")]) == 2
    assert "--memory-gb sizes the task of --plan" in capsys.readouterr().err
    assert main(["evaluate", *common, "--memory-gb", "1", "--out", str(tmp_path / "ev")]) == 0
    ev = pd.read_parquet(tmp_path / "ev" / "evaluation.parquet")
    assert list(ev["planner"]) == ["round_robin", "user_plan", "user_plan#2"] and ev["feasible"].all()
    assert set(ev["memory_bytes_per_device"]) == {2**30} and set(ev["num_devices"]) == {task.num_devices}
    assert set(ev["batch_size"]) == {32}  # the batch measured, recorded beside the costs
    assert set(ev["task_id"]) == {"team_plan__1_"}
    assert "round_robin: " in capsys.readouterr().out
    # its hosts (a TorchRec plan records none): --devices-per-host lays the task out, as place and export take it
    from embshard.export.user_plan import UserPlan

    frame = UserPlan(str(plan)).task_frame(2**30, devices_per_host=1)
    assert frame["devices_per_host"].tolist() == [1] and frame["num_devices"].tolist() == [task.num_devices]
    assert "devices_per_host" not in UserPlan(str(plan)).task_frame(2**30, devices_per_host=task.num_devices)
    assert main(["evaluate", *common, "--memory-gb", "1", "--devices-per-host", "1", "--rounds", "1",
                 "--out", str(tmp_path / "hosts")]) == 0
    capsys.readouterr()
    for extra, words in ((["--memory-gb", "1", "--devices-per-host", "3"], "do not split into hosts of 3"),
                         (["--tasks", tiny["tasks"], "--devices-per-host", "1"], "--tasks has its own hosts")):
        assert main(["evaluate", *common, *extra, "--out", str(tmp_path / "bad")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and words in err[0] and "devices_per_host" in err[0], err
    # a plan.json records its hosts (one here): another layout is refused, not measured as if planned for it
    assert main(["evaluate", "--tables", tiny["tables"], "--plan", tiny["plan"], "--planners", "round_robin",
                 "--devices-per-host", "1", "--out", str(tmp_path / "bad")]) == 2
    assert "records 2 devices per host, not 1" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()


def test_hostile_plan_files_are_one_line_before_anything_is_read_or_written(tiny, tmp_path, capsys):
    """From an adversarial pass over the plan readers: a task_id holding a path made `export` write plan files
    outside --out (over another folder's plan.json); a FIFO blocked `evaluate --plan` past its timeout; 4.0 for an
    integer and deeply nested JSON ended in tracebacks. Each is now one line, exit 2, nothing written."""
    import os
    from pathlib import Path

    from embshard.cli import main

    doc = json.loads(Path(tiny["plan"]).read_text())
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "plan.json").write_text("ORIGINAL")
    cases = {
        "traversal.json": {**doc, "task_id": "../victim"},
        "absolute.json": {**doc, "task_id": str(victim)},
        "float.json": {**doc, "num_devices": float(doc["num_devices"])},
        "device_float.json": {**doc, "tables": [{**doc["tables"][0], "shards": [
            {**s, "device": float(s["device"])} for s in doc["tables"][0]["shards"]]}, *doc["tables"][1:]]},
        "hosts.json": {**doc, "hosts": list(range(doc["num_devices"]))[::-1]},  # [1, 0]: hosts not in rank order
        # derived fields that contradict what they derive from
        "fraction.json": {**doc, "devices": [{**doc["devices"][0], "memory_used_fraction": 0.5}, *doc["devices"][1:]]},
        "overall.json": {**doc, "cost": {**doc["cost"], "device_costs_ms": [2.0] * doc["num_devices"],
                                         "overall_ms": 0.001}},
    }
    for name, bad in cases.items():
        (tmp_path / name).write_text(json.dumps(bad))
    (tmp_path / "nested.json").write_text('{"schema": "embshard.plan/v3", "meta": ' + "[" * 200_000 + "]" * 200_000
                                          + "}")
    os.mkfifo(tmp_path / "fifo.json")
    want = {"traversal.json": "is not an id", "absolute.json": "is not an id", "float.json": "not of type 'integer'",
            "device_float.json": "not of type 'integer'", "nested.json": "nested too deeply",
            "fifo.json": "FIFO", "hosts.json": "not TorchRec's rank order",
            "fraction.json": "memory_used_fraction 0.5 but its shards fill", "overall.json": "overall_ms 0.001 but"}
    for name, words in want.items():
        path = str(tmp_path / name)
        for argv in (["evaluate", "--tables", tiny["tables"], "--plan", path, "--planners", "round_robin",
                      "--rounds", "1", "--out", str(tmp_path / "ev" / name)],
                     ["export", "--placements", path, "--tables", tiny["tables"],
                      "--out", str(tmp_path / "out" / name)]):
            assert main(argv) == 2, (name, argv[0])
            err = capsys.readouterr().err.strip().splitlines()
            assert len(err) == 1 and words in err[0] and name in err[0], (name, argv[0], err)
    assert (victim / "plan.json").read_text() == "ORIGINAL" and sorted(os.listdir(victim)) == ["plan.json"]
    # The schema's id pattern is checks.ID_PATTERN, and an id is matched whole (a trailing newline is no id).
    from embshard.checks import ID_PATTERN
    from embshard.export.plan_json import json_schema, read_plan_json

    schema = json_schema()
    assert schema["properties"]["task_id"]["pattern"] == ID_PATTERN
    assert schema["properties"]["tables"]["items"]["properties"]["table_id"]["pattern"] == ID_PATTERN
    (tmp_path / "newline.json").write_text(json.dumps({**doc, "task_id": "t0\n"}))
    with pytest.raises(EmbshardError, match=re.escape(f"field 'task_id': {'t0' + chr(10)!r} is not an id")):
        read_plan_json(tmp_path / "newline.json")
    assert not (tmp_path / "ev").exists() and not (tmp_path / "out").exists()


def test_evaluate_says_why_a_planner_could_not_place_a_task(tiny, tmp_path, capsys):
    """`failed` in the summary counts the tasks a planner could not place; the reason (a good one-line error) was
    only in evaluation.parquet: each is printed under the summary."""
    pytest.importorskip("torchrec")
    import pandas as pd

    from embshard.cli import main
    from embshard.types import load_tasks

    t = tiny["task"].tables
    largest = int(t.size_bytes.max())
    tasks = pd.DataFrame([{"task_id": "tight", "split": "test", "num_devices": 2,
                           "memory_bytes_per_device": int(largest * 0.75), "table_ids": list(t.table_ids)}])
    path = tmp_path / "tasks.parquet"
    schemas.write(tasks, path, "tasks")
    assert load_tasks(tiny["tables"], str(path), "test")[0].num_devices == 2
    assert main(["evaluate", "--tables", tiny["tables"], "--tasks", str(path), "--planners",
                 "dim_greedy,torchrec_table_wise", "--rounds", "1", "--batch-size", "32",
                 "--out", str(tmp_path / "ev")]) == 0
    out = capsys.readouterr().out
    ev = pd.read_parquet(tmp_path / "ev" / "evaluation.parquet").set_index("planner")
    assert ev.loc["dim_greedy", "feasible"] and not ev.loc["torchrec_table_wise", "feasible"]
    assert f"torchrec_table_wise could not place task tight: {ev.loc['torchrec_table_wise', 'error']}" in out


def test_the_evaluation_plot_shows_bars_against_the_users_plan_without_a_greedy_baseline():
    """`evaluate --plan ... --planners learned,torchrec_full` drew an empty main panel: its bars were ratios to a
    best greedy baseline that was not run (NaN, drawn as 0)."""
    import pandas as pd

    from embshard.evaluation import bar_reference

    df = pd.DataFrame({"planner": ["torchrec_full", "user_plan"], "task_id": ["t", "t"],
                       "ratio_to_best_baseline": [np.nan, np.nan], "ratio_to_user_plan": [1.2, np.nan],
                       "measured_cost_ms": [1.2, 1.0]})
    assert bar_reference(df)[0] == "ratio_to_user_plan" and "user_plan" in bar_reference(df)[3]
    assert bar_reference(df.assign(ratio_to_best_baseline=[0.9, 1.0]))[0] == "ratio_to_best_baseline"
    assert bar_reference(df.drop(columns="ratio_to_user_plan"))[0] == "measured_cost_ms"


def test_a_team_plans_odd_files_are_read_or_named(tiny, tmp_path, capsys, caplog):
    """From a team's pass with `evaluate --plan`: a TorchRec JSON written without world_size (plan_to_json allows
    it) had been a KeyError traceback; a world larger than the plan's ranks was measured without a word; a pickled
    torchrec_plan.pt read 'not valid JSON'; hosts of unequal size (0, 0, 0, 1) were accepted and measured on other
    hosts; the A/A repeat's rows in placements.parquet carried the entry's name without its #2."""
    pytest.importorskip("torchrec")
    import pandas as pd
    import torch

    from embshard.cli import main
    from embshard.export.torchrec_plan import plan_to_json, to_torchrec_plan
    from embshard.planners.baselines import make_baseline

    task = tiny["task"]
    t = task.tables
    shapes = {str(n): (int(r), int(d)) for n, r, d in zip(t.table_ids, t.rows, t.dims)}
    sharding = to_torchrec_plan(make_baseline("size_greedy").plan_task(task))
    no_world = tmp_path / "no_world.json"
    no_world.write_text(json.dumps(plan_to_json(sharding, tables=shapes)))
    assert UserPlan(str(no_world)).world_size() == 1 + max(
        r for p in json.loads(no_world.read_text())["modules"][""].values() for r in p["ranks"])
    common = ["--tables", tiny["tables"], "--planners", "round_robin", "--rounds", "1", "--batch-size", "32",
              "--memory-gb", "1"]
    assert main(["evaluate", *common, "--plan", str(no_world), "--out", str(tmp_path / "nw")]) == 0
    wide = tmp_path / "wide.json"
    wide.write_text(json.dumps(plan_to_json(sharding, world_size=task.num_devices + 2, tables=shapes)))
    with caplog.at_level("WARNING"):
        frame = UserPlan(str(wide)).task_frame(2**30)
    assert frame["num_devices"].tolist() == [task.num_devices + 2] and "2 of them idle" in caplog.text
    pickled = tmp_path / "torchrec_plan.pt"
    torch.save({"plan": 1}, pickled)
    capsys.readouterr()
    assert main(["evaluate", *common, "--plan", str(pickled), "--out", str(tmp_path / "pk")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "a pickled TorchRec plan" in err[0] and "plan_to_json" in err[0], err
    # hosts of unequal size: refused as a plan TorchRec numbers no ranks of
    two = make_baseline("round_robin").plan(t, 4, task.memory_bytes_per_device, task.task_id)
    odd = tmp_path / "odd_hosts.json"
    doc = write_plan_json(two, odd)
    doc["hosts"] = [0, 0, 0, 1]
    odd.write_text(json.dumps(doc))
    assert main(["evaluate", "--tables", tiny["tables"], "--plan", str(odd), "--planners", "round_robin",
                 "--out", str(tmp_path / "oh")]) == 2
    assert "rank order" in capsys.readouterr().err
    # the A/A repeat's rows are its own
    assert main(["evaluate", "--tables", tiny["tables"], "--plan", tiny["plan"], "--planners", "round_robin",
                 "--rounds", "1", "--batch-size", "32", "--out", str(tmp_path / "aa")]) == 0
    rows = pd.read_parquet(tmp_path / "aa" / "placements.parquet")
    assert {"user_plan", "user_plan#2", "round_robin"} <= set(rows["planner"])
    # the files a team shares say what the numbers are of: this machine's kernels
    assert set(pd.read_parquet(tmp_path / "aa" / "evaluation.parquet")["measured_on"]) == {"cpu:" + _cpu_name()}


def _cpu_name() -> str:
    from embshard.bench.backends import hardware

    return hardware("cpu").removeprefix("cpu:")


def test_a_plan_json_torchrec_cannot_run_is_measured_and_said(tiny, tmp_path, caplog):
    """Uneven row ranges: `embshard export` refuses them; evaluate measures the plan as written and says so."""
    pytest.importorskip("torchrec")
    task = tiny["task"]
    t = task.tables
    rows = int(t.rows[0])
    shards = [Shard(0, 0, row_offset=0, row_size=rows // 3), Shard(0, 1, row_offset=rows // 3,
                                                                  row_size=rows - rows // 3)]
    shards += [Shard(i, i % 2) for i in range(1, len(t))]
    p = Placement(t, 2, task.memory_bytes_per_device, shards, task_id=task.task_id)
    path = tmp_path / "uneven.json"
    write_plan_json(p, path)
    with caplog.at_level("WARNING"):
        UserPlan(str(path)).plan_task(task)
    assert "TorchRec cannot run this plan" in caplog.text


def test_a_plan_with_no_planners_to_measure_it_beside_is_refused(tiny, tmp_path, capsys):
    """`--planners ""` with `--plan` had measured the plan alone under an "against your plan" header with nothing
    under it."""
    from embshard.cli import main

    assert main(["evaluate", "--tables", tiny["tables"], "--plan", tiny["plan"], "--planners", "",
                 "--out", str(tmp_path / "ev")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no planners to measure the plan beside" in err[0], err
    assert not (tmp_path / "ev").exists()
