"""The planner interface: tables + a device topology (or devices + memory per device) -> Placement.

Every planner treats memory per device as a hard constraint. `check_feasible` rejects tasks that no planner
can place (all tables together exceed all devices), and `InfeasiblePlacementError` says how much memory is
missing: a table is never silently put on a device that cannot hold it.
"""
from __future__ import annotations

import contextlib
import contextvars
import logging
import math
import numbers
import sys
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import numpy as np

from ..errors import EmbshardError, InfeasiblePlacementError
from ..placement import Placement
from ..tableset import TableSet
from ..types import DeviceTopology

if TYPE_CHECKING:
    from ..types import Task

from ..checks import MAX_DEVICES, MAX_MEMORY_GB, GiB, size_text

log = logging.getLogger(__name__)
# True while a plan is being made in this thread (or task), or inside `inner_plans()`: the plans made then are
# proposals, witnesses or candidates, not the user's plan, and give no warnings of their own.
_planning: contextvars.ContextVar[bool] = contextvars.ContextVar("embshard_planning", default=False)


@contextlib.contextmanager
def inner_plans():
    """Plans made in this block are not the user's (a price check's witnesses, a refinement's candidates, the shard
    sampler's greedy plans): they record and log no warnings (a price check had logged six full-device lines about
    baseline plans the user never asked for)."""
    token = _planning.set(True)
    try:
        yield
    finally:
        _planning.reset(token)


class Planner(ABC):
    """Subclasses set `name` and implement `_plan`; `plan` adds the checks every planner owes its users."""

    name: str = "planner"

    def plan(self, tables: TableSet, num_devices: int | DeviceTopology, memory_bytes_per_device: int | None = None,
             task_id: str = "task") -> Placement:
        """Place `tables` on the devices: a DeviceTopology, or a device count with `memory_bytes_per_device`
        (one host). The placement carries the topology (`placement.devices`)."""
        if not isinstance(tables, TableSet):  # a DataFrame or a path had failed deep inside (AttributeError)
            raise EmbshardError(f"tables is a {type(tables).__name__}, not a TableSet", path=task_id, field="tables",
                                fix="give TableSet.from_frame(df), TableSet.read('tables.parquet') or "
                                    "embshard.ingest.spec.read_tables('spec.yaml')")
        if isinstance(num_devices, DeviceTopology):
            if memory_bytes_per_device is not None:  # plan(tables, topology, "my-task") had dropped the task id
                raise EmbshardError(f"memory_bytes_per_device={memory_bytes_per_device!r} beside a DeviceTopology",
                                    path=task_id, field="memory_bytes_per_device",
                                    fix="the topology holds the memory: give plan(tables, topology, task_id=...)")
            topology = num_devices
        else:
            if memory_bytes_per_device is None:
                raise EmbshardError("no memory per device", path=task_id, field="memory_bytes_per_device",
                                    fix="give memory_bytes_per_device or a DeviceTopology")
            topology = DeviceTopology(_whole(num_devices, "num_devices", task_id, "give a whole number of devices"),
                                      _whole(memory_bytes_per_device, "memory_bytes_per_device", task_id,
                                             "give memory in bytes, e.g. 80 * 2**30 for 80 GiB"))
        if len(tables) == 0:
            raise EmbshardError("no tables to place", path=task_id, field="table_ids",
                                fix="give a task with at least one table")
        if not 0 < topology.count <= MAX_DEVICES:  # 10^6 devices had run for minutes before any error
            raise EmbshardError(f"{topology.count:,} devices", path=task_id, field="num_devices",
                                fix=f"ask for 1 to {MAX_DEVICES:,} devices")
        if not 0 < topology.memory_bytes <= MAX_MEMORY_GB * GiB:
            raise EmbshardError(f"{topology.memory_bytes:,} bytes of memory per device", path=task_id,
                                field="memory_bytes_per_device",
                                fix=f"give a positive memory per device of at most {MAX_MEMORY_GB:,.0f} GiB (1 PiB)")
        check_feasible(tables, topology.count, topology.memory_bytes, task_id)
        outer = not _planning.get()  # not a proposal inside another planner's plan (the learned planner's heuristics)
        with inner_plans(), _torch_defaults():  # the plans _plan makes are its proposals
            placement = self._plan(tables, topology, task_id)
        placement.planner = placement.planner or self.name
        placement.task_id = task_id
        placement.topology = topology
        for alt in placement.alternatives:  # plans of the same task (a table-row-wise one needs its hosts)
            alt.planner = alt.planner or placement.planner
            alt.task_id, alt.topology = task_id, topology
        placement.check()
        if outer:
            self._record_warnings(placement)
        return placement

    def _record_warnings(self, placement: Placement) -> None:
        """The warnings every plan owes its user (ids TorchRec cannot take, a device filled above FULL_WARNING),
        in the plan's meta.warnings with the planner's own, each logged once per planner: a script that calls
        `plan` learns what `embshard place` says (it had recorded them only in place)."""
        from ..torchrec_compat import unnamable_warning

        # (kind, line): a kind is logged once per planner (an evaluation's tasks differ in their numbers and ids);
        # each plan records its own line
        found = [(kind, line) for kind, line in (("torchrec_ids", unnamable_warning(placement.tables.table_ids)),
                                                 ("full_device", full_warning(placement))) if line]
        if not found:
            return
        placement.meta["warnings"] = list(dict.fromkeys([*(placement.meta.get("warnings") or []),
                                                         *(line for _, line in found)]))
        warned = self.warned_lines()
        for kind, line in found:
            if kind not in warned and line not in warned:
                warned.update((kind, line))
                log.warning("%s: %s", placement.task_id, line)

    def warned_lines(self) -> set[str]:
        """Warning lines (and kinds of warning) this planner has logged: each once per planner; a caller that said
        one itself adds it here."""
        return self.__dict__.setdefault("_warned", set())

    def plan_task(self, task: Task) -> Placement:
        """`plan` for a Task (embshard.types): its tables and device topology."""
        return self.plan(task.tables, task.devices, task_id=task.task_id)

    @abstractmethod
    def _plan(self, tables: TableSet, topology: DeviceTopology, task_id: str) -> Placement:
        ...


FULL_WARNING = 0.95  # of the memory given: above it a device has no room for what the weights need beside them


def full_warning(placement: Placement) -> str | None:
    """One warning line when a device is filled above FULL_WARNING: the memory given counts embedding weights
    only."""
    used = placement.memory_per_device() / max(placement.memory_bytes_per_device, 1)
    full = np.flatnonzero(used > FULL_WARNING)
    if not len(full):
        return None
    k = int(full[np.argmax(used[full])])
    return (f"{len(full)} device(s) filled above {100 * FULL_WARNING:.0f}% of the memory given (device {k}: "
            f"{100 * used[k]:.1f}%) with embedding weights alone; optimizer state, buffers and the dense model need "
            "room too (fix: give --memory-gb, or memory_bytes_per_device, what the embedding weights may use)")


def _torch_defaults():
    """costmodel.scoring.torch_defaults where torch is imported (only then can a caller have changed its defaults;
    the heuristics never import it)."""
    if "torch" not in sys.modules:
        return contextlib.nullcontext()
    from ..costmodel.scoring import torch_defaults

    return torch_defaults()


def _whole(value, field: str, task_id: str, fix: str) -> int:
    """`value` as an int when it is a whole number (4, 4.0, numpy's); else one EmbshardError (4.7 devices had
    planned 4, '4' and True had been taken)."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value) \
            and float(value).is_integer():
        return int(float(value))
    raise EmbshardError(f"{value!r} is not a whole number", path=task_id, field=field, fix=fix)


MEMORY_FIELD = "memory_bytes_per_device"  # the field a memory shortfall names (a tasks file's column)
BYTES_HINT = " (memory_bytes_per_device counts bytes: 16 GiB is 17179869184)"  # where a GiB figure was typed


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
            path=task_id, field=MEMORY_FIELD,
            # How much more, in numbers (a capacity planner had to work them out): lower bounds, since pieces
            # must also pack.
            fix=f"add devices (at least {-(-total // max(memory_bytes_per_device, 1)):,} of this memory) or raise "
                f"memory per device (to at least {size_text(-(-total // num_devices), round_up=True)} on "
                f"{num_devices:,})" + (
                BYTES_HINT if tiny else "")
            + (f", or check table {names[big]}'s rows (a stray large id in a trace sizes its table by that id)"
               if dominant else ""))


def no_room_error(tables: TableSet, table: int, free: np.ndarray, task_id: str) -> InfeasiblePlacementError:
    """The error a greedy planner raises when table `table` fits on no device."""
    need = int(tables.size_bytes[table])
    return InfeasiblePlacementError(
        f"no device has room for table {tables.table_ids[table]} ({need / GiB:.3f} GiB; the emptiest device has "
        f"{free.max() / GiB:.3f} GiB free, {(need - free.max()) / GiB:.3f} GiB missing)",
        path=task_id, field=MEMORY_FIELD, fix="add devices or raise memory per device")
