"""Placing one set of tables with any planner, with predicted costs, the lower bound and the outputs."""
from __future__ import annotations

import logging
import os

import numpy as np

from .. import schemas, storage
from ..errors import EmbshardError, ModelNotFoundError
from ..placement import Placement
from ..tableset import TableSet
from . import get_planner
from .report import device_table, plot_device_costs
from .scoring import lower_bound, placement_costs

log = logging.getLogger(__name__)
DEFAULT_COST_MODEL = "models:/embshard-cost@champion"


def resolve_task(tables: str, tasks: str | None, task_id: str | None, devices: int | None,
                 memory_bytes: int | None) -> tuple[TableSet, int, int, str]:
    table_set = TableSet.read(tables)
    if task_id is None:
        return table_set, int(devices), int(memory_bytes), "task"
    if tasks is None:
        raise EmbshardError("--task-id needs --tasks", field="tasks", fix="pass --tasks tasks.parquet")
    df = schemas.read(tasks, "tasks")
    row = df[df["task_id"] == task_id]
    if row.empty:
        raise EmbshardError(f"no task {task_id!r}", path=tasks, field="task_id",
                            fix=f"choose one of {', '.join(df['task_id'].head(5))}...")
    r = row.iloc[0]
    return (table_set.select(list(r["table_ids"]), f"{tasks}:{task_id}"),
            int(devices or r["num_devices"]), int(memory_bytes or r["memory_bytes_per_device"]), task_id)


def load_cost_model_or_none(uri: str | None):
    from ..costmodel import load

    try:
        return load(uri or DEFAULT_COST_MODEL)
    except ModelNotFoundError:
        if uri:  # asked for explicitly: an error
            raise
        return None


def planner_for(name: str, model_uri: str, time_budget_s: float | None):
    kw = {"model_uri": model_uri}
    if time_budget_s is not None:
        kw["time_budget_s"] = time_budget_s
    try:
        return get_planner(name, **kw)
    except ModelNotFoundError as exc:
        raise ModelNotFoundError(
            f"no registered learned planner at {model_uri}", path=model_uri,
            fix="train one with `make run` or `embshard train-policy ...`, or pick a baseline with "
                "--planner size_lookup_greedy") from exc


def predicted(placement: Placement, planner, cost_model) -> tuple[np.ndarray | None, float | None]:
    model = getattr(planner, "cost_model", None) or cost_model
    if model is None:
        return None, None
    costs = placement_costs(model, placement)
    splits = any(s.col_size is not None for s in placement.shards)
    return costs, lower_bound(model, placement.tables, placement.num_devices, column_splits=splits)


def place(tables: str, out: str, *, devices: int | None = None, memory_bytes: int | None = None,
          planner: str = "learned", model_uri: str = "models:/embshard-policy@champion",
          cost_model_uri: str | None = None, tasks: str | None = None, task_id: str | None = None,
          time_budget_s: float | None = None) -> dict:
    from ..export.plan_json import write_plan_json

    table_set, D, mem, tid = resolve_task(tables, tasks, task_id, devices, memory_bytes)
    p = planner_for(planner, model_uri, time_budget_s)
    placement = p.plan(table_set, D, mem, tid)
    cost_model = None if getattr(p, "cost_model", None) is not None else load_cost_model_or_none(cost_model_uri)
    costs, lb = predicted(placement, p, cost_model)
    storage.makedirs(out)
    plan_path = storage.join(out, "plan.json")
    write_plan_json(placement, plan_path, device_costs=costs, lower_bound=lb)
    pq_path = storage.join(out, "placements.parquet")
    schemas.write(placement.to_frame(costs), pq_path, "placements")
    png = storage.join(out, "devices.png")
    plot_device_costs(placement, costs, png, lb)
    return {"plot": png, "placement": placement, "device_costs": costs, "lower_bound": lb, "plan_json": plan_path,
            "placements": pq_path, "report": device_table(placement, costs, lb)}
