"""The placement problem's small types: what a planner is asked to solve.

`DeviceSpec` describes the devices of a task (how many, memory per device, and room for what a cost model may
one day take into account: the hardware and the links between devices); `Task` is one placement problem (an id,
its tables, its devices). Planners (`Planner.plan_task`), evaluation, promotion, policy training and export all
take Tasks; `load_tasks` reads them from the tables and tasks files, in the spirit of TorchRec's `Topology`.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from .tableset import TableSet

SPLITS = ("train", "test", "all")


@dataclass(frozen=True)
class DeviceSpec:
    count: int                              # devices (ranks) the tables are placed on
    memory_bytes: int                       # embedding memory per device
    hardware: str | None = None             # e.g. "cuda:NVIDIA H100 80GB HBM3"; None: the cost model's own
    intra_node_bandwidth_gbps: float | None = None  # None: the cost model's communication model decides
    inter_node_bandwidth_gbps: float | None = None


@dataclass(frozen=True)
class Task:
    task_id: str
    tables: TableSet
    devices: DeviceSpec
    split: str = "test"

    @property
    def num_devices(self) -> int:
        return self.devices.count

    @property
    def memory_bytes_per_device(self) -> int:
        return self.devices.memory_bytes


def load_tasks(tables: str | os.PathLike | TableSet, tasks: str | os.PathLike, split: str = "all",
               limit: int | None = None) -> list[Task]:
    """The tasks of `split` ('train', 'test' or 'all'; at most `limit`), each with its tables selected.
    Errors name the tasks file and the task."""
    from . import schemas
    from .errors import EmbshardError

    if split not in SPLITS:
        raise EmbshardError(f"unknown split {split!r}", path=os.fspath(tasks), field="split",
                            fix=f"use one of {', '.join(SPLITS)}")
    table_set = tables if isinstance(tables, TableSet) else TableSet.read(tables)
    df = schemas.read(tasks, "tasks")
    if split != "all":
        df = df[df["split"] == split]
    if limit:
        df = df.head(int(limit))
    if df.empty:
        raise EmbshardError(f"no tasks with split {split!r}", path=os.fspath(tasks), field="split",
                            fix="choose another split or sample tasks with `embshard tasks`")
    out = []
    for t in df.itertuples():
        where = f"{os.fspath(tasks)} (task {t.task_id})"
        out.append(Task(str(t.task_id), table_set.select(list(t.table_ids), where),
                        DeviceSpec(int(t.num_devices), int(t.memory_bytes_per_device)), str(t.split)))
    return out
