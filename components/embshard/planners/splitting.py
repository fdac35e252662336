"""Cutting tables into the pieces a planner places: whole, k column slices, or row-wise ranges (docs/method.md,
"Splits").

A planner places pieces, not tables. `split_to_fit` gives every planner the same starting view of a task: each
table whole where the whole task can be packed that way, otherwise the fewest cuts that make it pack: a table's
cut grows one level at a time (whole -> 2 -> 4 -> ... column slices -> row-wise over all devices), the largest
piece first, until first-fit-decreasing packs every piece into the devices' memory. Slices go down to MIN_SLICE_DIM
columns by default; with `fit_slice_bytes` (the learned planner's second view, compose.RowWiseFit) a table goes
row-wise instead once its slices would hold fewer bytes of a row than that: TorchRec's own planner cuts no column
shard below 128 columns. Which is cheaper depends on the hardware: on this CPU the narrow slices measured 0.72x
(learned) and 0.86x (dim_greedy) the row-wise cuts of the MLPerf-like list on 32 devices of 4 GiB (every slice
takes all of its table's lookups, but a row range sends its partial sums at the table's full width).
Row pieces follow TorchRec's row-wise layout (`types.row_blocks`: piece k on device k) so that the export hands
them to TorchRec unchanged; they are pinned (no planner moves them). Column slices are free pieces that planners
place like tables.

`PieceView.pieces` is a TableSet with one entry per free piece (a slice is a table of its width; a row range holds
its rows and its share of the lookups, as `costmodel.scoring.piece_features` says), so heuristics, the policy and
the cost model see pieces exactly as they see tables.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from ..checks import GiB
from ..errors import InfeasiblePlacementError
from ..placement import piece_bytes
from ..tableset import TableSet
from ..types import COLUMN, REPLICATED, ROW, DeviceTopology, Shard, Task, row_blocks

MIN_SLICE_DIM = 4   # FBGEMM's kernels and TorchRec's column-wise sharding take widths that are multiples of 4
# A slice cut for speed (not to fit) keeps at least this many bytes of a row, by the hardware the cost model was
# measured on (its `hardware`, "cpu:..." or "cuda:..."), so that a model trained on a GPU plans with the GPU's floor.
# Below the kernel's floor, halving a slice no longer cuts its cost (a lookup fetches whole cache lines or memory
# sectors). `python -m benchmarks.slice_widths` measures it (benchmarks/results/slice_widths.md: the narrowest width
# reached by halvings that each cost at most 0.9x): 128 bytes on the H100 (32 -> 16 columns: 0.97x) and 64 on this
# CPU (0.76x; 16 -> 8: 1.00x). The CPU keeps 128 all the same: at 64 the learned planner cut the MLPerf-like
# list's hottest table into 8 slices of 16 at 32 devices where it had cut it row-wise, and measured 1.23x and 1.52x
# slower with two pipeline runs' models (they price a narrow slice of a 40M-row table far below its cost).
SPEED_SLICE_BYTES = {"cpu": 128, "cuda": 128}
DEFAULT_SPEED_SLICE_BYTES = 128  # hardware not measured: the widest floor of those above


def speed_slice_bytes(hardware: str) -> int:
    """The slice floor (bytes per row) of a cost model's hardware ("cpu:AMD EPYC", "cuda:NVIDIA H100 ...")."""
    kind = str(hardware or "").split(":", 1)[0].strip().lower()
    return SPEED_SLICE_BYTES.get(kind, DEFAULT_SPEED_SLICE_BYTES)


ROW_LEVEL = -1      # the cut level of a table placed row-wise over all devices


def column_widths(dim: int, parts: int) -> list[int]:
    """`parts` slice widths, multiples of 4 where the table's width is, as even as possible, summing to `dim`."""
    units, rest = divmod(int(dim), MIN_SLICE_DIM)
    if parts < 2 or units < parts:
        raise ValueError(f"cannot cut {dim} columns into {parts} slices of at least {MIN_SLICE_DIM}")
    base, extra = divmod(units, parts)
    widths = [(base + (1 if k < extra else 0)) * MIN_SLICE_DIM for k in range(parts)]
    widths[-1] += rest  # a width that is no multiple of 4 keeps its remainder in the last slice
    return widths


def column_pieces(table: int, dim: int, parts: int, col_offset: int = 0) -> list[Shard]:
    """`parts` column slices of columns [col_offset, col_offset + dim) of `table` (device 0: not placed yet)."""
    out, off = [], col_offset
    for w in column_widths(dim, parts):
        out.append(Shard(table, 0, off, w))
        off += w
    return out


def row_pieces(table: int, rows: int, devices: list[int]) -> list[Shard]:
    """Row ranges of `table` in TorchRec's layout over `devices` (piece k on devices[k]); fewer pieces than
    devices when the table has few rows."""
    return [Shard(table, devices[k], row_offset=off, row_size=size)
            for k, (off, size) in enumerate(row_blocks(rows, min(len(devices), rows)))]


def replica_pieces(table: int, num_devices: int) -> list[Shard]:
    """One replica of `table` on every device (TorchRec's data_parallel); pinned like row pieces."""
    return [Shard(table, d, kind=REPLICATED) for d in range(num_devices)]


def max_column_parts(dim: int) -> int:
    """The most slices a table of width `dim` may be cut into to make it fit."""
    return int(dim) // MIN_SLICE_DIM


def max_speed_column_parts(dim: int, bytes_per_element: int, min_slice_bytes: int) -> int:
    """The most slices a search may cut a piece of width `dim` into for speed (`min_slice_bytes` per row at least:
    speed_slice_bytes)."""
    return min(max_column_parts(dim), int(dim) * int(bytes_per_element) // max(int(min_slice_bytes), 1))


def piece_table(tables: TableSet, shards: list[Shard]) -> TableSet:
    """One TableSet entry per piece: a column slice is a table of its width, a row range holds its rows and its
    share of the lookups (ids are hashed to rows, so every range gets rows/total of them)."""
    idx = np.array([s.table for s in shards], dtype=np.int64)
    sub = tables.subset(idx)
    dims, rows = sub.dims.copy(), sub.rows.copy()
    pooling = sub.pooling_factor.copy()
    for k, s in enumerate(shards):
        if s.col_size is not None:
            dims[k] = s.col_size
        if s.row_size is not None:
            pooling[k] = pooling[k] * s.row_size / rows[k]
            rows[k] = s.row_size
    size = rows * dims * sub.bytes_per_element
    return replace(sub, dims=dims, rows=rows, pooling_factor=pooling, size_bytes=size.astype(np.int64))


@dataclass
class PieceView:
    """A task's tables as the pieces planners place.

    `levels[i]`: how table i is cut (0 whole, k >= 2 that many column slices, ROW_LEVEL row-wise over all
    devices). `free` are the pieces a planner assigns (one `pieces` entry each, in order), `pinned` the row pieces
    with their devices. `memory` is what every device has left for free pieces (its memory less the largest
    pinned load of any device, so a plan of the free pieces within it is feasible on every device)."""

    tables: TableSet
    topology: DeviceTopology
    levels: np.ndarray
    free: list[Shard]
    pinned: list[Shard]
    pieces: TableSet
    memory: int
    load: np.ndarray  # bytes of pinned pieces per device
    fit_slice_bytes: int = 0  # the narrowest slice its cuts to fit make, bytes per row (0: MIN_SLICE_DIM columns)

    @classmethod
    def build(cls, tables: TableSet, topology: DeviceTopology, levels: np.ndarray,
              fit_slice_bytes: int = 0) -> PieceView:
        free: list[Shard] = []
        pinned: list[Shard] = []
        for i, level in enumerate(levels):
            free_i, pinned_i = _pieces_at(tables, topology, i, int(level))
            free.extend(free_i)
            pinned.extend(pinned_i)
        return cls._of(tables, topology, np.asarray(levels, dtype=np.int64), free, pinned,
                       _device_load(tables, topology, pinned), fit_slice_bytes)

    @classmethod
    def _of(cls, tables, topology, levels, free, pinned, load, fit_slice_bytes: int = 0) -> PieceView:
        pieces = piece_table(tables, free) if free else tables.subset([])
        return cls(tables, topology, levels, free, pinned, pieces, int(topology.memory_bytes - load.max()), load,
                   int(fit_slice_bytes))

    @property
    def is_whole(self) -> bool:
        """No table is cut: the view's pieces are the tables themselves, in order."""
        return not self.levels.any()

    def shards(self, assignment) -> list[Shard]:
        """The placement's shards: free piece k on device assignment[k], then the pinned row pieces."""
        return [s.on(d) for s, d in zip(self.free, np.asarray(assignment).tolist())] + list(self.pinned)

    def table_of_piece(self, k: int) -> int:
        return self.free[k].table

    def refined(self, *tables: int) -> PieceView | None:
        """The view with each of `tables` cut one level finer (2 -> 4 -> ... column slices, then row-wise), or
        None when none of them can be (all row-wise already). Built from this view, the same as `build` would:
        only the cut tables' pieces are new (at 99% memory fill, 5,000 tables on 1,024 devices cut hundreds of
        tables one after another, and rebuilding every row piece each time took minutes)."""
        levels = self.levels.copy()
        finer = {t: next_level(int(levels[t]), int(self.tables.dims[t]), int(self.tables.bytes_per_element[t]),
                               self.fit_slice_bytes) for t in sorted({int(t) for t in tables})}
        cut = {t: level for t, level in finer.items() if level is not None}
        if not cut:
            return None
        load = self.load.copy()
        new_free, new_pinned = {}, []
        for t, level in cut.items():
            levels[t] = level
            new_free[t], pinned_t = _pieces_at(self.tables, self.topology, t, level)
            new_pinned.extend(pinned_t)
            for s in pinned_t:
                load[s.device] += piece_bytes(self.tables, s)
        free: list[Shard] = []
        for s in self.free:  # a cut table's new pieces where its old ones were: the table order `build` lays out
            if s.table not in cut:
                free.append(s)
            elif s.table in new_free:
                free.extend(new_free.pop(s.table))
        # Cut tables were free pieces (a row-wise table is cut no finer), so sorting by table keeps `build`'s order.
        pinned = sorted(self.pinned + new_pinned, key=lambda s: s.table) if new_pinned else list(self.pinned)
        return PieceView._of(self.tables, self.topology, levels, free, pinned, load, self.fit_slice_bytes)


def _pieces_at(tables: TableSet, topology: DeviceTopology, i: int, level: int) -> tuple[list[Shard], list[Shard]]:
    """(free pieces, pinned pieces) of table i cut at `level`."""
    if level == 0:
        return [Shard(i, 0)], []
    if level == ROW_LEVEL:
        return [], row_pieces(i, int(tables.rows[i]), list(range(topology.count)))
    return column_pieces(i, int(tables.dims[i]), level), []


def _device_load(tables: TableSet, topology: DeviceTopology, pinned: list[Shard]) -> np.ndarray:
    load = np.zeros(topology.count, dtype=np.int64)
    for s in pinned:
        load[s.device] += piece_bytes(tables, s)
    return load


def next_level(level: int, dim: int, bytes_per_element: int = 4, fit_slice_bytes: int = 0) -> int | None:
    """The next finer cut of a table of width `dim`: whole -> 2 column slices -> 4 -> ... -> row-wise (slices of at
    least MIN_SLICE_DIM columns and `fit_slice_bytes` bytes of a row)."""
    if level == ROW_LEVEL:
        return None
    k = 2 if level == 0 else level * 2
    return k if k <= max_speed_column_parts(dim, bytes_per_element, fit_slice_bytes or 1) else ROW_LEVEL


_RECENT_VIEWS: list[tuple[TableSet, DeviceTopology, int, PieceView]] = []


def split_to_fit(tables: TableSet, topology: DeviceTopology, task_id: str = "task",
                 fit_slice_bytes: int = 0) -> PieceView:
    """The fewest cuts that make the task pack (module docstring); tables stay whole where it packs so.
    A one-line error when even every table cut row-wise over all devices does not fit. `fit_slice_bytes`: cut
    row-wise rather than into slices narrower than this many bytes of a row (0: slices down to MIN_SLICE_DIM).

    The last few views are kept (by the identity of the tables, whose arrays are read-only): a learned plan asks
    for the same view once for itself and once per heuristic, and each costs a first-fit pass over the pieces."""
    for t, topo, floor, view in _RECENT_VIEWS:
        if t is tables and topo == topology and floor == fit_slice_bytes:
            return view
    view = _split_to_fit(tables, topology, task_id, int(fit_slice_bytes))
    _RECENT_VIEWS.insert(0, (tables, topology, int(fit_slice_bytes), view))
    del _RECENT_VIEWS[6:]  # a learned plan of a cut task asks for two views (compose.RowWiseFit)
    return view


def _split_to_fit(tables: TableSet, topology: DeviceTopology, task_id: str, fit_slice_bytes: int) -> PieceView:
    levels = np.zeros(len(tables), dtype=np.int64)
    for i in np.flatnonzero(tables.size_bytes > topology.memory_bytes):
        level: int | None = 0  # a table larger than a device: the fewest slices that each fit one
        while level not in (None, ROW_LEVEL) and largest_piece_bytes(tables, int(i), level) > topology.memory_bytes:
            level = next_level(level, int(tables.dims[i]), int(tables.bytes_per_element[i]), fit_slice_bytes)
        levels[i] = ROW_LEVEL if level is None else level
    view = PieceView.build(tables, topology, levels, fit_slice_bytes)
    for _ in range(4 * len(tables) + 8):
        packs, table = first_fit(view)
        if packs:
            return view
        finer = None if table is None else view.refined(table)
        if finer is None:
            break
        view = finer
    raise unplaceable_error(tables, topology, task_id)


def piece_task(task: Task) -> Task:
    """`task` as the policy learns and plans it: its pieces (split_to_fit: the tables, cut only where they would
    not pack whole: a table larger than a device, or a tight task first-fit cannot pack) as its tables, on devices
    holding what the pinned row pieces leave. The task itself when nothing is cut; an InfeasiblePlacementError
    (one line) when even row-wise cuts do not pack. Policy training and the outer loop's measured plans see tasks
    so, as the learned planner's rollouts do (compose.Problem.ctx)."""
    view = split_to_fit(task.tables, task.devices, task.task_id)
    if view.is_whole:
        return task
    return Task(task.task_id, view.pieces, replace(task.devices, memory_bytes=view.memory), task.split)


def largest_piece_bytes(tables: TableSet, i: int, level: int) -> int:
    """Bytes of the widest column slice of table i cut at `level` (the whole table at level 0)."""
    width = int(tables.dims[i]) if level == 0 else max(column_widths(int(tables.dims[i]), level))
    return int(tables.rows[i]) * width * int(tables.bytes_per_element[i])


def first_fit(view: PieceView) -> tuple[bool, int | None]:
    """(True, None) when first-fit-decreasing packs the free pieces beside the pinned ones; else (False, the table
    to cut finer: the one with the largest piece that can still be cut, None when none can)."""
    if view.memory < 0:
        return False, _largest_cuttable(view)
    D = view.topology.count
    free = np.full(D, view.topology.memory_bytes, dtype=np.int64)
    for s in view.pinned:
        free[s.device] -= piece_bytes(view.tables, s)
    for k in np.argsort(-view.pieces.size_bytes, kind="stable"):
        need = int(view.pieces.size_bytes[k])
        fits = np.flatnonzero(free >= need)
        if fits.size == 0:
            return False, _largest_cuttable(view)
        free[fits[0]] -= need
    return True, None


def _largest_cuttable(view: PieceView) -> int | None:
    best, best_size = None, -1
    for k, s in enumerate(view.free):
        if view.levels[s.table] != ROW_LEVEL and int(view.pieces.size_bytes[k]) > best_size:
            best, best_size = s.table, int(view.pieces.size_bytes[k])
    return best


def unplaceable_error(tables: TableSet, topology: DeviceTopology, task_id: str) -> InfeasiblePlacementError:
    """The error when no cut of the tables fits: the largest table, what a device holds, and the fix."""
    i = int(np.argmax(tables.size_bytes))
    need = int(tables.size_bytes.sum())
    have = topology.count * topology.memory_bytes
    return InfeasiblePlacementError(
        f"the tables do not fit even cut row-wise over all {topology.count} devices: they need {need / GiB:.3f} GiB "
        f"of {have / GiB:.3f} GiB in all, the largest ({tables.table_ids[i]}) "
        f"{int(tables.size_bytes[i]) / GiB:.3f} GiB, and row-wise pieces leave too little room per device",
        path=task_id, field="memory_bytes_per_device", fix="add devices or raise memory per device")


# Restarts of a planner that cut one table each (as TorchRec does); past them, each restart cuts the table of every
# piece that found no room. Tasks that need more cuts than this are near-full memory on many devices: 5,000 tables
# at 99% fill of 1,024 devices needed hundreds, and one restart at a time ran over 5 minutes for one heuristic.
SINGLE_CUT_RESTARTS = 16


def place_with_cuts(tables: TableSet, topology: DeviceTopology, task_id: str, assign) -> list[Shard]:
    """Shards of a planner that places free pieces with `assign(view) -> (assignment, pieces that fit nowhere)`
    (assignment None when some did not fit): the table of a piece that fits nowhere is cut one level finer and the
    planner runs again, as TorchRec splits a table only when it cannot place it. The first SINGLE_CUT_RESTARTS
    restarts cut only the first such table; later ones cut all of them at once."""
    view = split_to_fit(tables, topology, task_id)
    for restart in range(4 * len(tables) + 8):
        assignment, stuck = assign(view)
        if assignment is not None:
            return view.shards(assignment)
        cut = stuck[:1] if restart < SINGLE_CUT_RESTARTS else stuck
        finer = view.refined(*(view.table_of_piece(k) for k in cut))
        if finer is None:
            break
        view = finer
    raise unplaceable_error(tables, topology, task_id)


def is_row_piece(s: Shard) -> bool:
    """Row pieces are pinned: TorchRec runs them only in the row_blocks layout over their devices."""
    return s.kind == ROW


def is_pinned(s: Shard) -> bool:
    """Pieces no search moves: row pieces (row_blocks layout) and replicas (one on every device)."""
    return s.kind in (ROW, REPLICATED)


def merge_shared_slices(shards: list[Shard], dims) -> list[Shard]:
    """Column slices of one table on one device, joined into one slice (the table whole when one slice is left).
    A slice's cost depends on its width, not on which columns it holds, so a table whose device holds several of
    its slices gets its columns laid out again: each device one contiguous slice, in the order of its first one.

    Such slices cut no device's work: the device looks up the same rows over the same columns, now as several
    narrower tables. A model may still price them lower, an error a search would otherwise exploit (7 of 15
    learned plans of development tasks kept such slices; on 9 such devices the joined device measured 0.75-0.99x
    as slow, paired over 7 rounds). And TorchRec cannot run a rank holding slices of one table of unequal widths
    (its fused kernel views the rank's rows of the table at one width: DistributedModelParallel fails)."""
    by_table: dict[int, list[Shard]] = {}
    for s in shards:
        if s.kind == COLUMN:
            by_table.setdefault(s.table, []).append(s)
    joined: dict[int, list[Shard]] = {}
    for t, pieces in by_table.items():
        width: dict[int, int] = {}  # device -> the columns it holds, devices in the order of their first slice
        for s in sorted(pieces, key=lambda s: s.col_offset):
            width[s.device] = width.get(s.device, 0) + (s.col_size or 0)
        if len(width) == len(pieces):
            continue  # one slice per device: nothing to join
        out: list[Shard] = []
        offset = min(s.col_offset for s in pieces)
        for d, w in width.items():
            out.append(Shard(t, d, offset, w))
            offset += w
        joined[t] = [Shard(t, out[0].device)] if len(out) == 1 and out[0].col_size == int(dims[t]) else out
    if not joined:
        return shards
    out, done = [], set()
    for s in shards:  # the order of the pieces kept: a joined table's pieces where its first piece was
        if s.table not in joined:
            out.append(s)
        elif s.table not in done:
            out.extend(joined[s.table])
            done.add(s.table)
    return out
