"""Placements ⇄ placements.parquet rows: rebuild a Placement from the rows of one task."""
from __future__ import annotations

import numpy as np
import pandas as pd

from ..errors import EmbshardError
from ..placement import Placement, Shard
from ..tableset import TableSet
from ..types import DeviceTopology


def _value(v):
    return None if v is None or (isinstance(v, float) and np.isnan(v)) or v is pd.NA else v


def placement_from_frame(df_task: pd.DataFrame, tables: TableSet, num_devices: int | None = None,
                         memory_bytes_per_device: int | None = None, where: str | None = None,
                         tables_source: str = "tables.parquet") -> Placement:
    """The Placement of one task's placements.parquet rows (Placement.to_frame's inverse).

    `tables` may hold more tables than the task; the placement's TableSet is the task's tables in row order.
    The devices are the rows' own (`num_devices`, `memory_bytes_per_device` columns, written since they exist);
    given ones (a tasks file's) must agree with them. A file without them: without `num_devices`, the highest
    device + 1 (an empty last device is then lost); without `memory_bytes_per_device`, the fullest device's memory
    (recorded in meta as inferred). The result is checked (every column placed once, memory respected). `where`
    names the input in errors (default the task id), `tables_source` the file `tables` were read from.
    """
    if df_task is None or len(df_task) == 0:
        raise EmbshardError("no placement rows", field="task_id", fix="give the rows of one task")
    task_ids = df_task["task_id"].astype(str).unique()
    if len(task_ids) != 1:
        raise EmbshardError(f"rows of {len(task_ids)} tasks ({list(task_ids[:3])})", field="task_id",
                            fix="pass the rows of one task (df[df.task_id == ...])")
    task_id = str(task_ids[0])
    where = where or task_id
    planners = df_task["planner"].astype(str).unique()
    if len(planners) != 1:  # e.g. an evaluation's placements.parquet: every planner's plan of each task
        raise EmbshardError(f"task {task_id} has the plans of {len(planners)} planners ({', '.join(planners[:4])})",
                            path=where, field="planner",
                            fix=f"export one planner's rows (e.g. df[df.planner == {str(planners[0])!r}])")
    ids: list[str] = []
    for t in df_task["table_id"].astype(str):
        if t not in ids:
            ids.append(t)
    sub = tables.select(ids, where=where, source=tables_source)
    _check_unchanged(df_task, sub, ids, where)
    _check_alike(df_task, where)
    pos = {t: i for i, t in enumerate(ids)}
    shards = []
    for row in df_task.itertuples(index=False):
        off = _value(getattr(row, "col_offset", None))
        size = _value(getattr(row, "col_size", None))
        roff = _value(getattr(row, "row_offset", None))
        rsize = _value(getattr(row, "row_size", None))
        kind = _value(getattr(row, "kind", None))
        _check_shard_columns(str(row.table_id), off, size, roff, rsize, kind, where)
        shards.append(Shard(pos[str(row.table_id)], int(row.device), int(off or 0),
                            None if size is None else int(size), int(roff or 0),
                            None if rsize is None else int(rsize), "replicated" if kind == "replicated" else ""))
    meta: dict = {}
    num_devices = _own_value(df_task, "num_devices", num_devices, where, "devices")
    memory_bytes_per_device = _own_value(df_task, "memory_bytes_per_device", memory_bytes_per_device, where,
                                         "memory per device")
    devices = int(df_task["device"].max()) + 1
    if num_devices is None:
        num_devices = devices
        meta["num_devices_inferred"] = True
    elif devices > num_devices:
        raise EmbshardError(f"device {devices - 1} used but the task has {num_devices} devices", path=where,
                            field="device", fix="use devices 0..num_devices-1")
    meta.update(_plan_meta(df_task, where))
    uris = [u for u in (df_task["model_uri"] if "model_uri" in df_task.columns else []) if _value(u) is not None]
    placement = Placement(sub, int(num_devices), 1, shards, planner=str(planners[0]),
                          model_uri=str(uris[0]) if uris else None, task_id=task_id, meta=meta)
    if memory_bytes_per_device is None:
        memory_bytes_per_device = max(int(placement.memory_per_device().max()), 1)
        meta["memory_bytes_per_device_inferred"] = True
    placement.memory_bytes_per_device = int(memory_bytes_per_device)
    per_host = own_devices_per_host(df_task, where)
    if per_host is not None and per_host < int(num_devices):
        # the hosts the rows were planned for (to_frame writes them): without them a table-row-wise cut read as
        # rows over devices of one host of all, and its TorchRec plan was refused
        try:
            placement.topology = DeviceTopology.on_hosts(int(num_devices), int(memory_bytes_per_device), per_host)
        except EmbshardError as exc:
            raise exc.at(where) from None
    placement.check(where)
    return placement


# What the contract says each row of a task (or of a device) carries alike; export writes it into plan.json.
TASK_ALIKE = ("balanced_estimate_ms", "plan_meta", "model_uri")
DEVICE_ALIKE = ("predicted_cost_ms",)


def _check_alike(df_task: pd.DataFrame, where: str) -> None:
    """Rows of a task that disagree on a value the plan has once are refused: export had taken the first row's (a
    balanced estimate of 1.0 beside 9.61, a plan_meta replacing the plan's) or a device's largest cost."""
    groups = [(column, "the task's rows", df_task[column]) for column in TASK_ALIKE if column in df_task.columns]
    for column in DEVICE_ALIKE:
        if column in df_task.columns:
            groups += [(column, f"the rows of device {int(dev)}", g[column]) for dev, g in df_task.groupby("device")]
    for column, rows, values in groups:
        given = values.dropna().astype(str)  # a null is a value not given (a row added by hand), not another one
        if given.nunique() > 1:
            distinct = list(dict.fromkeys(given.tolist()))
            shown = ", ".join(v[:40] for v in distinct[:3]) + (", ..." if len(distinct) > 3 else "")
            raise EmbshardError(f"{rows} disagree ({shown}): the plan has one value", path=where, field=column,
                                fix="give every row the same value (export.placements.plan_frame writes them so)")


def _check_shard_columns(table: str, col_offset, col_size, row_offset, row_size, kind, where: str) -> None:
    """A row's offsets and sizes (None: not given) come in pairs, and a `kind` it gives is the one they say: a
    whole table's row marked `column` had been exported whole without a word, a row_offset without its row_size
    dropped."""
    for (offset, off_value), (size, size_value) in ((("col_offset", col_offset), ("col_size", col_size)),
                                                    (("row_offset", row_offset), ("row_size", row_size))):
        if (off_value is None) != (size_value is None):
            raise EmbshardError(f"table {table}: {offset} and {size} come together (one is given without the "
                                "other)", path=where, field=size if size_value is None else offset,
                                fix="give both (a slice or range), or neither (the whole table)")
    cols, rows = col_size is not None, row_size is not None
    if cols and rows:
        raise EmbshardError(f"table {table}: a column slice and a row range at once", path=where, field="row_size",
                            fix="give a column slice (col_offset, col_size) or a row range (row_offset, row_size)")
    said = "row" if rows else "column" if cols else None
    if kind is not None and kind != "replicated" and (kind != said if said else kind != "whole"):
        raise EmbshardError(f"table {table}: kind {kind!r}, but its offsets and sizes make it "
                            f"{said or 'whole'}", path=where, field="kind",
                            fix="give the kind its columns say, or leave kind empty (it is derived)")


def _check_unchanged(df_task: pd.DataFrame, tables: TableSet, ids: list[str], where: str) -> None:
    """The tables the rows were planned for (their `table_sha256`, where recorded) must be the ones given: a plan
    for a table whose rows, dim or access pattern changed was balanced, and priced, for another table."""
    if "table_sha256" not in df_task.columns:
        return
    planned = {str(t): str(h) for t, h in zip(df_task["table_id"], df_task["table_sha256"]) if _value(h) is not None}
    now = dict(zip(ids, tables.content_hashes()))
    changed = [t for t in ids if t in planned and planned[t] != now[t]]
    if changed:
        more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
        raise EmbshardError(f"table(s) {', '.join(changed[:3])}{more} changed since the plan was made (rows, dim, "
                            "bytes per element, pooling or access pattern differ from the tables given)",
                            path=where, field="table_sha256",
                            fix="pass the tables.parquet the plan was made from (a spec read again samples its "
                                "access pattern anew: the same --seed and bins batch size give the same tables, but "
                                "specs read before embshard seeded each table by its name, 2026-11-27, sampled by "
                                "row position), or plan again with these tables")


def own_devices_per_host(df_task: pd.DataFrame, where: str) -> int | None:
    """The devices per host a task's rows carry (None: one host, or a file written before the column)."""
    return _own_value(df_task, "devices_per_host", None, where, "devices per host")


def _own_value(df_task: pd.DataFrame, column: str, given: int | None, where: str, what: str) -> int | None:
    """A task's value of `column` (the same on each of its rows), or `given` where the rows have none; rows and a
    given value that disagree are an error."""
    if column not in df_task.columns or df_task[column].isna().all():
        return given
    values = df_task[column].dropna().astype("int64").unique()
    if len(values) != 1 or df_task[column].isna().any():
        missing = int(df_task[column].isna().sum())
        said = (f"{missing} of the task's {len(df_task)} rows give none" if missing else
                f"the task's rows give {len(values)} different values ({', '.join(map(str, values[:3]))})")
        raise EmbshardError(said, path=where, field=column,
                            fix="give each task's rows one value (the devices the plan was made for)")
    own = int(values[0])
    if given is not None and int(given) != own:
        raise EmbshardError(f"the placements were made for {what} {own:,}, the tasks file gives {int(given):,}",
                            path=where, field=column, fix="pass the tasks.parquet the placements were made for")
    return own


def plan_frame(placement: Placement, device_costs=None, balanced_estimate: float | None = None) -> pd.DataFrame:
    """A plan's rows of the placements contract: Placement.to_frame's, with what plan.json says of the whole plan
    on every row (`balanced_estimate_ms`, and `plan_meta`: its meta as JSON), so that a plan exported from the
    placements file (the pipeline's export stage) says as much as one written by `place`."""
    import json

    from .plan_json import json_safe

    df = placement.to_frame(device_costs)
    df["balanced_estimate_ms"] = None if balanced_estimate is None else float(balanced_estimate)
    df["plan_meta"] = json.dumps(json_safe(placement.meta or {}), sort_keys=True)
    return df


def _plan_meta(df_task: pd.DataFrame, where: str) -> dict:
    """The plan's meta from its rows' `plan_meta` (plan_frame), {} where the file has none."""
    import json

    if "plan_meta" not in df_task.columns:
        return {}
    texts = [t for t in df_task["plan_meta"] if _value(t) is not None]
    if not texts:
        return {}
    try:
        meta = json.loads(texts[0])
    except (TypeError, ValueError) as exc:
        raise EmbshardError(f"plan_meta is not JSON ({str(exc)[:60]})", path=where, field="plan_meta",
                            fix="write the rows with export.placements.plan_frame, or drop the column") from None
    if not isinstance(meta, dict):
        raise EmbshardError(f"plan_meta is a JSON {type(meta).__name__}, not an object", path=where,
                            field="plan_meta", fix="write the rows with export.placements.plan_frame")
    return meta


def balanced_estimate_from_frame(df_task: pd.DataFrame) -> float | None:
    """The plan's balanced estimate from its rows (plan_frame), None where they carry none."""
    if "balanced_estimate_ms" not in df_task.columns:
        return None
    vals = df_task["balanced_estimate_ms"].dropna()
    return float(vals.iloc[0]) if len(vals) else None


def device_costs_from_frame(df_task: pd.DataFrame, num_devices: int, column: str = "predicted_cost_ms"):
    """Per-device costs from the rows (each row carries its device's cost); None when the column is empty.

    A device without rows holds nothing and costs 0.
    """
    if column not in df_task.columns or df_task[column].isna().all():
        return None
    costs = np.zeros(int(num_devices))
    for dev, group in df_task.groupby("device"):
        vals = group[column].dropna().astype(float)
        if len(vals):
            costs[int(dev)] = float(vals.max())
    return costs
