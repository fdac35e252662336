"""The placement problem's vocabulary: what a planner is asked to solve and what it may call.

- `DeviceTopology`: the devices of a task (how many, memory per device, the hardware, the bandwidths of the
  links, which devices share a host), in the spirit of TorchRec's `Topology`. Every planner gets one
  (`Planner.plan` builds it from (num_devices, memory) when a caller gives ints) and stores it on the Placement.
- `Shard` and its kinds: a piece of one table on one device (the whole table, a column slice, a row slice, or a
  replica). Planners place whole tables, column slices and row ranges (planners.splitting); the learned planner
  also replicates small hot tables (planners.search); user and TorchRec plans may hold replicas too; the export
  writes all four as TorchRec shardings.
- `CostEstimator`: what planners, the policy and the scorer call on a cost model (the network, the ensemble and
  the analytic reference implement it): SUM-decomposable encodings and costs from summed encodings.
- `Task`: one placement problem (an id, its tables, its devices); `load_tasks` reads them from the tables and
  tasks files.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

# The shard kinds belong to the placements contract (schemas checks them); re-exported for the placing code.
from .schemas import COLUMN, REPLICATED, ROW, SHARD_KINDS, WHOLE  # noqa: F401
from .tableset import TableSet

if TYPE_CHECKING:
    import torch

SPLITS = ("train", "test", "all")


@dataclass(frozen=True)
class DeviceTopology:
    """The devices of one task. `hosts[d]` is the host of device d (None: all devices on one host)."""

    count: int                              # devices (ranks) the tables are placed on
    memory_bytes: int                       # embedding memory per device
    # e.g. "cuda:NVIDIA H100 80GB HBM3"; None: the cost model's own. Costs are the cost model's measurements
    # whatever is named here: a model-based planner warns when it names other hardware than its model's.
    hardware: str | None = None
    # Not modelled: the all-to-all is priced with the cost model's one calibrated bandwidth between every pair of
    # devices. Kept as fields so that code setting them gets a one-line error instead of a silently ignored value.
    intra_node_bandwidth_gbps: float | None = None
    inter_node_bandwidth_gbps: float | None = None
    hosts: tuple[int, ...] | None = None

    def __post_init__(self):
        import numbers

        from .errors import EmbshardError

        for name, fix in (("count", "give a whole number of devices"),
                          ("memory_bytes", "give memory in bytes as an int, e.g. 80 * 2**30 for 80 GiB")):
            value = getattr(self, name)  # a float count failed deep in the planners (range() of 4.5)
            if not isinstance(value, numbers.Integral) or isinstance(value, bool):
                raise EmbshardError(f"{name}={value!r} is not an integer", field=name, fix=fix)
        if self.hosts is not None and len(self.hosts) != self.count:
            raise EmbshardError(f"{len(self.hosts)} host entries for {self.count} devices", field="hosts",
                                fix="give the host of every device, or none for one host")
        for name in ("intra_node_bandwidth_gbps", "inter_node_bandwidth_gbps"):
            if getattr(self, name) is not None:
                raise EmbshardError(
                    f"{name}={getattr(self, name)} is not used: the all-to-all is priced with the cost model's one "
                    "calibrated bandwidth between every pair of devices (hosts decide only where table-row-wise "
                    "cuts may go)", field=name, fix="leave it out; the pipeline's benchmark stage calibrates the "
                    "all-to-all on the hardware it measures (--param recalibrate_comm=true)")

    @classmethod
    def of(cls, devices: int | DeviceTopology, memory_bytes: int | None = None) -> DeviceTopology:
        """`devices` itself when it is a topology, else `devices` devices of `memory_bytes` each on one host."""
        if isinstance(devices, DeviceTopology):
            return devices
        return cls(int(devices), int(memory_bytes if memory_bytes is not None else 0))

    @property
    def local_world_size(self) -> int:
        """Devices per host (the largest host), as TorchRec's Topology counts them."""
        if self.hosts is None:
            return self.count
        return max(self.hosts.count(h) for h in set(self.hosts))

    def devices_per_host(self) -> int | None:
        """L when the hosts are `on_hosts(count, memory, L)`'s (TorchRec's rank order), else None (one host, or
        another layout)."""
        if self.hosts is None:
            return None
        per_host = self.local_world_size
        if self.count % per_host:  # (0, 0, 0, 1): hosts of unequal size, no layout TorchRec numbers
            return None
        return per_host if self.hosts == tuple(k // per_host for k in range(self.count)) else None

    def same_host(self, a: int, b: int) -> bool:
        return self.hosts is None or self.hosts[a] == self.hosts[b]

    @classmethod
    def on_hosts(cls, count: int, memory_bytes: int, per_host: int | None) -> DeviceTopology:
        """`count` devices on hosts of `per_host` each in TorchRec's rank order (host h holds devices h*L ..
        h*L+L-1); None: one host. A `per_host` that does not divide the devices is an error."""
        if per_host is None:
            return cls(int(count), int(memory_bytes))
        if per_host < 1 or count % per_host:
            from .errors import EmbshardError

            raise EmbshardError(f"{count} devices do not split into hosts of {per_host}", field="devices_per_host",
                                fix="give a number of devices per host that divides the devices")
        return cls(int(count), int(memory_bytes), hosts=tuple(k // int(per_host) for k in range(int(count))))



@dataclass(frozen=True)
class Shard:
    """A piece of one table on one device: the whole table, columns [col_offset, col_offset+col_size), rows
    [row_offset, row_offset+row_size), or (kind 'replicated') a full copy. `kind` is derived from the sizes
    unless given as 'replicated'."""

    table: int            # index into the TableSet
    device: int
    col_offset: int = 0
    col_size: int | None = None  # None = all columns
    row_offset: int = 0
    row_size: int | None = None  # None = all rows
    kind: str = ""

    def __post_init__(self):
        if self.kind not in ("", *SHARD_KINDS):
            from .errors import EmbshardError

            raise EmbshardError(f"unknown shard kind {self.kind!r}", field="kind",
                                fix=f"use one of {', '.join(SHARD_KINDS)}")
        if self.kind != REPLICATED:
            derived = ROW if self.row_size is not None else COLUMN if self.col_size is not None else WHOLE
            object.__setattr__(self, "kind", derived)

    def on(self, device: int) -> Shard:
        """This piece on `device`: `dataclasses.replace(self, device=device)` at a third of its cost (planners
        move thousands of pieces per plan)."""
        return Shard(self.table, int(device), self.col_offset, self.col_size, self.row_offset, self.row_size,
                     self.kind)


def row_blocks(rows: int, parts: int) -> list[tuple[int, int]]:
    """The row ranges (offset, size) of a table cut into `parts` row-wise pieces, in device order: each holds
    ceil(rows / parts) rows, the last the rest. TorchRec 1.8 trains row-wise (and table-row-wise, per host)
    shards only in this layout (its input dist buckets ids by that block size), so planners cut rows this way
    and the export can hand the plan to TorchRec unchanged."""
    if parts < 1 or rows < parts:
        from .errors import EmbshardError

        raise EmbshardError(f"cannot cut {rows} rows into {parts} row-wise pieces", field="row_size",
                            fix="cut into at most as many pieces as the table has rows")
    block = -(-rows // parts)
    out = []
    for i in range(parts):
        offset = i * block
        size = min(block, rows - offset)
        if size <= 0:
            break
        out.append((offset, size))
    return out


@runtime_checkable
class CostEstimator(Protocol):
    """A SUM-decomposable cost model: a device's predicted cost is a function of the sum of the encodings of
    the table pieces it holds (an all-zero sum is an empty device). What the scorer, the search and the policy
    call; implemented by costmodel.model.CostModel, costmodel.ensemble.CostEnsemble and
    costmodel.reference.AnalyticEstimator."""

    @property
    def num_members(self) -> int:
        """Models whose disagreement is the uncertainty (1: none)."""
        ...

    def encode(self, features) -> torch.Tensor:
        """(N, H) encodings of N pieces from their raw (N, 21) features."""
        ...

    def heads_from_sums(self, sums: torch.Tensor, num_devices: int) -> torch.Tensor:
        """(..., 3) ms (fwd compute, bwd compute, comm) from device sums (..., H)."""
        ...

    def totals_from_sums(self, sums: torch.Tensor, num_devices: int) -> torch.Tensor:
        """(...) total ms of each device from device sums (..., H)."""
        ...

    def member_totals_from_sums(self, sums: torch.Tensor, num_devices: int) -> torch.Tensor:
        """(K, ...) device totals per member (K = num_members)."""
        ...


@dataclass(frozen=True)
class Task:
    task_id: str
    tables: TableSet
    devices: DeviceTopology
    split: str = "test"

    @property
    def num_devices(self) -> int:
        return self.devices.count

    @property
    def memory_bytes_per_device(self) -> int:
        return self.devices.memory_bytes


def load_tasks(tables: str | os.PathLike | TableSet, tasks: str | os.PathLike, split: str = "all",
               limit: int | None = None, task_ids: list[str] | None = None) -> list[Task]:
    """The tasks of `split` ('train', 'test' or 'all'; at most `limit`; only `task_ids` when given, whatever their
    split), each with its tables selected. Errors name the tasks file and the task."""
    from . import schemas
    from .errors import EmbshardError

    if split not in SPLITS:
        raise EmbshardError(f"unknown split {split!r}", path=os.fspath(tasks), field="split",
                            fix=f"use one of {', '.join(SPLITS)}")
    table_set = tables if isinstance(tables, TableSet) else TableSet.read(tables)
    df = schemas.read(tasks, "tasks")
    if task_ids is not None:
        unknown = sorted(set(task_ids) - set(df["task_id"].astype(str)))
        if unknown:
            raise EmbshardError(f"no task {unknown[0]!r} (the file has {', '.join(map(str, df['task_id'][:4]))}"
                                f"{', ...' if len(df) > 4 else ''})", path=os.fspath(tasks), field="task_id",
                                fix="give a task_id of the tasks file")
        df = df[df["task_id"].astype(str).isin(task_ids)]
    elif split != "all":
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
                        task_topology(t._asdict(), where), str(t.split)))
    return out


def devices_per_host_of(row) -> int | None:
    """A tasks.parquet row's devices_per_host (a mapping: column -> value); None where it is absent or null."""
    import pandas as pd

    per_host = row.get("devices_per_host")
    return None if per_host is None or pd.isna(per_host) else int(per_host)


def task_topology(row, where: str) -> DeviceTopology:
    """The devices of a tasks.parquet row: num_devices x memory_bytes_per_device, on hosts of devices_per_host
    when the row gives one (else one host)."""
    from .errors import EmbshardError

    try:
        return DeviceTopology.on_hosts(int(row["num_devices"]), int(row["memory_bytes_per_device"]),
                                       devices_per_host_of(row))
    except EmbshardError as exc:
        raise exc.at(where) from None
