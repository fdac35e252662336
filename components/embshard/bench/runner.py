"""How one device shard is measured: the fused compute of the shard (forward, backward) and its all-to-all.

The benchmark stage (jobs.bench) calls `measure_shard` for each shard of its chunk; evaluation calls
`measure_placement`, which measures every device of a Placement in-process.

What is measured and how (device, batch, iterations, clocks, communication) is one MeasureSettings object.

Defaults: CPU batch 2,048 samples, 5 warm-up and at least 15 timed iterations over 4 rotated batches (more, up
to 200, until 300 ms of timed work: cheap shards get many samples), compute = median; GPU batch 65,536 (the
papers), 5 + at least 20 iterations (50 ms). A 15-table CPU measurement takes 1-4 s, mostly building and
touching the weights (capped per measurement: 0.25 GiB by default on CPU).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from ..checks import GiB
from ..errors import EmbshardError, first_line
from ..hardware import device_cache_bytes
from ..tableset import TableSet
from . import inputs as inp

if TYPE_CHECKING:
    from .comm import CommGroup, CommModel

log = logging.getLogger(__name__)

DEFAULT_BATCH = {"cpu": 2048, "cuda": 65_536}
DEFAULT_ITERATIONS = {"cpu": 15, "cuda": 20}
DEFAULT_WARMUP = 5
# Cheap shards are timed for more iterations until this much timed work (ms) has accumulated (max 200).
DEFAULT_MIN_TIME_MS = {"cpu": 300.0, "cuda": 50.0}
DEFAULT_ROTATIONS = 4
# CPU caches are far smaller: a measurement's weights are capped at DEFAULT_MAX_SHARD_GB_CPU, shared by the
# shard's tables (water-filling). A cap of each table by itself (`max_table_gb`, off by default) was measured in the
# twenty-seventh session and not adopted (benchmarks/results/README.md, "A per-table memory cap").
DEFAULT_MAX_SHARD_GB_CPU = 0.25


@dataclass(frozen=True)
class MeasureSettings:
    """How a stage measures: the one settings object, built once per stage (from its CLI flags or the run's
    params) and passed down to the benchmark (jobs.bench), measure_placement, the ruler and the outer loop. Every
    measuring stage of a run uses the same batch and the run's one communication calibration (the
    comm_calibration.json in `calibration_dir`), so their costs stay comparable. None: the device's default."""
    backend: str = "auto"                      # auto | fbgemm | torch
    device: str = "cpu"                        # cpu | cuda[:N] | auto
    batch_size: int | None = None              # DEFAULT_BATCH of the device
    warmup: int | None = None                  # DEFAULT_WARMUP
    iterations: int | None = None              # DEFAULT_ITERATIONS of the device (>= 10)
    num_batches: int = DEFAULT_ROTATIONS       # rotated batches
    seed: int = 0                              # inputs (and, in the benchmark, the shard sampling and order)
    max_shard_gb: float | None = None          # memory one measurement may use (memory_budget)
    max_table_gb: float | None = None          # weights one table may keep, by itself (None: no such cap)
    timer: str = "auto"                        # auto | wall | thread_cpu
    calibration_dir: str | None = None         # where comm_calibration.json is (and is written when calibrated)
    comm_ranks: int | None = None              # >= 2: the all-to-all measured among that many local ranks
    comm_bandwidth_gbps: float | None = None   # the comm model's constants (both, or neither)
    comm_latency_us: float | None = None
    min_time_ms: float | None = None           # timed work per measurement (DEFAULT_MIN_TIME_MS of the device)
    statistic: str = "median"                  # of the timed iterations: median or min
    # The ruler (embshard.ruler): each round in a fresh process (CPU), so that no measurement depends on what the
    # process measured before it (its recycled heap makes large tables measure up to ~15% faster over time).
    # Spawned, not forked (a fork would inherit that heap): a script that sets it needs a __main__ guard.
    round_processes: bool = False

    def replace(self, **changes) -> MeasureSettings:
        return dataclasses.replace(self, **changes)

    def config(self) -> BenchConfig:
        """The BenchConfig these settings make (close it with close_config)."""
        return make_config(self)


@dataclass
class BenchConfig:
    backend: str
    device: str
    batch_size: int
    warmup: int
    iterations: int
    num_batches: int
    budget_bytes: int
    timer: str
    threads: int
    seed: int
    hardware: str
    cache_bytes: int = 0                 # last-level cache of the device (embshard.hardware), recorded per row
    comm: CommModel | None = None        # when modelled
    comm_group: CommGroup | None = None  # when measured
    min_time_ms: float | None = None     # timed work per measurement (None: DEFAULT_MIN_TIME_MS of the device)
    statistic: str = "median"            # of the timed iterations: "median" or "min" (min-of-k)
    table_budget_bytes: int | None = None  # weights one table may keep, by itself (None: no per-table cap)

    @property
    def comm_source(self) -> str:
        return "measured" if self.comm_group is not None else "model"

    @property
    def comm_detail(self) -> str:
        if self.comm_group is not None:
            return f"{self.comm_group.backend}:{self.comm_group.world}ranks"
        assert self.comm is not None  # make_config sets comm or comm_group
        return self.comm.source


def _kind(device: str) -> str:
    return "cpu" if device == "cpu" else "cuda"


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def memory_budget(device: str, max_shard_gb: float | None) -> int:
    """Bytes one measurement may allocate: --max-shard-gb (CPU default DEFAULT_MAX_SHARD_GB_CPU), never above half
    the free host memory (CPU) or 80% of the free GPU memory."""
    if max_shard_gb is not None:
        from .. import checks

        max_shard_gb = checks.positive_finite(max_shard_gb, field="max_shard_gb", upper=checks.MAX_MEMORY_GB)
    if device == "cpu":
        budget = (max_shard_gb or DEFAULT_MAX_SHARD_GB_CPU) * GiB
        avail = _mem_available()
        if avail is not None:
            budget = min(budget, 0.5 * avail)
    else:
        import torch

        free, _ = torch.cuda.mem_get_info(torch.device(device))
        budget = 0.8 * free if max_shard_gb is None else min(max_shard_gb * GiB, 0.8 * free)
    return int(budget)


MAX_BATCH = 1 << 22  # samples per measured batch: the pipeline's bench_batch_size bound
MAX_ITERATIONS = 100_000  # timed (or warm-up) iterations of one measurement


def resolve_settings(settings: MeasureSettings) -> dict:
    """The measurement settings with defaults filled in and checked (what the fingerprint records)."""
    from . import backends

    device = backends.resolve_device(settings.device)  # "auto": the GPU when there is one
    chosen = backends.select_backend(settings.backend, device)
    batch_size, warmup, iterations = settings.batch_size, settings.warmup, settings.iterations
    num_batches, max_shard_gb = settings.num_batches, settings.max_shard_gb
    kind = _kind(device)
    batch_size = DEFAULT_BATCH[kind] if batch_size is None else int(batch_size)
    warmup = DEFAULT_WARMUP if warmup is None else int(warmup)
    iterations = DEFAULT_ITERATIONS[kind] if iterations is None else int(iterations)
    # Upper bounds as the pipeline's parameters have them: 10**11 samples had failed allocating 745 GiB in a
    # traceback, and 10**14 iterations ran until killed.
    if not 1 <= batch_size <= MAX_BATCH:
        raise EmbshardError(f"batch size {batch_size:,}", field="batch_size",
                            fix=f"use a batch size from 1 to {MAX_BATCH:,}")
    if not 10 <= iterations <= MAX_ITERATIONS:
        raise EmbshardError(f"{iterations:,} timed iterations", field="iterations",
                            fix=f"time 10 to {MAX_ITERATIONS:,} iterations (the median needs 10)")
    if not 0 <= warmup <= MAX_ITERATIONS or num_batches < 1:
        raise EmbshardError(f"{warmup:,} warm-up iterations, {num_batches} rotated batches", field="warmup",
                            fix=f"use --warmup 0 to {MAX_ITERATIONS:,}, and 1 or more rotated batches")
    from .. import checks

    if max_shard_gb is not None:
        max_shard_gb = checks.positive_finite(max_shard_gb, field="max_shard_gb", upper=checks.MAX_MEMORY_GB)
    max_table_gb = settings.max_table_gb
    if max_table_gb is not None:
        max_table_gb = checks.positive_finite(max_table_gb, field="max_table_gb", upper=checks.MAX_MEMORY_GB)
    threads = backends.num_threads()
    return {"backend": chosen, "device": device, "batch_size": batch_size, "warmup": warmup,
            "iterations": iterations, "num_batches": int(num_batches), "max_shard_gb": max_shard_gb,
            "max_table_gb": max_table_gb,
            "timer": backends.resolve_timer(settings.timer, device, threads), "num_threads": threads,
            "hardware": backends.hardware(device)}


def make_config(settings: MeasureSettings) -> BenchConfig:
    """The BenchConfig of `settings`: defaults filled in and checked, the memory cap, the communication (measured
    among comm_ranks, else the model: given constants, the calibration in calibration_dir, or calibrated)."""
    import torch

    from . import comm

    st = resolve_settings(settings)
    device = st["device"]
    statistic = settings.statistic
    torch.set_num_threads(st["num_threads"])
    cfg = BenchConfig(backend=st["backend"], device=device, batch_size=st["batch_size"], warmup=st["warmup"],
                      iterations=st["iterations"], num_batches=st["num_batches"],
                      budget_bytes=memory_budget(device, st["max_shard_gb"]), timer=st["timer"],
                      threads=st["num_threads"], seed=int(settings.seed), hardware=st["hardware"],
                      min_time_ms=settings.min_time_ms, statistic=statistic,
                      cache_bytes=device_cache_bytes(device),
                      table_budget_bytes=None if st["max_table_gb"] is None else int(st["max_table_gb"] * GiB))
    if statistic not in ("median", "min"):
        raise EmbshardError(f"unknown statistic {statistic!r}", field="statistic", fix="use median or min")
    if settings.comm_ranks is not None and settings.comm_ranks >= 2:
        cfg.comm_group = comm.CommGroup(int(settings.comm_ranks), device)
    else:
        cfg.comm = comm.comm_model(st["hardware"], device, out=settings.calibration_dir,
                                   bandwidth_gbps=settings.comm_bandwidth_gbps, latency_us=settings.comm_latency_us)
    return cfg


def close_config(cfg: BenchConfig) -> None:
    if cfg.comm_group is not None:
        cfg.comm_group.close()
        cfg.comm_group = None


def _row_range(row_ranges, k: int) -> tuple[int, int] | None:
    """(offset, size) of member k's row range, or None (all rows; -1 / None entries)."""
    if row_ranges is None or row_ranges[k] is None:
        return None
    off, size = row_ranges[k]
    if size is None or int(size) < 0:
        return None
    return int(off), int(size)


def _table_inputs(tables: TableSet, members: np.ndarray, col_sizes, row_ranges=None,
                  where: str = "shard") -> list[inp.TableInput]:
    out = []
    for k, i in enumerate(members):
        dim = int(tables.dims[i])
        if col_sizes is not None and col_sizes[k] is not None and int(col_sizes[k]) > 0:
            dim = int(col_sizes[k])
            if dim > int(tables.dims[i]):
                raise EmbshardError(f"column width {dim} of table {tables.table_ids[i]} wider than its dim "
                                    f"{int(tables.dims[i])}", path=where, field="col_sizes",
                                    fix="give a width <= the table's dim, or -1 for the whole width")
        rr = _row_range(row_ranges, k)
        if rr is not None and (rr[0] < 0 or rr[1] <= 0 or rr[0] + rr[1] > int(tables.rows[i])):
            raise EmbshardError(f"row range [{rr[0]}, {rr[0] + rr[1]}) outside table {tables.table_ids[i]} of "
                                f"{int(tables.rows[i])} rows", path=where, field="row_offsets",
                                fix="give ranges inside 0..rows, or -1 for all rows")
        tf = tables.trace_file[i]
        out.append(inp.TableInput(
            table_id=str(tables.table_ids[i]), rows=int(tables.rows[i]), dim=dim,
            pooling_factor=float(tables.pooling_factor[i]), bins=tables.bins[i],
            trace_file=None if tf is None or (isinstance(tf, float) and math.isnan(tf)) or tf == "" else str(tf),
            trace_table_index=int(tables.trace_table_index[i]),
            trace_pooling_factor=None if np.isnan(tables.trace_pooling[i]) else float(tables.trace_pooling[i]),
            row_offset=0 if rr is None else rr[0], row_size=None if rr is None else rr[1]))
    return out


def piece_args(shards) -> tuple[list, list]:
    """(col_sizes, row_ranges) of a device's Shards, as measure_shard takes them (None entries: whole)."""
    return ([s.col_size for s in shards],
            [None if s.row_size is None else (int(s.row_offset), int(s.row_size)) for s in shards])


def replica_args(shards, num_devices: int) -> list[int] | None:
    """`replicas` of a device's Shards as measure_shard takes them: D for a replica over D devices, 0 for any
    other piece; None when the device holds no replica."""
    from ..types import REPLICATED

    out = [int(num_devices) if s.kind == REPLICATED else 0 for s in shards]
    return out if any(out) else None


def _replica_of(replicas, k: int) -> int:
    """D of member k when it is a replica over D devices, else 0."""
    return 0 if replicas is None or not replicas[k] else int(replicas[k])


@dataclass
class ShardInputs:
    """Everything a shard's timing needs, made on the host (numpy only: a worker process can build it).

    batches: one (indices, lengths) pair per rotated batch, both concatenated table-major (FBGEMM's layout:
    lengths has T*B entries). rows: the measured (possibly capped) rows per table. bytes_per_element: each
    table's weight precision (4 = FP32, 2 = FP16), the precision its op is built in."""

    rows: list
    dims: list
    row_scale: float
    batch_size: int
    batches: list
    bytes_per_element: list | None = None  # None: all FP32

    def per_table(self, j: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """Batch j split back into one (indices, lengths) pair per table."""
        idx, lens = self.batches[j]
        B, T = self.batch_size, len(self.dims)
        per = [lens[t * B:(t + 1) * B] for t in range(T)]
        cut = np.concatenate([[0], np.cumsum([int(x.sum()) for x in per])])
        return [(idx[cut[t]:cut[t + 1]], per[t]) for t in range(T)]

    def save(self, path: str) -> str:
        """One .npz file (uncompressed): hands large inputs from a worker process to the timing process."""
        bpe = self.bytes_per_element if self.bytes_per_element is not None else [4] * len(self.dims)
        arrays = {"rows": np.asarray(self.rows, np.int64), "dims": np.asarray(self.dims, np.int64),
                  "bytes_per_element": np.asarray(bpe, np.int64),
                  "meta": np.asarray([self.row_scale, self.batch_size, len(self.batches)], np.float64)}
        for j, (i, ln) in enumerate(self.batches):
            arrays[f"i{j}"], arrays[f"l{j}"] = i, ln
        with open(path, "wb") as f:
            np.savez(f, **arrays)  # type: ignore[arg-type]  # numpy's stub takes any **kwds for allow_pickle
        return path

    @classmethod
    def load(cls, path: str) -> ShardInputs:
        with np.load(path) as z:
            row_scale, b, n = z["meta"]
            return cls(rows=[int(x) for x in z["rows"]], dims=[int(x) for x in z["dims"]],
                       row_scale=float(row_scale), batch_size=int(b),
                       bytes_per_element=[int(x) for x in z["bytes_per_element"]],
                       batches=[(z[f"i{j}"], z[f"l{j}"]) for j in range(int(n))])


def shard_inputs(tables: TableSet, members, cfg: BenchConfig, col_sizes=None, where: str = "shard",
                 row_ranges=None, replicas=None) -> ShardInputs:
    """The rotated batches of one device shard and its row scaling (host work only; deterministic per shard).
    `col_sizes[k]`: the width measured for member k (None/-1: whole); `row_ranges[k]`: its (offset, size) row
    range (None: all rows; see bench.inputs for how a range gets its lookups); `replicas[k]` > 0: member k is a
    replica over that many devices (full table, the lookups of its device's ceil(B/D) samples; bench.inputs)."""
    members = np.asarray(members, dtype=np.int64)
    specs = _table_inputs(tables, members, col_sizes, row_ranges, where)
    for k, s in enumerate(specs):
        if _replica_of(replicas, k) and (s.row_size is not None or s.dim != int(tables.dims[members[k]])):
            raise EmbshardError(f"table {s.table_id}: a replica is the whole table", path=where, field="replicas",
                                fix="give a replica no column slice or row range")
    key = ",".join(f"{s.table_id}:{s.dim}" + ("" if s.row_size is None else f":r{s.row_offset}+{s.row_size}")
                   + (f":rep{_replica_of(replicas, k)}" if _replica_of(replicas, k) else "")
                   for k, s in enumerate(specs))
    rng = np.random.default_rng([cfg.seed, zlib.crc32(key.encode())])  # same shard, same inputs
    B = cfg.batch_size
    # Row ranges: the whole table's batches (an rng of the table alone: every piece of a table filters the same
    # lookups), filtered to the range. Other tables draw from the shard's rng in order, as before.
    ranged = {t: inp.row_range_batches(s, B, cfg.num_batches,
                                       np.random.default_rng([cfg.seed, zlib.crc32(s.table_id.encode())]))
              for t, s in enumerate(specs) if s.row_size is not None}
    lengths = [[ln for _, ln in ranged[t]] if t in ranged else inp.table_lengths(s, B, cfg.num_batches, rng)
               for t, s in enumerate(specs)]
    lookups = [int(sum(int(lens[j].sum()) for lens in lengths)) for j in range(cfg.num_batches)]
    dims = np.array([s.dim for s in specs], dtype=np.int64)
    rows = np.array([s.piece_rows for s in specs], dtype=np.int64)
    bpe = np.asarray(tables.bytes_per_element, dtype=np.int64)[members]
    from .backends import precision

    for b in bpe:
        precision(b)  # 4 or 2: other widths are refused, never measured as FP32
    need_batch = inp.batch_bytes(lookups, len(specs) * B, B, int(dims.sum()), int(dims.max()))
    if cfg.device == "cpu":
        # On the host the cap is about weights (what caches see); the batch only has to fit in free memory.
        avail = _mem_available()
        weight_budget = cfg.budget_bytes
        if avail is not None and need_batch > 0.5 * avail:
            weight_budget = -1
    else:
        weight_budget = cfg.budget_bytes - need_batch  # weights and batch share the GPU's memory
    if weight_budget < int((dims * bpe).sum()) * 16:
        raise EmbshardError(
            f"the batch alone needs {need_batch / GiB:.2f} GiB of the {cfg.budget_bytes / GiB:.2f} GiB this "
            f"measurement may use ({len(specs)} tables, {max(lookups)} lookups per batch)", path=where,
            field="batch_size", fix="lower --batch-size, or raise --max-shard-gb (where the command has it) if the "
                                "machine has the memory")
    # Each table by itself first (the per-table cap, where set), then the shard's total (water-filling).
    alone = rows if cfg.table_budget_bytes is None else inp.table_caps(rows, dims, cfg.table_budget_bytes, bpe)
    cap = inp.row_cap(alone, dims, weight_budget, bpe)
    scaled = alone if cap is None else np.minimum(alone, cap)
    for s, r in zip(specs, scaled):
        s.scaled_rows = int(r)
    row_scale = float((scaled * dims * bpe).sum() / (rows * dims * bpe).sum())
    # one (indices, lengths) pair per rotated batch for each table, drawn table by table (the rng's order)
    per_table = [(inp.fit_rows(ranged[t], s.measured_rows) if s.measured_rows < s.piece_rows else ranged[t])
                 if t in ranged else inp.table_batches(s, lengths[t], rng) for t, s in enumerate(specs)]
    for t in range(len(specs)):
        if _replica_of(replicas, t):  # a replica serves its device's share of the batch
            share = inp.replica_share(B, _replica_of(replicas, t))
            per_table[t] = [inp.keep_samples(i, ln, share) for i, ln in per_table[t]]
    batches = []
    for j in range(cfg.num_batches):
        idx = np.concatenate([pt[j][0] for pt in per_table]).astype(np.int64, copy=False)
        lens = np.concatenate([pt[j][1] for pt in per_table]).astype(np.int64, copy=False)
        batches.append((idx, lens))
    return ShardInputs(rows=[int(r) for r in scaled], dims=[int(d) for d in dims], row_scale=row_scale,
                       batch_size=B, batches=batches, bytes_per_element=[int(b) for b in bpe])


def time_inputs(inputs: ShardInputs, cfg: BenchConfig, where: str = "shard") -> dict:
    """Build the fused op of a shard from its inputs (weights in the tables' precision) and time it: fwd/bwd
    compute medians, spread, row_scale and the weights precision measured."""
    import torch

    from . import backends

    op = batches = grad = None
    precision = backends.precision_label(inputs.bytes_per_element or [4])
    try:
        op = backends.build(cfg.backend, inputs.rows, inputs.dims, cfg.device, inputs.bytes_per_element)
        if hasattr(op, "prepare_concat"):
            batches = [op.prepare_concat(i, ln, cfg.device) for i, ln in inputs.batches]
        else:
            batches = [op.prepare(inputs.per_table(j), cfg.device) for j in range(len(inputs.batches))]
        grad = torch.ones(inputs.batch_size, int(sum(inputs.dims)), dtype=torch.float32, device=cfg.device)
        fwd, bwd = backends.time_iterations(op, batches, grad, cfg.warmup, cfg.iterations, cfg.timer,
                                            min_time_ms=(cfg.min_time_ms if cfg.min_time_ms is not None
                                                         else DEFAULT_MIN_TIME_MS[_kind(cfg.device)]))
    except (torch.OutOfMemoryError, MemoryError) as exc:
        raise EmbshardError(f"out of memory while measuring ({first_line(exc, 100)})", path=where,
                            fix="lower --max-shard-gb (rows are scaled to fit it) or --batch-size") from None
    finally:
        op = batches = grad = None
        if cfg.device != "cpu":
            torch.cuda.empty_cache()
    total = fwd + bwd
    q75, q25 = np.percentile(total, [75, 25])
    stat = np.min if cfg.statistic == "min" else np.median
    return {"iterations": int(len(fwd)), "fwd_compute_ms": float(stat(fwd)),
            "bwd_compute_ms": float(stat(bwd)), "row_scale": inputs.row_scale,
            "spread": float((q75 - q25) / max(np.median(total), 1e-9)), "weights_precision": precision}


def _comm(cfg: BenchConfig, sum_dims: int, num_devices: int, grad_bytes=(), replica_dims: int = 0) -> dict:
    """The all-to-all of `sum_dims`-wide outputs (fwd and bwd) and, for replicas, one all-reduce per replica of its
    gradient (`grad_bytes`, one entry per replica; bwd; `allreduce_ms`). Measured among the comm group's ranks
    when it exists, else the comm model (bench.comm). `replica_a2a_ms`: what the replicas' `replica_dims` would
    add to the fwd + bwd all-to-all if they were whole tables (what the cost model's comm head charges them;
    costmodel.data takes it back from the comm target, with the all-reduce)."""
    from .comm import allreduce_numel, group_numel

    B = cfg.batch_size
    nd = int(num_devices)
    grads = [float(g) for g in np.atleast_1d(np.asarray(grad_bytes, dtype=np.float64))]
    a2a_all = 0.0
    if cfg.comm_group is not None:
        group = cfg.comm_group

        def a2a(width: int) -> float:
            numel = group_numel(B, width, nd, group.world)
            return float(np.median(group.all_to_all_ms(numel))) if numel else 0.0

        # Among the group's ranks, each sending what a device of the shard's nd-device task sends.
        f_comm, b_comm = a2a(sum_dims), a2a(sum_dims)
        ar = 0.0
        for g in grads:
            n = allreduce_numel(g, nd, group.world)
            ar += float(np.median(group.all_reduce_ms(n))) if n else 0.0
        if replica_dims:
            a2a_all = a2a(sum_dims + replica_dims) + a2a(sum_dims + replica_dims)
    else:
        assert cfg.comm is not None  # make_config sets comm or comm_group
        f_comm = b_comm = cfg.comm.time_ms(B, sum_dims, nd)
        ar = float(sum(cfg.comm.allreduce_ms(g, nd) for g in grads))
        if replica_dims:
            a2a_all = 2.0 * cfg.comm.time_ms(B, sum_dims + replica_dims, nd)
    return {"fwd_comm_ms": f_comm, "bwd_comm_ms": b_comm + ar, "allreduce_ms": ar, "num_devices": nd,
            "replica_a2a_ms": max(a2a_all - f_comm - b_comm, 0.0) if replica_dims else 0.0}


def measure_shard(tables: TableSet, members, cfg: BenchConfig, *, num_devices: int, col_sizes=None,
                  where: str = "shard", inputs: ShardInputs | None = None, row_ranges=None,
                  replicas=None) -> dict:
    """Measure one device shard (positions `members` into `tables`; pieces: `col_sizes`, `row_ranges`,
    `replicas` as shard_inputs takes them); returns the measured numbers. The communication counts each piece's
    output width (bench.comm: a column slice col_size, a row range the full dim of its partial sums); a replica
    sends no outputs but all-reduces its full gradient (rows x dim x bytes per element) in the backward (`allreduce_ms`,
    one all-reduce per replica, as costmodel.scoring prices it).
    `inputs`: the shard's inputs made beforehand (e.g. by a worker process), else made here."""
    from .comm import replica_grad_bytes

    if inputs is None:
        inputs = shard_inputs(tables, members, cfg, col_sizes, where, row_ranges, replicas)
    m = time_inputs(inputs, cfg, where)
    members = np.asarray(members, dtype=np.int64)
    reps = [k for k in range(len(members)) if _replica_of(replicas, k)]
    rep_dims = int(sum(inputs.dims[k] for k in reps))
    grads = [replica_grad_bytes(int(tables.rows[members[k]]), int(tables.dims[members[k]]),
                                int(tables.bytes_per_element[members[k]])) for k in reps]
    m.update(_comm(cfg, int(sum(inputs.dims)) - rep_dims, num_devices, grads, rep_dims))
    return m


# Input workers: on a GPU the host work of making a shard's batches (numpy, seconds at batch 65,536) dominates
# the timing itself, so worker processes make the next shards' inputs while the main process times the current
# one. CPU timing keeps them off by default (they would compete for the cores being measured).
def input_workers(device: str) -> int:
    raw = os.environ.get("EMBSHARD_BENCH_WORKERS")
    if raw is not None:
        try:
            n = int(raw)
        except ValueError:
            raise EmbshardError(f"EMBSHARD_BENCH_WORKERS={raw!r}", field="EMBSHARD_BENCH_WORKERS",
                                fix="set it to an integer >= 0") from None
        return max(n, 0)
    if device == "cpu":
        return 0
    from ..hardware import usable_cpus

    return max(1, min(12, usable_cpus() - 2))  # the pod's CPUs, not the node's


def _job(job: tuple) -> tuple:
    """(members, col_sizes, where, row_ranges, replicas) of a prefetcher job (the last two optional: None)."""
    return (*job, *([None] * (5 - len(job))))


class InputPrefetcher:
    """Makes shard inputs ahead in `workers` helper processes; `get(k)` returns job k's ShardInputs, in order.
    With 0 workers it makes them in-process on demand.

    The helpers are fresh interpreters running `python -m embshard.bench.input_worker` (not multiprocessing: its
    spawn re-imports the parent's entry script, which under an Airflow task is `airflow` itself). Job k goes to
    helper k % workers as one JSON line (a job is (members, col_sizes, where[, row_ranges])); each helper answers
    its jobs in order with the path of an uncompressed
    .npz in a temporary folder (deleted on close)."""

    def __init__(self, tables: TableSet, cfg: BenchConfig, jobs: list, workers: int, ahead: int | None = None):
        self.tables, self.cfg, self.jobs = tables, cfg, jobs
        self.procs: list = []
        self.next = 0
        self.workers = workers if workers > 0 and len(jobs) > 1 else 0
        if self.workers:
            import pickle
            import subprocess
            import sys
            import tempfile

            self.tmp = tempfile.mkdtemp(prefix="embshard-inputs-")
            state = os.path.join(self.tmp, "state.pkl")
            with open(state, "wb") as f:
                # The config itself, without the communication (a worker only makes inputs; a group holds processes).
                pickle.dump({"tables": tables, "cfg": dataclasses.replace(cfg, comm=None, comm_group=None)}, f)
            self.procs = [subprocess.Popen([sys.executable, "-m", "embshard.bench.input_worker", state],
                                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
                          for _ in range(self.workers)]
            self.ahead = ahead or 2 * self.workers
            self._fill()

    def _fill(self, done: int = 0) -> None:
        import json

        while self.next < len(self.jobs) and self.next - done < self.ahead:
            k = self.next
            members, cols, where, ranges, reps = _job(self.jobs[k])
            job = {"replicas": None if reps is None else [int(r) for r in reps],
                   "members": [int(m) for m in members], "cols": None if cols is None else [
                None if c is None else int(c) for c in cols], "where": where,
                "rows": None if ranges is None else [None if r is None else [int(r[0]), int(r[1])] for r in ranges],
                "path": os.path.join(self.tmp, f"{k:06d}.npz")}
            self.procs[k % self.workers].stdin.write(json.dumps(job) + "\n")
            self.procs[k % self.workers].stdin.flush()
            self.next += 1

    def get(self, k: int) -> ShardInputs:
        members, cols, where, ranges, reps = _job(self.jobs[k])
        if not self.workers:
            return shard_inputs(self.tables, members, self.cfg, cols, where, ranges, reps)
        answer = self.procs[k % self.workers].stdout.readline().strip()
        if not answer.startswith("ok "):
            raise EmbshardError(f"an input worker failed on {where}: {answer or 'it exited'}", field="shards",
                                fix="rerun with EMBSHARD_BENCH_WORKERS=0 to see the error in-process")
        path = answer[3:]
        try:
            return ShardInputs.load(path)
        finally:
            os.remove(path)
            self._fill(done=k + 1)

    def close(self) -> None:
        for p in self.procs:
            with contextlib.suppress(OSError):
                p.stdin.close()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except Exception:
                p.kill()
                p.wait()
        if self.procs:
            import shutil

            shutil.rmtree(self.tmp, ignore_errors=True)
        self.procs = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def measure_placement(placement, settings: MeasureSettings | None = None) -> pd.DataFrame:
    """Measure every device of `placement` (one fused op per device shard; a column slice is measured as a
    table of dim=col_size, a row range as bench.inputs says). One row per device: device, table_ids, fwd/bwd
    compute and comm ms (a replica's all-reduce in bwd_comm_ms, also alone in allreduce_ms), total_ms (an empty
    device costs 0), plus hardware, backend, comm_source, row_scale."""
    cfg = make_config(settings or MeasureSettings())
    rows = []
    device_shards = placement.device_shards()
    busy = [d for d, shards in enumerate(device_shards) if shards]
    jobs: list[tuple] = []  # (members, col_sizes, where, row_ranges, replicas)
    for d in busy:
        cols, ranges = piece_args(device_shards[d])
        jobs.append(([s.table for s in device_shards[d]], cols, f"{placement.task_id}/device {d}", ranges,
                     replica_args(device_shards[d], placement.num_devices)))
    try:
        with InputPrefetcher(placement.tables, cfg, jobs, input_workers(cfg.device) if len(jobs) > 1 else 0) as pre:
            for d, shards in enumerate(device_shards):
                ids = [str(placement.tables.table_ids[s.table]) for s in shards]
                if not shards:
                    m: dict = {k: 0.0 for k in ("fwd_compute_ms", "bwd_compute_ms", "fwd_comm_ms", "bwd_comm_ms")}
                    m.update(row_scale=1.0, spread=0.0, weights_precision="")
                else:
                    k = busy.index(d)
                    m = measure_shard(placement.tables, jobs[k][0], cfg, num_devices=placement.num_devices,
                                      col_sizes=jobs[k][1], where=jobs[k][2], inputs=pre.get(k),
                                      row_ranges=jobs[k][3], replicas=jobs[k][4])
                rows.append({"device": d, "table_ids": ids, **{k: m[k] for k in (
                    "fwd_compute_ms", "bwd_compute_ms", "fwd_comm_ms", "bwd_comm_ms")},
                    "allreduce_ms": m.get("allreduce_ms", 0.0),
                    "total_ms": m["fwd_compute_ms"] + m["bwd_compute_ms"] + m["fwd_comm_ms"] + m["bwd_comm_ms"],
                    "hardware": cfg.hardware, "cache_bytes": cfg.cache_bytes, "backend": cfg.backend,
                    "comm_source": cfg.comm_source,
                    "row_scale": m["row_scale"], "spread": m["spread"],
                    "weights_precision": m["weights_precision"]})
    finally:
        close_config(cfg)
    return pd.DataFrame(rows)
