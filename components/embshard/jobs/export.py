"""`embshard export` and the export_placements stage: placements.parquet -> plan.json + TorchRec plans.

Writes, under OUT:
- `placements.parquet`: the placements contract (validated copy of the input rows),
- `<task_id>/plan.json`: schema embshard.plan/v3 (export/plan_json.py),
- `<task_id>/torchrec_plan.json`: the TorchRec ShardingPlan in a pickle-free JSON form
  (`embshard.export.torchrec_plan.plan_from_json(path)` rebuilds it),
- `<task_id>/torchrec_plan.pt`: the same ShardingPlan pickled by `torch.save` (load it with
  `torch.load(path, weights_only=False)`, only from a source you trust).
The TorchRec files need torchrec; without it they are skipped and the summary says so.
A re-export into the same folder leaves only its own plans there: task folders of tasks no longer exported and
TorchRec plans of tasks now exported without them are removed (other files are kept), and the stage folder a
killed earlier export left is removed at the start (storage.staged_dir).
"""
from __future__ import annotations

import argparse
import logging
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pandas is imported where a run needs it (the CLI starts fast)
    import pandas as pd

log = logging.getLogger(__name__)


def place_tasks(tables: str, tasks: str, planner, out: str, split: str = "test", *, refine_k: int = 0,
                refine_rounds: int = 5, settings=None) -> str:
    """Place every task of `split` (or 'all') with `planner`; writes the placements contract file. `refine_k` > 0:
    each task's K best distinct candidate plans are measured side by side with `settings` (embshard.refine; on the
    hardware the plans are for only when this runs there) and the measured best is placed; what was measured is
    written beside `out` as refine.json."""
    import json

    import pandas as pd

    from .. import schemas, storage
    from ..export.placements import plan_frame
    from ..planners.scoring import predicted_costs
    from ..types import load_tasks

    frames, refined = [], {}
    if refine_k:
        from ..refine import explore

        explore(planner)  # the cuts the planner does not keep, carried on, are candidates too
    for t in load_tasks(tables, tasks, split):
        pl = planner.plan_task(t)
        if refine_k:
            from ..refine import refine, winner_placement

            res = refine(pl, refine_k, rounds=refine_rounds, settings=settings,
                         cost_model=getattr(planner, "cost_model", None))
            log.info("%s", res.report())
            pl = winner_placement(res, refine_k)
            refined[t.task_id] = pl.meta["refined"]
        model = getattr(planner, "cost_model", None)
        costs, _, estimate = predicted_costs(model, pl) if model is not None else (None, None, None)
        frames.append(plan_frame(pl, costs, estimate))
    schemas.write(pd.concat(frames, ignore_index=True), out, "placements")
    if refine_k:
        storage.write_text(storage.join(os.path.dirname(os.fspath(out)) or ".", "refine.json"),
                           json.dumps(refined, indent=1))
    return out


# What `embshard export` writes and reads: its --out is checked before any work (cli.check_output).
OUTPUT = {"kind": "folder", "inputs": ("placements", "tables", "tasks"),
          "writes": ("placements.parquet",)}


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--placements", required=True,
                        help="placements.parquet (one or more tasks), or one task's plan.json (e.g. edited by hand)")
    parser.add_argument("--tables", required=True,
                        help="tables.parquet, or the table spec the plan was made from")
    parser.add_argument("--tasks", default=None,
                        help="tasks.parquet, for each task's devices and memory (else the devices the rows "
                             "carry; for files without them, inferred from the rows)")
    parser.add_argument("--out", required=True, help="output folder (local path, file:// or s3://)")
    parser.add_argument("--module-path", default="",
                        help="path of the EmbeddingBagCollection in your model for the TorchRec plan "
                             "(default: the model is the EBC)")
    parser.add_argument("--devices-per-host", type=int, default=None, metavar="L",
                        help="devices per host (host h holds devices h*L .. h*L+L-1, TorchRec's rank order); "
                             "written to plan.json as hosts and needed for table_row_wise tables (default: the "
                             "tasks file's devices_per_host, else the hosts the placements were planned for, else "
                             "one host; two that differ are refused)")
    parser.add_argument("--compute-device", choices=("cuda", "cpu"), default="cuda",
                        help="the device the training job's ranks run on, named in the TorchRec plans' shard "
                             "placements (rank:R/cuda:N, or rank:R/cpu for CPU ranks, e.g. a gloo test job)")
    parser.add_argument("--no-torchrec", action="store_true", help="write plan.json and Parquet only")


def main(args: argparse.Namespace) -> int:
    _check_not_inside_out(args.placements, args.out)
    result = run(args.placements, args.tables, args.out, tasks=args.tasks, module_path=args.module_path,
                 torchrec=not args.no_torchrec, devices_per_host=args.devices_per_host,
                 compute_device=args.compute_device)
    print(f"exported {result['num_tasks']} task(s) to {args.out}: placements.parquet, "
          f"<task>/plan.json" + (", <task>/torchrec_plan.json, <task>/torchrec_plan.pt"
                                 if result["torchrec"] else f" (TorchRec plans skipped: {result['torchrec_note']})"))
    return 0


def _check_not_inside_out(placements: str, out: str) -> None:
    """A plan.json given from inside --out (OUT/<task>/plan.json, an earlier export's) would be replaced or removed
    by this export: refused (it had been rewritten in place, the hand-edited file lost). cli.check_output covers
    the files --out names itself (placements.parquet); a task folder's name is known only from the plans."""
    from .. import storage
    from ..errors import EmbshardError

    inp, dst = storage.local_path(placements), storage.local_path(out)
    if inp is None or dst is None:
        return
    inp, dst = os.path.realpath(os.path.abspath(inp)), os.path.realpath(os.path.abspath(dst))
    if inp.startswith(dst.rstrip(os.sep) + os.sep) and os.path.basename(inp) != "placements.parquet":
        raise EmbshardError("is inside --out, whose task folders this export replaces", path=placements,
                            field="placements", fix="copy it out of --out first, or export to another folder")


def run(placements: str, tables: str, out: str, tasks: str | None = None, module_path: str = "",
        torchrec: bool = True, devices_per_host: int | None = None, compute_device: str = "cuda") -> dict:
    """Export every task of `placements`; returns {"placements": path, "plans": {task_id: {file: path}},
    "num_tasks": n, "torchrec": bool, "torchrec_note": str | None}.

    Complete or absent: every task is checked first (every table of the task, with --tasks exactly the task's
    tables, without it every table of a spec given as `tables`, each column once, memory respected), all files
    are written into a temporary folder and published under `out` only when every one was written; on any error
    nothing is left behind. `compute_device`: what the TorchRec plans name as each rank's device (cuda: its GPU on
    its host; cpu: CPU ranks)."""
    from .. import schemas, storage
    from ..checks import ID_RULE, bad_id
    from ..errors import EmbshardError
    from ..export.placements import (
        balanced_estimate_from_frame,
        device_costs_from_frame,
        own_devices_per_host,
        placement_from_frame,
    )
    from ..export.plan_json import PLAN_AGAIN, left_out_note, write_plan_json
    from ..export.torchrec_plan import check_module_path
    from ..ingest.spec import is_spec_path, read_tables
    from ..types import DeviceTopology, devices_per_host_of

    check_module_path(module_path)
    where = os.fspath(placements)
    table_set = read_tables(tables)
    made = None  # a plan.json's own created_at and embshard_version: when and by which code it was made
    if where.lower().endswith(".json"):
        df, made = _plan_json_rows(where, table_set, os.fspath(tables))
    else:
        df = schemas.read(placements, "placements")
    # A spec lists the model's tables: without a tasks file, each task's plan must place every one of them (a
    # tables.parquet is a pool that tasks take some tables of).
    model_tables = [str(t) for t in table_set.table_ids] if is_spec_path(tables) and not tasks else None
    task_tables: dict[str, list[str]] = {}
    task_info: dict[str, tuple[int, int]] = {}
    task_hosts: dict[str, int] = {}  # the tasks file's devices_per_host, where it gives one
    if tasks:
        tdf = schemas.read(tasks, "tasks")
        task_info = {str(r.task_id): (int(r.num_devices), int(r.memory_bytes_per_device))
                     for r in tdf.itertuples(index=False)}
        task_hosts = {str(r["task_id"]): h for r in tdf.to_dict("records")
                      if (h := devices_per_host_of(r)) is not None}
        task_tables = {str(r.task_id): list(r.table_ids) for r in tdf.itertuples(index=False)}
    note = None
    if torchrec:
        try:
            from ..export.torchrec_plan import require_torchrec

            require_torchrec()
        except EmbshardError as exc:
            torchrec, note = False, str(exc)
            log.warning("TorchRec plans skipped: %s", exc)
    else:
        note = "--no-torchrec"
    # Everything is checked before anything is written.
    checked = []
    for task_id, rows in df.groupby("task_id", sort=False):
        task_id = str(task_id)
        if bad_id(task_id):  # it names a folder under --out: '../x' or '/abs' would write outside it
            raise EmbshardError(f"task_id {task_id[:60]!r} is not an id ({ID_RULE})", path=where, field="task_id",
                                fix="give the task an id of those characters")
        at = f"{where} (task {task_id})"
        if tasks and task_id not in task_info:
            raise EmbshardError(f"task {task_id} is not in the tasks file {tasks}", path=where, field="task_id",
                                fix="pass the tasks.parquet the placements were made for")
        if tasks:
            _check_complete(rows, task_tables[task_id], at, tasks)
        num_devices, memory = task_info.get(task_id, (None, None))
        placement = placement_from_frame(rows, table_set, num_devices, memory, where=at,
                                         tables_source=os.fspath(tables))
        if model_tables is None and not tasks:  # a tables.parquet (maybe a run's pool): a near-miss is said
            left_out = left_out_note(placement.tables.table_ids, table_set.table_ids, os.fspath(tables))
            if left_out:  # (not `note`: that is the TorchRec note the result returns)
                log.warning("export: task %s: %s: only the plan's tables are exported " + PLAN_AGAIN, task_id,
                            left_out)
        unplaced = [t for t in model_tables or () if t not in set(placement.tables.table_ids)]
        if unplaced:
            raise EmbshardError(f"{len(unplaced)} table(s) of the spec {os.fspath(tables)} are not placed by task "
                                f"{task_id}'s plan ({', '.join(unplaced[:3])}{', ...' if len(unplaced) > 3 else ''})",
                                path=at, field="table_id", fix=f"plan again with these tables (embshard place "
                                f"--tables {os.fspath(tables)}), or pass the spec the plan was made from")
        own_hosts = own_devices_per_host(rows, at)  # the hosts the rows were planned for (None: not recorded)
        for given, what, fix in ((devices_per_host, "--devices-per-host", "leave --devices-per-host out (the "
                                  "placements' hosts are used), or plan again with this --devices-per-host"),
                                 (task_hosts.get(task_id), f"the tasks file {tasks}",
                                  "pass the tasks file the placements were made with")):
            if given is not None and own_hosts is not None and int(given) != own_hosts:
                raise EmbshardError(f"{what} gives {given} devices per host, but the placements were planned for "
                                    f"hosts of {own_hosts}", path=at, field="devices_per_host", fix=fix)
        per_host = devices_per_host if devices_per_host is not None else task_hosts.get(task_id, own_hosts)
        if per_host is not None:  # the flag, else the task's own hosts, else the hosts the rows were planned for
            try:
                placement.topology = DeviceTopology.on_hosts(placement.num_devices, placement.memory_bytes_per_device,
                                                             int(per_host))
            except EmbshardError as exc:
                raise exc.at(at) from None
        checked.append((task_id, placement, device_costs_from_frame(rows, placement.num_devices),
                        balanced_estimate_from_frame(rows)))
    plans: dict[str, dict[str, str]] = {}
    with storage.staged_dir(out) as stage:
        for task_id, placement, costs, estimate in checked:
            written = write_plan_json(placement, os.path.join(stage, task_id, "plan.json"), device_costs=costs,
                                      balanced_estimate=estimate, made=made)
            if torchrec:
                try:
                    _write_torchrec(placement, os.path.join(stage, task_id), module_path, compute_device, written)
                except EmbshardError as exc:  # a layout TorchRec cannot run: name the input and the task
                    raise (exc.at(f"{where} (task {task_id})") if exc.path is None else exc) from None
        schemas.write(df, os.path.join(stage, "placements.parquet"), "placements")
        for task_id, *_ in checked:
            names = ["plan.json"] + (["torchrec_plan.json", "torchrec_plan.pt"] if torchrec else [])
            plans[task_id] = {k: storage.join(out, task_id, n)
                              for k, n in zip(("plan_json", "torchrec_plan_json", "torchrec_plan_pt"), names)}
    _remove_stale(out, set(plans), torchrec)
    return {"placements": storage.join(out, "placements.parquet"), "plans": plans, "num_tasks": len(plans),
            "torchrec": torchrec, "torchrec_note": note}


def _plan_json_rows(path: str, tables, tables_source: str = "tables.parquet") -> tuple[pd.DataFrame, dict]:
    """The placements rows of one plan.json (ours, edited by hand or written by another tool), checked against
    its schema and `tables`, so that it exports like a placements.parquet, and its `created_at` and
    `embshard_version` where it records them. Its meta (time_cap_hit, the cut, ...) is carried; its predicted costs
    are not: after a hand edit they no longer hold (`embshard evaluate --plan` measures the plan)."""
    from ..errors import EmbshardError
    from ..export.placements import plan_frame
    from ..export.plan_json import changed_pooling, placement_from_plan, read_plan_json

    plan = read_plan_json(path)
    placement = placement_from_plan(plan, tables, where=path, tables_source=tables_source)
    # As a placements.parquet's table_sha256 does: a plan made for other traffic is refused (plan.json records each
    # table's pooling; its rows, dim and element size placement_from_plan checks).
    changed = changed_pooling(plan, placement.tables)
    if changed:
        name, was, now = changed[0]
        raise EmbshardError(f"table {name} changed since the plan was made (pooling_factor {was:g} in the plan, "
                            f"{now:g} in the tables given)", path=path, field="pooling_factor",
                            fix="pass the tables the plan was made from, or plan again with these tables")
    made = {k: plan[k] for k in ("created_at", "embshard_version") if plan.get(k) is not None}
    if plan["cost"].get("device_costs_ms") is not None:
        log.info("export: %s: its predicted costs are not carried (a hand edit would leave them wrong); export the "
                 "placements.parquet beside it, which `embshard place` writes too, to keep them", path)
    return plan_frame(placement), made


PLAN_FILES = ("plan.json", "torchrec_plan.json", "torchrec_plan.pt")  # all an export writes in a task folder


def _is_our_plan(path: str) -> bool:
    """Whether `path` is a plan.json that embshard wrote (its schema is ours): only such task folders are removed."""
    import json

    from .. import storage

    try:
        return str(json.loads(storage.read_text(path)).get("schema", "")).startswith("embshard.plan/")
    except (OSError, ValueError, AttributeError):
        return False


def _remove_stale(out: str, task_ids: set[str], torchrec: bool) -> None:
    """After publishing: the folder holds only this export's plans. Task folders of an earlier export (folders
    holding nothing but plan files) whose task is no longer exported, and TorchRec plans of a task exported now
    without them (they would contradict its new plan.json), are removed; other files are left alone."""
    import pyarrow.fs as pafs

    from .. import storage

    fs, root = storage.resolve(out)
    sep = "/" if "://" in os.fspath(out) else os.sep
    for info in fs.get_file_info(pafs.FileSelector(root, allow_not_found=True)):
        if info.type != pafs.FileType.Directory or info.base_name.startswith("."):
            continue
        inner = fs.get_file_info(pafs.FileSelector(info.path, recursive=True))
        names = {i.base_name for i in inner}
        if not names or any(i.type != pafs.FileType.File for i in inner) or not names <= set(PLAN_FILES) \
                or "plan.json" not in names or not _is_our_plan(storage.join(out, info.base_name, "plan.json")):
            continue  # not a task folder of ours (a user's folder of a torchrec_plan.pt alone had been deleted)
        if info.base_name not in task_ids:
            fs.delete_dir(info.path)
            log.info("removed %s: task %s is not in this export", info.path, info.base_name)
        elif not torchrec:
            for name in PLAN_FILES[1:]:
                if name in names:
                    fs.delete_file(info.path + sep + name)


def _check_complete(rows, task_tables: list[str], where: str, tasks: str) -> None:
    """The rows of a task place exactly the task's tables: none missing, none foreign (each once is checked
    when the placement is rebuilt, column by column)."""
    from ..errors import EmbshardError

    placed = set(rows["table_id"].astype(str))
    missing = [t for t in task_tables if t not in placed]
    if missing:
        raise EmbshardError(f"{len(missing)} of the task's {len(task_tables)} tables are not placed "
                            f"({', '.join(missing[:3])}{'...' if len(missing) > 3 else ''})", path=where,
                            field="table_id", fix=f"place every table the task lists in {tasks} (re-run the planner)")
    foreign = sorted(placed - set(task_tables))
    if foreign:
        raise EmbshardError(f"tables {', '.join(foreign[:3])} are placed but not part of the task in {tasks}",
                            path=where, field="table_id", fix="export the placements made for this tasks file")


def _write_torchrec(placement, folder: str, module_path: str, compute_device: str = "cuda",
                    plan_json: dict | None = None) -> dict[str, str]:
    import io
    import json

    import torch

    from .. import storage
    from ..export.torchrec_plan import check_plan_doc, plan_to_json, to_torchrec_plan

    plan = to_torchrec_plan(placement, module_path=module_path, compute_device=compute_device)
    t = placement.tables
    # What made it, as the plan.json beside it says (a job that logs only this file can be traced).
    source = {"task_id": placement.task_id, "planner": placement.planner, "model_uri": placement.model_uri,
              "created_at": (plan_json or {}).get("created_at"),
              "embshard_version": (plan_json or {}).get("embshard_version"), "plan_json": "plan.json",
              "compute_device": compute_device}
    doc = plan_to_json(plan, world_size=placement.num_devices,
                       tables={str(n): (int(r), int(d), int(b))
                               for n, r, d, b in zip(t.table_ids, t.rows, t.dims, t.bytes_per_element)},
                       source=source)
    check_plan_doc(doc, "torchrec_plan.json")  # what a training job's plan_from_json will check
    json_path = storage.join(folder, "torchrec_plan.json")
    storage.write_text(json_path, json.dumps(doc, indent=2) + "\n")
    pt_path = storage.join(folder, "torchrec_plan.pt")
    buf = io.BytesIO()
    torch.save(plan, buf)
    with storage.atomic_write(pt_path) as f:
        f.write(buf.getvalue())
    return {"torchrec_plan_json": json_path, "torchrec_plan_pt": pt_path}
