"""The planner interface: tables + a device topology (or devices + memory per device) -> Placement.

Every planner treats memory per device as a hard constraint. `check_feasible` rejects tasks that no planner
can place (all tables together exceed all devices), and `InfeasiblePlacementError` says how much memory is
missing: a table is never silently put on a device that cannot hold it.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import numpy as np

from ..errors import EmbshardError, InfeasiblePlacementError
from ..placement import Placement
from ..tableset import TableSet
from ..types import DeviceTopology

if TYPE_CHECKING:
    from ..types import Task

from ..checks import GiB, size_text


class Planner(ABC):
    """Subclasses set `name` and implement `_plan`; `plan` adds the checks every planner owes its users."""

    name: str = "planner"

    def plan(self, tables: TableSet, num_devices: int | DeviceTopology, memory_bytes_per_device: int | None = None,
             task_id: str = "task") -> Placement:
        """Place `tables` on the devices: a DeviceTopology, or a device count with `memory_bytes_per_device`
        (one host). The placement carries the topology (`placement.devices`)."""
        if isinstance(num_devices, DeviceTopology):
            topology = num_devices
        else:
            if memory_bytes_per_device is None:
                raise EmbshardError("no memory per device", path=task_id, field="memory_bytes_per_device",
                                    fix="give memory_bytes_per_device or a DeviceTopology")
            topology = DeviceTopology(int(num_devices), int(memory_bytes_per_device))
        if len(tables) == 0:
            raise EmbshardError("no tables to place", path=task_id, field="table_ids",
                                fix="give a task with at least one table")
        if topology.count <= 0:
            raise EmbshardError(f"{topology.count} devices", path=task_id, field="num_devices",
                                fix="ask for at least one device")
        if topology.memory_bytes <= 0:
            raise EmbshardError(f"{topology.memory_bytes} bytes of memory per device", path=task_id,
                                field="memory_bytes_per_device", fix="give a positive memory per device")
        check_feasible(tables, topology.count, topology.memory_bytes, task_id)
        placement = self._plan(tables, topology, task_id)
        placement.planner = placement.planner or self.name
        placement.task_id = task_id
        placement.topology = topology
        placement.check()
        return placement

    def plan_task(self, task: Task) -> Placement:
        """`plan` for a Task (embshard.types): its tables and device topology."""
        return self.plan(task.tables, task.devices, task_id=task.task_id)

    @abstractmethod
    def _plan(self, tables: TableSet, topology: DeviceTopology, task_id: str) -> Placement:
        ...


def check_feasible(tables: TableSet, num_devices: int, memory_bytes_per_device: int, task_id: str = "task"):
    """The necessary condition: all tables fit all devices together. A table larger than one device is not an
    error here: planners split it (row- or column-wise) to make it fit."""
    check_capacity(tables.size_bytes, num_devices, memory_bytes_per_device, task_id,
                   names=tables.table_ids, rows=tables.rows)


def check_capacity(size_bytes, num_devices: int, memory_bytes_per_device: int, task_id: str = "task",
                   names=None, rows=None):
    """check_feasible on the tables' bytes alone (a spec's sizes, before its access features are sampled).
    `names`/`rows`, when given, name a table that alone holds most of what is needed: one stray id of 2^45 in a
    trace made a 16.8-million-GiB table, and the error had said only what the tables need in all."""
    sizes = np.asarray(size_bytes, dtype=np.int64)
    total = int(sizes.sum())
    capacity = num_devices * memory_bytes_per_device
    if total > capacity:
        # A tasks file's memory_bytes_per_device counts bytes: a GiB figure typed there (8) is 8 bytes.
        tiny = 0 < memory_bytes_per_device < 2**20
        big = int(np.argmax(sizes)) if names is not None and len(sizes) else None
        dominant = big is not None and 2 * int(sizes[big]) > total
        if dominant:
            row_text = f", {int(rows[big]):,} rows" if rows is not None else ""
            one = f"; table {names[big]} alone needs {size_text(int(sizes[big]))}{row_text}"
        raise InfeasiblePlacementError(
            f"tables need {size_text(total)}, devices hold {size_text(capacity)} "
            f"({size_text(total - capacity)} missing)"
            + (f" (only {memory_bytes_per_device:,} bytes per device)" if tiny else "")
            + (one if dominant else ""),
            path=task_id, field="memory_bytes_per_device",
            fix="add devices or raise memory per device" + (
                " (memory_bytes_per_device counts bytes: 16 GiB is 17179869184)" if tiny else "")
            + (f", or check table {names[big]}'s rows (a stray large id in a trace sizes its table by that id)"
               if dominant else ""))


def no_room_error(tables: TableSet, table: int, free: np.ndarray, task_id: str) -> InfeasiblePlacementError:
    """The error a greedy planner raises when table `table` fits on no device."""
    need = int(tables.size_bytes[table])
    return InfeasiblePlacementError(
        f"no device has room for table {tables.table_ids[table]} ({need / GiB:.3f} GiB; the emptiest device has "
        f"{free.max() / GiB:.3f} GiB free, {(need - free.max()) / GiB:.3f} GiB missing)",
        path=task_id, field="memory_bytes_per_device", fix="add devices or raise memory per device")
