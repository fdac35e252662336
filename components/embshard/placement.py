"""Placement: which device holds each table (or column slice of a table), and its memory check.

`Shard` (a piece of a table on a device, with its kind) lives in embshard.types and is re-exported here."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from .checks import DIM_MULTIPLE, size_text
from .errors import InfeasiblePlacementError
from .tableset import TableSet
from .types import COLUMN, REPLICATED, WHOLE, DeviceTopology, Shard

__all__ = ["Placement", "Shard", "piece_bytes"]


def piece_bytes(tables: TableSet, s: Shard) -> int:
    """Bytes of weights a piece holds: its rows (all, or its range) x its columns (all, or its slice)."""
    rows = int(tables.rows[s.table]) if s.row_size is None else int(s.row_size)
    dim = int(tables.dims[s.table]) if s.col_size is None else int(s.col_size)
    return rows * dim * int(tables.bytes_per_element[s.table])


@dataclass
class Placement:
    tables: TableSet
    num_devices: int
    memory_bytes_per_device: int
    shards: list[Shard]
    planner: str = ""
    model_uri: str | None = None
    task_id: str = "task"
    meta: dict = field(default_factory=dict)
    topology: DeviceTopology | None = None  # the planner's; None: num_devices x memory on one host
    # Other plans the planner kept (best first), for a measured refinement (embshard.refine); never written out.
    alternatives: list[Placement] = field(default_factory=list, repr=False, compare=False)

    @property
    def devices(self) -> DeviceTopology:
        """The device topology this placement was planned for."""
        return self.topology or DeviceTopology(self.num_devices, self.memory_bytes_per_device)

    @classmethod
    def from_assignment(cls, tables: TableSet, assignment, num_devices: int, memory_bytes_per_device: int,
                        **kw) -> Placement:
        """Table-wise placement: assignment[i] is the device of table i."""
        shards = [Shard(int(i), int(d)) for i, d in enumerate(np.asarray(assignment))]
        return cls(tables, int(num_devices), int(memory_bytes_per_device), shards, **kw)

    def shard_dims(self) -> np.ndarray:
        return np.array([self.tables.dims[s.table] if s.col_size is None else s.col_size for s in self.shards],
                        dtype=np.int64)

    def shard_bytes(self) -> np.ndarray:
        return np.array([piece_bytes(self.tables, s) for s in self.shards], dtype=np.int64)

    def device_of_shards(self) -> np.ndarray:
        return np.array([s.device for s in self.shards], dtype=np.int64)

    def memory_per_device(self) -> np.ndarray:
        return np.bincount(self.device_of_shards(), weights=self.shard_bytes(),
                           minlength=self.num_devices).astype(np.int64)

    def device_shards(self) -> list[list[Shard]]:
        out: list[list[Shard]] = [[] for _ in range(self.num_devices)]
        for s in self.shards:
            out[s.device].append(s)
        return out

    def check(self, where: str | None = None) -> None:
        """Every table fully placed once, devices in range, memory respected; else a clear error.

        A table is placed as exactly one of: one whole piece; column slices covering its columns once; row ranges
        (full width) covering its rows once; or one replica on every device. `where` names the input in errors
        (a file, or a file and task); default the task id."""
        where = where or self.task_id
        dev = self.device_of_shards()
        if len(dev) and (dev.min() < 0 or dev.max() >= self.num_devices):
            raise InfeasiblePlacementError(f"device index out of range 0..{self.num_devices - 1}",
                                           path=where, field="device")
        by_table: list[list[Shard]] = [[] for _ in range(len(self.tables))]
        for s in self.shards:
            if not 0 <= s.table < len(self.tables):
                raise InfeasiblePlacementError(f"shard of table index {s.table} out of range", path=where,
                                               field="table_id")
            by_table[s.table].append(s)
        for i, pieces in enumerate(by_table):
            found = self._coverage_problem(i, pieces)
            if found:
                problem, field = found
                raise InfeasiblePlacementError(f"table {self.tables.table_ids[i]}: {problem}", path=where,
                                               field=field, fix="place every column (in slices of multiples of "
                                               f"{DIM_MULTIPLE}) or every row of every table exactly once, or one "
                                               "replica on every device")
        mem = self.memory_per_device()
        over = mem - self.memory_bytes_per_device
        if (over > 0).any():
            d = int(np.argmax(over))
            raise InfeasiblePlacementError(
                f"device {d} holds {size_text(mem[d])}, {size_text(over[d])} over its "
                f"{size_text(self.memory_bytes_per_device)}", path=where, field="memory",
                fix="add devices, raise memory per device, or use a planner that respects memory")

    def _coverage_problem(self, i: int, pieces: list[Shard]) -> tuple[str, str] | None:
        """Why table i's pieces do not place it exactly once, with the shard field that says it (a slice of 62
        columns had named table_id); None when they do."""
        rows, dim = int(self.tables.rows[i]), int(self.tables.dims[i])
        if not pieces:  # the table's own rows (a placements file) or entry (a plan.json) say it
            return "not placed", "table_id"
        kinds = {s.kind for s in pieces}
        if len(kinds) > 1:
            return f"mixes {' and '.join(sorted(kinds))} pieces", "kind"
        kind = kinds.pop()
        if kind == WHOLE:
            return None if len(pieces) == 1 else (f"placed whole {len(pieces)} times", "table_id")
        if kind == REPLICATED:
            devs = sorted(s.device for s in pieces)
            return None if devs == list(range(self.num_devices)) else \
                (f"replicated on devices {devs[:8]}, not once on each of the {self.num_devices} devices", "device")
        if kind == COLUMN:
            spans, total, unit, at = [(s.col_offset, s.col_size or 0) for s in pieces], dim, "columns", "col"
        else:
            if any(s.col_size is not None for s in pieces):
                return "a row piece is also column-sliced (row pieces have the table's full width)", "col_size"
            spans, total, unit, at = [(s.row_offset, s.row_size or 0) for s in pieces], rows, "rows", "row"
        nxt = 0
        for off, size in sorted(spans):
            if size <= 0:
                return f"a {kind} piece of {size} {unit}", f"{at}_size"
            if kind == COLUMN and size % DIM_MULTIPLE:  # FBGEMM's kernels and TorchRec take such widths only
                return (f"a column slice of {size} columns (slices must be multiples of {DIM_MULTIPLE} columns)",
                        "col_size")
            if off != nxt:
                return (f"{unit} {min(off, nxt)}..{max(off, nxt)} are {'missing' if off > nxt else 'placed twice'}",
                        f"{at}_offset")
            nxt = off + size
        return None if nxt == total else (f"{nxt} of {total} {unit} placed", f"{at}_size")

    def to_frame(self, device_costs: np.ndarray | None = None) -> pd.DataFrame:
        """Rows of the placements contract (predicted_cost_ms = predicted cost of the row's device; every row carries
        the devices: their count, memory and devices per host)."""
        t = self.tables
        per_host = self.devices.devices_per_host()
        hashes = t.content_hashes()
        rows = []
        for s in self.shards:
            rows.append({
                "task_id": self.task_id, "table_id": t.table_ids[s.table], "device": s.device,
                "col_offset": s.col_offset if s.col_size is not None else None,
                "col_size": s.col_size, "kind": s.kind,
                "row_offset": s.row_offset if s.row_size is not None else None, "row_size": s.row_size,
                "planner": self.planner, "model_uri": self.model_uri,
                "predicted_cost_ms": None if device_costs is None else float(device_costs[s.device]),
                "num_devices": self.num_devices, "memory_bytes_per_device": self.memory_bytes_per_device,
                "devices_per_host": per_host, "table_sha256": hashes[s.table],
            })
        return pd.DataFrame(rows)
