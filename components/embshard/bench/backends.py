"""The fused operators a device shard is measured with, backend selection, and the timers.

- fbgemm: FBGEMM's table-batched embedding bag (SplitTableBatchedEmbeddingBagsCodegen) over all tables of the
  shard: SUM pooling, exact SGD (the backward pass computes the gradient and updates the rows, as in training),
  no bounds check (inputs are valid by construction). Weights in the tables' own precision (`bytes_per_element`
  4 = FP32, 2 = FP16; output FP32 either way, FBGEMM's default). One TBE op takes one weights precision, so a
  shard mixing FP16 and FP32 tables runs one op per precision, timed together as the device's fused work (as
  TorchRec groups tables by data type into one TBE each).
- torch: for hosts with torch but no FBGEMM. One fused `embedding_bag` over the shard's tables concatenated
  row-wise; tables of different dims (or precisions) cannot share one weight matrix without padding (which would
  charge a dim-4 table for the bytes of a dim-256 one), so a shard with k distinct (dim, precision) pairs runs k
  fused calls. FP16 weights are float16 tensors (CPU and CUDA), pooled outputs cast to FP32 like FBGEMM's.
  Backward: sparse gradients + the exact-SGD row update (index_add_).

Timers: CUDA events on GPU. On CPU with one intra-op thread (the default, EMBSHARD_NUM_THREADS=1) the thread's
CPU time: the kernels run on the calling thread, and CPU time does not count the time the OS gives to other
processes on a shared machine, which makes re-measurements far more repeatable than wall time. With more threads,
wall time (perf_counter).
"""
from __future__ import annotations

import logging
import os
import platform
import time
from functools import lru_cache

import numpy as np

from ..errors import BackendUnavailableError, EmbshardError, first_line

log = logging.getLogger(__name__)

BACKENDS = ("auto", "fbgemm", "torch")
LEARNING_RATE = 0.01
# Bytes per weight -> the precision measured (tables.bytes_per_element; the schema admits only these two).
PRECISIONS = {4: "fp32", 2: "fp16"}
_TBE_MODULE = "fbgemm_gpu.split_table_batched_embeddings_ops_training"


def num_threads() -> int:
    """Intra-op threads for CPU measurements (EMBSHARD_NUM_THREADS, default 1: repeatability over speed)."""
    raw = os.environ.get("EMBSHARD_NUM_THREADS", "1")
    try:
        n = int(raw)
    except ValueError:
        raise EmbshardError(f"EMBSHARD_NUM_THREADS={raw!r}", field="EMBSHARD_NUM_THREADS",
                            fix="set it to a positive integer") from None
    if n < 1:
        raise EmbshardError(f"EMBSHARD_NUM_THREADS={n}", field="EMBSHARD_NUM_THREADS", fix="use >= 1")
    return n




def check_device(device: str) -> str:
    """'cpu' or 'cuda[:N]'; a clear error when CUDA is asked for and absent (never a silent CPU measurement)."""
    import torch

    if device == "cpu":
        return device
    if device == "cuda" or device.startswith("cuda:"):
        if not torch.cuda.is_available():
            raise BackendUnavailableError(f"device {device!r} was asked for but CUDA is not available on this "
                                          f"machine ({cuda_absence()})", field="device",
                                          fix="use device cpu (or auto), or run on a GPU host with a CUDA build "
                                              "of torch")
        index = device.split(":", 1)[1] if ":" in device else "0"
        if not index.isdigit() or int(index) >= torch.cuda.device_count():
            raise EmbshardError(f"device {device!r}: this machine has {torch.cuda.device_count()} GPU(s)",
                                field="device", fix="use cuda, or cuda:N with N below the GPU count")
        return device
    raise EmbshardError(f"unknown device {device!r}", field="device", fix="use auto, cpu, cuda or cuda:N")


def cuda_absence() -> str:
    """Why torch sees no CUDA device, in words."""
    import torch

    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU build"
    return "no GPU is visible to this process"


def resolve_device(device: str = "auto") -> str:
    """The device a measurement runs on: 'auto' is the first GPU when this machine has one, else the CPU;
    'cpu' and 'cuda[:N]' are checked (cuda without a GPU is an error, never the CPU in disguise)."""
    if device == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return check_device(device)


def check_target(model_hardware: str, target: str | None, planning: bool = False) -> str | None:
    """The one-line warning when a model measured on `model_hardware` is used for `target` (a --hardware value;
    None: this machine, its GPU if it has one, else its CPU); None when they agree. `planning`: it chooses a plan."""
    from ..hardware import mismatch_warning

    if target is None:
        return mismatch_warning(model_hardware, hardware(resolve_device("auto")), asked=False, planning=planning)
    return mismatch_warning(model_hardware, target, asked=True, planning=planning)


def gpu_count(device: str) -> int:
    """GPUs this process sees when measuring on `device` (0 on the CPU)."""
    if device == "cpu":
        return 0
    import torch

    return int(torch.cuda.device_count())


def _load_tbe():
    import importlib

    from ..imports import root_logging_kept

    with root_logging_kept():  # fbgemm_gpu's import-time logging.info configures the root logger
        return importlib.import_module(_TBE_MODULE)


def fbgemm_status(device: str) -> str | None:
    """None when FBGEMM's TBE runs on `device`, else the reason it does not."""
    try:
        _load_tbe()
    except Exception as exc:  # ImportError, or an OSError/RuntimeError from a mismatched binary
        return f"fbgemm_gpu does not load ({type(exc).__name__}: {first_line(exc)})"
    if device != "cpu":
        return _fbgemm_cuda_status(device)
    return None


@lru_cache(maxsize=4)
def _fbgemm_cuda_status(device: str) -> str | None:
    # fbgemm-gpu-cpu imports fine on a GPU host but has no CUDA kernels: try a tiny op.
    try:
        op = FbgemmShard([10], [4], device)
        import torch

        out = op.forward((torch.zeros(1, dtype=torch.int64, device=device),
                          torch.tensor([0, 1], dtype=torch.int64, device=device)))
        out.sum().item()
        return None
    except Exception as exc:
        return f"FBGEMM has no working CUDA kernels here ({type(exc).__name__}: {first_line(exc)})"


def select_backend(backend: str, device: str) -> str:
    """The backend to measure with: 'fbgemm' or 'torch'. A forced backend that cannot run is an error."""
    if backend not in BACKENDS:
        raise EmbshardError(f"unknown backend {backend!r}", field="backend", fix="use auto, fbgemm or torch")
    device = check_device(device)
    if backend == "torch":
        return "torch"
    reason = fbgemm_status(device)
    if reason is None:
        return "fbgemm"
    if backend == "fbgemm":
        raise BackendUnavailableError(
            f"backend 'fbgemm' was forced but cannot run on {device}: {reason}", field="backend",
            fix="install fbgemm-gpu-cpu==1.8.0 (CPU) or fbgemm-gpu (CUDA) matching torch, or use --backend auto|torch")
    log.info("FBGEMM unavailable on %s (%s): measuring with the torch backend", device, reason)
    return "torch"


@lru_cache(maxsize=4)
def hardware(device: str) -> str:
    """'cpu:<model name>' or 'cuda:<device name>'."""
    if device == "cpu":
        name = ""
        try:
            with open("/proc/cpuinfo", encoding="utf-8") as f:
                for line in f:
                    if line.startswith("model name"):
                        name = line.split(":", 1)[1].strip()
                        break
        except OSError:
            pass
        return f"cpu:{name or platform.processor() or platform.machine()}"
    import torch

    return f"cuda:{torch.cuda.get_device_name(torch.device(device))}"


def precision(bytes_per_element) -> str:
    """'fp32' or 'fp16' for a table's bytes_per_element; anything else is refused (never measured as FP32)."""
    try:
        return PRECISIONS[int(bytes_per_element)]
    except (KeyError, TypeError, ValueError):
        raise EmbshardError(f"{bytes_per_element}-byte weights cannot be measured", field="bytes_per_element",
                            fix="use 4 (fp32) or 2 (fp16) and re-ingest the tables") from None


def precision_label(bytes_per_element) -> str:
    """What a shard was measured in: 'fp32', 'fp16', or 'fp16+fp32' for a mixed shard."""
    return "+".join(sorted({precision(b) for b in bytes_per_element}))


def _groups(bytes_per_element, n: int) -> list[tuple[str, list[int]]]:
    """(precision, table positions) per precision present, FP32 first."""
    bpe = [4] * n if bytes_per_element is None else [int(b) for b in bytes_per_element]
    names = [precision(b) for b in bpe]
    return [(p, [i for i, x in enumerate(names) if x == p]) for p in ("fp32", "fp16") if p in names]


class FbgemmShard:
    """FBGEMM TBE ops over the shard's tables, one per weights precision present (one op for a single-precision
    shard). Inputs: (indices, offsets) over T*B bags, table-major; a mixed shard's inputs are split per op."""

    backend = "fbgemm"

    def __init__(self, rows: list[int], dims: list[int], device: str, bytes_per_element: list[int] | None = None):
        import torch

        m = _load_tbe()
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode

        on_gpu = device != "cpu"
        loc = m.EmbeddingLocation.DEVICE if on_gpu else m.EmbeddingLocation.HOST
        comp = m.ComputeDevice.CUDA if on_gpu else m.ComputeDevice.CPU
        sparse = {"fp32": m.SparseType.FP32, "fp16": m.SparseType.FP16}
        self.groups = _groups(bytes_per_element, len(rows))
        self.num_tables = len(rows)
        self.ops = []
        # FBGEMM logs every constructor argument at INFO on the root logger: keep the CLI output readable.
        previous = logging.root.manager.disable
        logging.disable(logging.INFO)
        try:
            for prec, members in self.groups:
                self.ops.append(m.SplitTableBatchedEmbeddingBagsCodegen(
                    [(int(rows[i]), int(dims[i]), loc, comp) for i in members],
                    optimizer=m.OptimType.EXACT_SGD, learning_rate=LEARNING_RATE, pooling_mode=m.PoolingMode.SUM,
                    weights_precision=sparse[prec], bounds_check_mode=BoundsCheckMode.NONE,
                    device=torch.device(device)))
        finally:
            logging.disable(previous)
        self.op = self.ops[0]
        # Host weights are zero-filled lazily (calloc): touch every page now so page faults stay out of timings.
        with torch.no_grad():
            for op in self.ops:
                for name in ("weights_host", "weights_dev"):
                    w = getattr(op, name, None)
                    if w is not None and w.numel() > 0:
                        w.fill_(1e-3)

    @property
    def precision(self) -> str:
        return "+".join(sorted(p for p, _ in self.groups))

    def prepare(self, per_table: list[tuple[np.ndarray, np.ndarray]], device: str):
        indices = np.concatenate([i for i, _ in per_table]) if per_table else np.zeros(0, np.int64)
        lengths = np.concatenate([lens for _, lens in per_table])
        return self.prepare_concat(indices, lengths, device)

    def prepare_concat(self, indices: np.ndarray, lengths: np.ndarray, device: str):
        """The same inputs as `prepare`, from indices and lengths already concatenated table-major; a mixed
        shard gets one (indices, offsets) pair per op."""
        import torch

        def pair(idx, lens):
            offsets = np.zeros(len(lens) + 1, dtype=np.int64)
            np.cumsum(lens, out=offsets[1:])
            return (torch.from_numpy(np.ascontiguousarray(idx, dtype=np.int64)).to(device),
                    torch.from_numpy(offsets).to(device))

        if len(self.ops) == 1:
            return pair(indices, lengths)
        B = len(lengths) // self.num_tables
        per = [lengths[t * B:(t + 1) * B] for t in range(self.num_tables)]
        cut = np.concatenate([[0], np.cumsum([int(x.sum()) for x in per])])
        return [pair(np.concatenate([indices[cut[t]:cut[t + 1]] for t in members]),
                     np.concatenate([per[t] for t in members])) for _, members in self.groups]

    def forward(self, batch):
        if len(self.ops) == 1:
            return self.op(batch[0], batch[1])
        import torch

        return torch.cat([op(i, o) for op, (i, o) in zip(self.ops, batch)], dim=1)

    def backward(self, out, grad) -> None:
        out.backward(grad)  # exact SGD: the row update happens inside the backward kernel


class TorchShard:
    """Fused torch.nn.functional.embedding_bag calls, one per distinct dim (see module doc)."""

    backend = "torch"

    def __init__(self, rows: list[int], dims: list[int], device: str, bytes_per_element: list[int] | None = None):
        import torch

        self.device = device
        self.groups: list[tuple[list[int], int]] = []  # (table positions, dim)
        dtypes = []
        for prec, same in _groups(bytes_per_element, len(rows)):
            for d in sorted(set(int(dims[i]) for i in same)):
                self.groups.append(([i for i in same if int(dims[i]) == d], d))
                dtypes.append(torch.float16 if prec == "fp16" else torch.float32)
        self.precision = "+".join(sorted({"fp16" if t == torch.float16 else "fp32" for t in dtypes}))
        self.row_offsets: dict[int, int] = {}
        self.weights = []
        for (members, d), dtype in zip(self.groups, dtypes):
            off = 0
            for i in members:
                self.row_offsets[i] = off
                off += int(rows[i])
            w = torch.full((off, d), 1e-3, dtype=dtype, device=device)  # materialised, like FBGEMM's
            self.weights.append(w.requires_grad_(True))

    def prepare(self, per_table: list[tuple[np.ndarray, np.ndarray]], device: str):
        import torch

        out = []
        for members, _ in self.groups:
            idx = np.concatenate([per_table[i][0] + self.row_offsets[i] for i in members])
            lens = np.concatenate([per_table[i][1] for i in members])
            offs = np.concatenate([[0], np.cumsum(lens)])  # include_last_offset layout
            out.append((torch.from_numpy(idx.astype(np.int64)).to(device),
                        torch.from_numpy(offs.astype(np.int64)).to(device), len(members)))
        return out

    def forward(self, batch):
        import torch
        import torch.nn.functional as F

        parts = []
        for w, (idx, offs, t) in zip(self.weights, batch):
            pooled = F.embedding_bag(idx, w, offs, mode="sum", sparse=True, include_last_offset=True)
            if pooled.dtype != torch.float32:
                pooled = pooled.float()  # FP32 outputs, as FBGEMM returns for FP16 weights
            b = pooled.shape[0] // t
            # (T*B, d) table-major -> (B, T*d), the layout FBGEMM returns.
            parts.append(pooled.view(t, b, -1).permute(1, 0, 2).reshape(b, -1))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    def backward(self, out, grad) -> None:
        import torch

        out.backward(grad)
        with torch.no_grad():
            for w in self.weights:
                g = w.grad
                if g is not None:
                    g = g.coalesce() if g.is_sparse else g
                    if g.is_sparse:
                        w.index_add_(0, g.indices()[0], g.values(), alpha=-LEARNING_RATE)
                    else:
                        w.add_(g, alpha=-LEARNING_RATE)
                w.grad = None


def build(backend: str, rows: list[int], dims: list[int], device: str, bytes_per_element: list[int] | None = None):
    """The fused op(s) of one device shard, weights in each table's precision (default FP32)."""
    if device == "cpu":
        recycle_host_memory()
    return (FbgemmShard if backend == "fbgemm" else TorchShard)(rows, dims, device, bytes_per_element)


# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4


@lru_cache(maxsize=1)
def recycle_host_memory() -> bool:
    """Keep freed host memory in the process heap (glibc), so the next shard's weights reuse pages already mapped.

    Each shard builds its operator afresh, and FBGEMM zero-fills up to the measurement's memory budget. Served by
    fresh mmap'd pages, that costs a page fault and a kernel clear per 4 KiB page: ~130 ms per 256 MiB operator,
    most of a CPU round's build time. From recycled heap pages it is ~40 ms. The timed work is unchanged: every
    page is touched before timing either way (measured: reuse / fresh per-shard compute median 1.01 over 12
    shards, inside the process-to-process spread of 0.95-1.21). Process-wide and irreversible, so only measuring
    code calls it; a no-op (False) off glibc.
    """
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
    except (OSError, AttributeError):
        return False


def resolve_timer(timer: str, device: str, threads: int) -> str:
    if timer == "auto":
        if device != "cpu":
            return "cuda_events"
        return "thread_cpu" if threads == 1 else "wall"
    if timer not in ("wall", "thread_cpu", "cuda_events"):
        raise EmbshardError(f"unknown timer {timer!r}", field="timer", fix="use auto, wall or thread_cpu")
    if timer == "cuda_events" and device == "cpu":
        raise EmbshardError("cuda_events timer on cpu", field="timer", fix="use auto, wall or thread_cpu")
    if timer == "thread_cpu" and threads != 1:
        raise EmbshardError(f"thread_cpu timer with {threads} threads counts one thread only", field="timer",
                            fix="set EMBSHARD_NUM_THREADS=1 or use --timer wall")
    return timer


def time_iterations(op, batches: list, grad, warmup: int, iterations: int, timer: str,
                    min_time_ms: float = 0.0, max_iterations: int = 200) -> tuple[np.ndarray, np.ndarray]:
    """(fwd_ms, bwd_ms) of each timed iteration; batches are cycled so caches see rotating inputs.

    At least `iterations` are timed, and more (up to `max_iterations`) until the timed work reaches
    `min_time_ms`: a cheap shard's median then rests on many samples instead of ten noisy ones.
    """
    import torch

    fwd: list[float] = []
    bwd: list[float] = []
    n = len(batches)
    it = 0
    while True:
        timed = it - warmup
        if timed >= iterations and (timed >= max_iterations or sum(fwd) + sum(bwd) >= min_time_ms):
            break
        batch = batches[it % n]
        if timer == "cuda_events":
            e0, e1, e2 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
            e0.record()
            out = op.forward(batch)
            e1.record()
            op.backward(out, grad)
            e2.record()
            torch.cuda.synchronize()
            f, b = e0.elapsed_time(e1), e1.elapsed_time(e2)
        else:
            clock = time.thread_time_ns if timer == "thread_cpu" else time.perf_counter_ns
            t0 = clock()
            out = op.forward(batch)
            t1 = clock()
            op.backward(out, grad)
            t2 = clock()
            f, b = (t1 - t0) / 1e6, (t2 - t1) / 1e6
        del out
        if it >= warmup:
            fwd.append(f)
            bwd.append(b)
        it += 1
    return np.asarray(fwd), np.asarray(bwd)
