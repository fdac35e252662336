"""Placement: which device holds each table (or column slice of a table), and its memory check.

`Shard` (a piece of a table on a device, with its kind) lives in embshard.types and is re-exported here."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from .errors import InfeasiblePlacementError
from .tableset import TableSet
from .types import COLUMN, WHOLE, DeviceTopology, Shard

__all__ = ["Placement", "Shard"]


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
        t = self.tables
        return np.array([(t.rows[s.table] if s.row_size is None else s.row_size)
                         * (t.dims[s.table] if s.col_size is None else s.col_size)
                         * t.bytes_per_element[s.table] for s in self.shards], dtype=np.int64)

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

        `where` names the input in errors (a file, or a file and task); default the task id."""
        where = where or self.task_id
        other = [s.kind for s in self.shards if s.kind not in (WHOLE, COLUMN)]
        if other:
            raise InfeasiblePlacementError(f"{other[0]} shards are not supported yet", path=where, field="kind",
                                           fix="place whole tables or column slices")
        dev = self.device_of_shards()
        if len(dev) and (dev.min() < 0 or dev.max() >= self.num_devices):
            raise InfeasiblePlacementError(f"device index out of range 0..{self.num_devices - 1}",
                                           path=where, field="device")
        cols = np.zeros(len(self.tables), dtype=np.int64)
        for s, d in zip(self.shards, self.shard_dims()):
            cols[s.table] += d
        if not np.array_equal(cols, self.tables.dims):
            bad = int(np.flatnonzero(cols != self.tables.dims)[0])
            raise InfeasiblePlacementError(
                f"table {self.tables.table_ids[bad]} has {cols[bad]} of {self.tables.dims[bad]} columns placed",
                path=where, field="table_id", fix="place every column of every table exactly once")
        mem = self.memory_per_device()
        over = mem - self.memory_bytes_per_device
        if (over > 0).any():
            d = int(np.argmax(over))
            raise InfeasiblePlacementError(
                f"device {d} holds {mem[d] / 2**30:.3f} GiB, {over[d] / 2**30:.3f} GiB over its "
                f"{self.memory_bytes_per_device / 2**30:.3f} GiB", path=where, field="memory",
                fix="add devices, raise memory per device, or use a planner that respects memory")

    def to_frame(self, device_costs: np.ndarray | None = None) -> pd.DataFrame:
        """Rows of the placements contract (predicted_cost_ms = predicted cost of the row's device)."""
        t = self.tables
        rows = []
        for s in self.shards:
            rows.append({
                "task_id": self.task_id, "table_id": t.table_ids[s.table], "device": s.device,
                "col_offset": s.col_offset if s.col_size is not None else None,
                "col_size": s.col_size, "planner": self.planner, "model_uri": self.model_uri,
                "predicted_cost_ms": None if device_costs is None else float(device_costs[s.device]),
            })
        return pd.DataFrame(rows)
