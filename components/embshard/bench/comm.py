"""Communication cost of a device shard: the all-to-all of its pooled outputs (forward) and their gradients
(backward).

A device with S = sum of its tables' dims sends, per step, B x S x 4 bytes x (D-1)/D to the other D-1 devices
(each sample's pooled vectors go to the device that owns the sample); the backward all-to-all moves the same
bytes back as gradients.

By shard kind (docs/contracts.md, "Shard kinds"), S counts each piece's output width: a whole table its dim, a
column slice its col_size (narrower vectors), a row range its full dim. A row range sends partial pooled sums of
every sample of the batch, reduced across the table's pieces (a reduce-scatter, TorchRec's row-wise output
dist): a ring reduce-scatter moves the same B x dim x 4 x (D-1)/D bytes per device as the all-to-all of a whole
table of that dim, so both paths count a row piece as an all-to-all of dim-wide vectors. The reduction itself
(D-1 adds per output element, B x dim floats) is not timed: on the measured path this is an approximation (an
all_to_all_single of the same size stands in for the reduce-scatter), small next to the transfer.

A replica (kind 'replicated', TorchRec's data_parallel) sends no pooled outputs (each device looks up its own
B/D samples in its full copy), so its dim is left out of S; instead its gradient is all-reduced over the D
devices every step: G = rows x dim x bytes per element (dense gradients of the weights' type), of which a ring
all-reduce moves 2 x (D-1)/D x G per device (reduce-scatter then all-gather). One all-reduce per replica (its
latency paid per replica, as costmodel.scoring prices it; TorchRec's DDP may bucket small ones), counted in the
backward comm:
- model: latency + 2 (D-1)/D G / bandwidth, with the same calibrated constants as the all-to-all
  (`CommModel.allreduce_ms`; the all-to-all's calibration stands in for the all-reduce's: one ring step
  moves bytes between the same processes or GPUs);
- measured (a comm group exists): a real `all_reduce` among the group's W ranks of the size that makes each
  rank move what a device of the D-device task moves (`allreduce_numel`); its latency is that of W ranks.

- measured (comm_source='measured'): `CommGroup(n)` starts n-1 helper processes
  (`python -m embshard.bench.comm_rank`); with the main process they form
  a torch.distributed group (gloo on CPU, NCCL on GPUs) and time real `all_to_all_single` calls of that size.
  Every rank exchanges a tensor of the measured shard's size (the symmetric case).
- model (comm_source='model'): time = latency + bytes / bandwidth. Latency and bandwidth come from
  `calibrate()` (a 2-process gloo all-to-all at several sizes, least-squares fit; cached per hardware in
  DIR/comm_calibration.json so every chunk of a run uses the same constants, and per process), from given
  numbers (arguments, or EMBSHARD_COMM_BANDWIDTH_GBPS / EMBSHARD_COMM_LATENCY_US), or on CUDA without peers
  from documented constants (NVLINK_DEFAULT).
"""
from __future__ import annotations

import json
import logging
import math
import os
import socket
import subprocess
import sys
import time
from dataclasses import asdict

import numpy as np

from .. import storage
from ..collectives import (  # noqa: F401  (the formulas live beside the cost model; re-exported here)
    NVLINK_DEFAULT,
    CommModel,
    allreduce_bytes,
    allreduce_numel,
    exchanged_bytes,
    replica_grad_bytes,
)
from ..errors import EmbshardError

log = logging.getLogger(__name__)

CALIBRATION_FILE = "comm_calibration.json"
_PROCESS_CACHE: dict[str, CommModel] = {}  # calibrations made by this process, per hardware
OP_ALL_TO_ALL, OP_ALL_REDUCE = 0, 1  # the collectives a CommGroup times (comm_rank runs the same)
_CALIBRATION_SIZES = [1 << 8, 1 << 20, 1 << 22]  # floats per rank: latency-bound to bandwidth-bound


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class CommGroup:
    """The main process (rank 0) plus n-1 helper processes in one torch.distributed group."""

    def __init__(self, world_size: int, device: str = "cpu", timeout_s: float = 120.0):
        import datetime

        import torch
        import torch.distributed as dist

        if world_size < 2:
            raise EmbshardError(f"{world_size} communication ranks", field="comm_ranks",
                                fix="use at least 2 ranks, or leave it unset to use the comm model")
        if dist.is_initialized():
            raise EmbshardError("a torch.distributed group already exists in this process", field="comm_ranks",
                                fix="run the benchmark in its own process")
        on_gpu = device != "cpu"
        if on_gpu and torch.cuda.device_count() < world_size:
            raise EmbshardError(f"{world_size} NCCL ranks need {world_size} GPUs, this host has "
                                f"{torch.cuda.device_count()}", field="comm_ranks",
                                fix="lower --comm-ranks or use the comm model")
        self.world, self.device = world_size, ("cuda:0" if on_gpu else "cpu")
        backend = "nccl" if on_gpu else "gloo"
        port = _free_port()
        # Helper ranks are fresh interpreters running a small module (see comm_rank: why not multiprocessing).
        self.procs = [subprocess.Popen([sys.executable, "-m", "embshard.bench.comm_rank", "--rank", str(r),
                                        "--world", str(world_size), "--port", str(port), "--backend", backend,
                                        "--device", device, "--timeout-s", str(timeout_s)],
                                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
                      for r in range(1, world_size)]
        try:
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=world_size,
                                    timeout=datetime.timedelta(seconds=timeout_s))
        except Exception:
            for p in self.procs:  # no orphans when the group never forms
                p.kill()
                p.wait()
            raise
        self.backend = backend

    def all_to_all_ms(self, numel: int, warmup: int = 3, iterations: int = 10) -> np.ndarray:
        """Wall ms of each timed all_to_all_single of `numel` floats per rank (rounded up to a multiple of n)."""
        return self._timed(OP_ALL_TO_ALL, numel, warmup, iterations)

    def all_reduce_ms(self, numel: int, warmup: int = 3, iterations: int = 10) -> np.ndarray:
        """Wall ms of each timed all_reduce (sum) of `numel` floats per rank (a replica's gradient)."""
        return self._timed(OP_ALL_REDUCE, numel, warmup, iterations)

    def _timed(self, op: int, numel: int, warmup: int, iterations: int) -> np.ndarray:
        import torch
        import torch.distributed as dist

        numel = max(self.world, -(-int(numel) // self.world) * self.world)
        dist.broadcast(torch.tensor([numel, warmup, iterations, op], dtype=torch.int64, device=self.device), src=0)
        x = torch.ones(numel, dtype=torch.float32, device=self.device)
        y = torch.empty_like(x)
        times = []
        for it in range(warmup + iterations):
            if self.device != "cpu":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            if op == OP_ALL_REDUCE:
                dist.all_reduce(x)
            else:
                dist.all_to_all_single(y, x)
            if self.device != "cpu":
                torch.cuda.synchronize()
            if it >= warmup:
                times.append((time.perf_counter() - t0) * 1e3)
        return np.asarray(times)

    def close(self) -> None:
        import torch
        import torch.distributed as dist

        if not dist.is_initialized():
            return
        try:
            dist.broadcast(torch.zeros(4, dtype=torch.int64, device=self.device), src=0)
        finally:
            dist.destroy_process_group()
            for p in self.procs:
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def measured_ranks(device: str) -> int | None:
    """Ranks among which a measurement on `device` times the all-to-all for real: every GPU of a multi-GPU host
    (NCCL), None on one GPU or the CPU (the formula: NVLink constants, or the calibrated gloo model)."""
    from .backends import gpu_count

    n = gpu_count(device)
    return n if n >= 2 else None


def group_numel(batch_size: int, sum_dims: int, num_devices: int, world: int) -> int:
    """Floats per rank of an all-to-all among `world` ranks in which each rank sends off-rank the bytes that a
    device of a `num_devices`-device task sends (exchanged_bytes): the shard's own traffic, whatever the pod's
    GPU count. 0 when the task has one device (no all-to-all)."""
    if num_devices <= 1 or sum_dims <= 0:
        return 0
    return int(math.ceil(batch_size * sum_dims * (num_devices - 1) / num_devices * world / (world - 1)))


QUIET_WAIT_S = 10.0  # how long a CPU calibration waits for other processes to leave it the cores it needs


def busy_cores(seconds: float = 0.5) -> float | None:
    """Cores kept busy by every process (this one sleeps meanwhile) over `seconds`, from /proc/stat; None where
    it cannot be read (not Linux)."""
    def sample() -> tuple[int, int]:
        with open("/proc/stat", encoding="ascii") as f:
            v = [int(x) for x in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
        return sum(v), v[3] + v[4]

    try:
        t0, i0 = sample()
        time.sleep(seconds)
        t1, i1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    if t1 <= t0:
        return 0.0
    return max(0.0, 1.0 - (i1 - i0) / (t1 - t0)) * (os.cpu_count() or 1)


def busy_limit(world_size: int = 2) -> float:
    """Other processes' load (cores) from which a calibration among `world_size` local ranks is flagged: when it
    leaves them less than world_size - 0.5 free cores (on 2 cores: anything above half a core)."""
    return max(0.5, (os.cpu_count() or 1) - world_size + 0.5)


def wait_for_quiet(world_size: int = 2, max_wait_s: float = QUIET_WAIT_S) -> float:
    """The other processes' load (cores) once it is below busy_limit, or after `max_wait_s`: a gloo calibration
    on a busy 2-core machine reads the load, not the machine (pipeline runs stored 0.66-1.48 GB/s, quiet
    calibrations read 1.7-2.0: benchmarks/results/comm_calibration.md), and every later run inherits it."""
    deadline = time.monotonic() + max_wait_s
    while True:
        busy = busy_cores()
        if busy is None:
            return 0.0
        if busy < busy_limit(world_size) or time.monotonic() >= deadline:
            return busy


def calibrate(world_size: int = 2, repeats: int = 3, device: str = "cpu") -> CommModel:
    """Latency = the smallest all-to-all's median time; bandwidth = the slope between the smallest and the
    largest (all-to-alls between local processes, gloo on the CPU or NCCL among GPUs, medians of 7). Done
    `repeats` times: the constants are the medians, `spread` the largest relative range (how far a single
    calibration can be trusted)."""
    # Other processes' load first: it slows the gloo all-to-all on a small machine (recorded, warned about).
    busy = wait_for_quiet(world_size) if device == "cpu" else 0.0
    lat, bw = [], []
    with CommGroup(world_size, device) as group:
        for _ in range(max(1, repeats)):
            xs, ys = [], []
            for numel in _CALIBRATION_SIZES:
                ms = float(np.median(group.all_to_all_ms(numel, warmup=2, iterations=7)))
                xs.append(numel * 4.0 * (world_size - 1) / world_size)
                ys.append(ms / 1e3)
            dt = ys[-1] - ys[0]
            bw.append((xs[-1] - xs[0]) / dt if dt > 0 else xs[-1] / ys[-1])
            lat.append(max(ys[0], 1e-6))
    spread = max((max(v) - min(v)) / float(np.median(v)) for v in (lat, bw))
    return CommModel(latency_s=float(np.median(lat)), bandwidth_Bps=float(np.median(bw)),
                     source=f"calibrated:{group.backend}-{world_size}proc", spread=float(spread),
                     busy_cores=float(busy))


def model_from_dict(c: dict) -> CommModel:
    """A CommModel from its comm_calibration.json entry (older entries lack spread and busy_cores: 0)."""
    return CommModel(float(c["latency_s"]), float(c["bandwidth_Bps"]), str(c["source"]), float(c.get("spread", 0.0)),
                     float(c.get("busy_cores", 0.0)))


def warn_if_busy(model: CommModel, where: str, fix: str) -> None:
    """One warning when a calibration was made on a busy machine: its all-to-all reads slow, for every run after.
    `fix`: how the caller calibrates again (a pipeline param, or a file to delete before the command)."""
    if model.busy_cores >= busy_limit():
        log.warning("the machine was busy while calibrating the all-to-all (%.1f of %d cores used by other "
                    "processes): its bandwidth (%.2f GB/s) may read low, and %s keeps it (fix: calibrate again on a "
                    "quiet machine: %s)", model.busy_cores, os.cpu_count() or 1,
                    model.bandwidth_Bps / 1e9, where, fix)


def calibration_mismatch(trained: dict | None, current: CommModel, tolerance: float = 0.25) -> str | None:
    """One line when a cost model was priced for another all-to-all than the one this machine's calibration gives
    (bandwidths more than `tolerance` apart, relative), else None: its predicted communication is then off by that
    factor (benchmarks/results/split_runs.md: the same models read 0.767 and 0.543 on two calibrations)."""
    if not trained or float(trained.get("bandwidth_Bps", 0) or 0) <= 0 or current.bandwidth_Bps <= 0:
        return None
    ratio = current.bandwidth_Bps / float(trained["bandwidth_Bps"])
    if abs(math.log(ratio)) <= math.log1p(tolerance):
        return None
    return (f"the cost model was priced for a {float(trained['bandwidth_Bps']) / 1e9:.2f} GB/s all-to-all, this "
            f"machine's calibration ({current.source}) says {current.bandwidth_Bps / 1e9:.2f} GB/s ({ratio:.2f}x): its "
            "predicted communication is off by that much; measured costs use the calibration (fix: retrain on this "
            "calibration, or recalibrate_comm on a quiet machine if the calibration is the odd one)")


def shared_calibration_dir() -> str | None:
    """EMBSHARD_CALIBRATION_DIR: where one calibration per hardware is kept for every run (None: per run)."""
    return os.environ.get("EMBSHARD_CALIBRATION_DIR") or None


def given_calibration_dir(path: str | None, field: str = "calibration_dir") -> str | None:
    """A --calibration-dir as given: None stays None; a local folder that does not exist is an error (a typo would
    otherwise calibrate anew into a new folder, and the runs meant to share one calibration would not)."""
    if path is None or "://" in str(path) or os.path.isdir(path):
        return path
    raise EmbshardError(f"no folder {path!r}", path=str(path), field=field,
                        fix=f"give the folder of a run's {CALIBRATION_FILE} (e.g. a pipeline folder's "
                            "OUT/calibration, or a run's data folder), or create the folder first to calibrate into it")


def describe(device: str) -> str:
    """How a measurement on `device` gets its all-to-all, in words (the stage logs say it)."""
    ranks = measured_ranks(device)
    if ranks is not None:
        return f"the all-to-all is measured with NCCL among this host's {ranks} GPUs"
    if device != "cpu":
        return ("one GPU on this host: the all-to-all cannot be measured, it is the formula with documented "
                "NVLink constants (latency + bytes / bandwidth)")
    return "CPU: the all-to-all is the formula calibrated on a gloo all-to-all between 2 local processes"


def _calibrate_for(device: str) -> CommModel:
    if device == "cpu":
        return calibrate(2)
    if measured_ranks(device) is not None:
        return calibrate(2, device=device)  # NCCL between 2 of the host's GPUs: the formula's constants
    return CommModel(NVLINK_DEFAULT["latency_s"], NVLINK_DEFAULT["bandwidth_Bps"], "constants:nvlink")


def adopt_calibration(run_root: str, hardware: str, *, device: str = "cpu",
                      recalibrate: bool = False) -> CommModel | None:
    """Give a run the shared calibration of this hardware (EMBSHARD_CALIBRATION_DIR): copied into the run root,
    where every measuring stage of the run reads it; calibrated on `device` (and stored for later runs) when
    there is none yet or when `recalibrate` is asked. The cost model trained on the run records it, so model and
    measurements agree on communication across runs. Without a shared folder each run calibrates its own (None).
    On a multi-GPU host the shards' all-to-alls are measured with NCCL; the calibration is then only the record
    (and the formula for the cost model's report)."""
    log.info("communication on %s: %s", hardware, describe(device))
    shared = shared_calibration_dir()
    if shared is None:
        return None
    src, dst = storage.join(shared, CALIBRATION_FILE), storage.join(run_root, CALIBRATION_FILE)
    table: dict = json.loads(storage.read_text(src)) if storage.exists(src) else {}
    if recalibrate or hardware not in table:
        log.info("calibrating the communication model for %s (%s)", hardware,
                 "asked for" if recalibrate else "none stored yet")
        model = _calibrate_for(device)
        warn_if_busy(model, f"every later run of {hardware} (in {shared})",
                     "run the pipeline with --param recalibrate_comm=true")
        table[hardware] = asdict(model)
        storage.write_text(src, json.dumps(table, indent=2))
    model = model_from_dict(table[hardware])
    run_table = json.loads(storage.read_text(dst)) if storage.exists(dst) else {}
    run_table[hardware] = asdict(model)
    storage.write_text(dst, json.dumps(run_table, indent=2))
    log.info("comm model %s: latency %.1f us, bandwidth %.2f GB/s, spread over repeats %.0f%%, other processes"
             " busy on %.1f cores when calibrated", model.source,
             model.latency_s * 1e6, model.bandwidth_Bps / 1e9, 100 * model.spread, model.busy_cores)
    return model


def run_calibration(run_root: str, hardware: str) -> dict | None:
    """The calibration entry a run measured with (its comm_calibration.json), None when it has none."""
    path = storage.join(run_root, CALIBRATION_FILE)
    if not storage.exists(path):
        return None
    return json.loads(storage.read_text(path)).get(hardware)


def comm_model(hardware: str, device: str, *, out: str | None = None, bandwidth_gbps: float | None = None,
               latency_us: float | None = None) -> CommModel:
    """The model a run uses: given numbers, else the run's cached calibration, else calibrate (CPU) or the
    documented NVLink constants (CUDA)."""
    if bandwidth_gbps is None and latency_us is None and os.environ.get("EMBSHARD_COMM_BANDWIDTH_GBPS"):
        # Fixed constants for a whole environment (tests, or hardware known better than a calibration).
        bandwidth_gbps = float(os.environ["EMBSHARD_COMM_BANDWIDTH_GBPS"])
        latency_us = float(os.environ.get("EMBSHARD_COMM_LATENCY_US", "0"))
    if bandwidth_gbps is not None or latency_us is not None:
        if (bandwidth_gbps is None or latency_us is None or not math.isfinite(bandwidth_gbps)
                or not math.isfinite(latency_us) or bandwidth_gbps <= 0 or latency_us < 0):
            raise EmbshardError("give both a bandwidth > 0 and a latency >= 0", field="comm_bandwidth_gbps",
                                fix="pass --comm-bandwidth-gbps and --comm-latency-us together")
        return CommModel(latency_us * 1e-6, bandwidth_gbps * 1e9, source="given")
    path = storage.join(out, CALIBRATION_FILE) if out is not None else None
    if path is None and hardware in _PROCESS_CACHE:
        return _PROCESS_CACHE[hardware]
    cached: dict = {}
    if path is not None and storage.exists(path):
        try:
            cached = json.loads(storage.read_text(path))
        except (ValueError, OSError):
            cached = {}
        if hardware in cached:
            return model_from_dict(cached[hardware])
    if device != "cpu":
        model = CommModel(NVLINK_DEFAULT["latency_s"], NVLINK_DEFAULT["bandwidth_Bps"], "constants:nvlink")
    else:
        log.info("calibrating the communication model (gloo all-to-all between 2 local processes)")
        model = calibrate(2)
        log.info("comm model: latency %.1f us, bandwidth %.2f GB/s", model.latency_s * 1e6,
                 model.bandwidth_Bps / 1e9)
        warn_if_busy(model, "this run" if path is None else f"every command with this output folder ({path})",
                     "run the command again" if path is None else f"delete {path} and run the command again")
    _PROCESS_CACHE[hardware] = model
    if path is not None:
        cached[hardware] = asdict(model)
        storage.write_text(path, json.dumps(cached, indent=2))
    return model
