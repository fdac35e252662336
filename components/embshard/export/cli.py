"""`embshard export` and the export_placements stage: placements.parquet -> plan.json + TorchRec plans.

Writes, under OUT:
- `placements.parquet`: the placements contract (validated copy of the input rows),
- `<task_id>/plan.json`: schema embshard.plan/v1 (export/plan_json.py),
- `<task_id>/torchrec_plan.json`: the TorchRec ShardingPlan in a pickle-free JSON form
  (`embshard.export.torchrec_plan.plan_from_json(path)` rebuilds it),
- `<task_id>/torchrec_plan.pt`: the same ShardingPlan pickled by `torch.save` (load it with
  `torch.load(path, weights_only=False)`, only from a source you trust).
The TorchRec files need torchrec; without it they are skipped and the summary says so.
"""
from __future__ import annotations

import argparse
import logging
import os

log = logging.getLogger(__name__)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--placements", required=True, help="placements.parquet (one or more tasks)")
    parser.add_argument("--tables", required=True, help="tables.parquet")
    parser.add_argument("--tasks", default=None,
                        help="tasks.parquet, for each task's devices and memory (else inferred from the rows)")
    parser.add_argument("--out", required=True, help="output folder (local path, file:// or s3://)")
    parser.add_argument("--module-path", default="",
                        help="path of the EmbeddingBagCollection in your model for the TorchRec plan "
                             "(default: the model is the EBC)")
    parser.add_argument("--no-torchrec", action="store_true", help="write plan.json and Parquet only")


def main(args: argparse.Namespace) -> int:
    result = run(args.placements, args.tables, args.out, tasks=args.tasks, module_path=args.module_path,
                 torchrec=not args.no_torchrec)
    print(f"exported {result['num_tasks']} task(s) to {args.out}: placements.parquet, "
          f"<task>/plan.json" + (", <task>/torchrec_plan.json, <task>/torchrec_plan.pt"
                                 if result["torchrec"] else f" (TorchRec plans skipped: {result['torchrec_note']})"))
    return 0


def run(placements: str, tables: str, out: str, tasks: str | None = None, module_path: str = "",
        torchrec: bool = True) -> dict:
    """Export every task of `placements`; returns {"placements": path, "plans": {task_id: {file: path}},
    "num_tasks": n, "torchrec": bool, "torchrec_note": str | None}."""
    from tqdm import tqdm

    from .. import schemas, storage
    from ..errors import EmbshardError
    from ..tableset import TableSet
    from .placements import device_costs_from_frame, placement_from_frame
    from .plan_json import write_plan_json

    df = schemas.read(placements, "placements")
    table_set = TableSet.read(tables)
    task_info: dict[str, tuple[int, int]] = {}
    if tasks:
        tdf = schemas.read(tasks, "tasks")
        task_info = {str(r.task_id): (int(r.num_devices), int(r.memory_bytes_per_device))
                     for r in tdf.itertuples(index=False)}
    note = None
    if torchrec:
        try:
            from .torchrec_plan import require_torchrec

            require_torchrec()
        except EmbshardError as exc:
            torchrec, note = False, str(exc)
            log.warning("TorchRec plans skipped: %s", exc)
    else:
        note = "--no-torchrec"
    storage.makedirs(out)
    out_placements = storage.join(out, "placements.parquet")
    plans: dict[str, dict[str, str]] = {}
    groups = list(df.groupby("task_id", sort=False))
    for task_id, rows in tqdm(groups, desc="export", unit="task", disable=len(groups) < 5):
        task_id = str(task_id)
        _check_task_id(task_id)
        if tasks and task_id not in task_info:
            raise EmbshardError(f"task {task_id} is not in the tasks file", path=tasks, field="task_id",
                                fix="pass the tasks.parquet the placements were made for")
        num_devices, memory = task_info.get(task_id, (None, None))
        placement = placement_from_frame(rows, table_set, num_devices, memory)
        costs = device_costs_from_frame(rows, placement.num_devices)
        files = {"plan_json": storage.join(out, task_id, "plan.json")}
        write_plan_json(placement, files["plan_json"], device_costs=costs)
        if torchrec:
            files.update(_write_torchrec(placement, storage.join(out, task_id), module_path))
        plans[task_id] = files
    schemas.write(df, out_placements, "placements")
    return {"placements": out_placements, "plans": plans, "num_tasks": len(plans), "torchrec": torchrec,
            "torchrec_note": note}


def _check_task_id(task_id: str) -> None:
    from ..errors import EmbshardError

    if task_id in (".", "..") or "/" in task_id or os.sep in task_id:
        raise EmbshardError(f"task id {task_id!r} cannot name a folder", field="task_id",
                            fix="use task ids without path separators")


def _write_torchrec(placement, folder: str, module_path: str) -> dict[str, str]:
    import io
    import json

    import torch

    from .. import storage
    from .torchrec_plan import plan_to_json, to_torchrec_plan

    plan = to_torchrec_plan(placement, module_path=module_path)
    json_path = storage.join(folder, "torchrec_plan.json")
    storage.write_text(json_path, json.dumps(plan_to_json(plan), indent=2) + "\n")
    pt_path = storage.join(folder, "torchrec_plan.pt")
    buf = io.BytesIO()
    torch.save(plan, buf)
    with storage.atomic_write(pt_path) as f:
        f.write(buf.getvalue())
    return {"torchrec_plan_json": json_path, "torchrec_plan_pt": pt_path}
