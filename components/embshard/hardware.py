"""The memory hierarchy of the machine a measurement ran on: what the cost model compares working sets with.

A device shard's kernels are memory-bound: whether the rows a batch touches fit in the last-level cache (CPU
L3, GPU L2) decides much of their cost. The benchmark records `cache_bytes` with every measured row; models
trained on those rows carry it (embshard.costmodel), so the hardware enters the model.
"""
from __future__ import annotations

import glob
import logging
import os

log = logging.getLogger(__name__)

# L2 of GPUs by name (bytes), for measurements recorded before `cache_bytes` existed (no device to ask then).
KNOWN_GPU_L2 = {"H100": 50 * 2**20, "H200": 50 * 2**20, "A100": 40 * 2**20, "L4": 48 * 2**20,
                "V100": 6 * 2**20, "T4": 4 * 2**20}
FALLBACK_CACHE_BYTES = 32 * 2**20


def _parse_size(text: str) -> int | None:
    text = text.strip().upper()
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    try:
        if text and text[-1] in units:
            return int(float(text[:-1]) * units[text[-1]])
        return int(text)
    except ValueError:
        return None


def usable_cpus(cgroup_root: str = "/sys/fs/cgroup") -> int:
    """The CPUs this process may use: os.cpu_count() is the node's in a container, so also its CPU affinity and
    its cgroup's CPU limit (a Kubernetes pod limited to 8 CPUs on a 96-core node has 8)."""
    import math

    n = os.cpu_count() or 1
    if hasattr(os, "sched_getaffinity"):
        n = min(n, len(os.sched_getaffinity(0)) or n)
    for path, parse in ((os.path.join(cgroup_root, "cpu.max"), lambda t: t.split()[:2]),  # cgroup v2: "quota period"
                        (os.path.join(cgroup_root, "cpu", "cpu.cfs_quota_us"), None)):    # cgroup v1
        try:
            with open(path) as f:
                text = f.read().strip()
            if parse is not None:
                quota, period = parse(text)
            else:
                with open(os.path.join(cgroup_root, "cpu", "cpu.cfs_period_us")) as f:
                    quota, period = text, f.read().strip()
            if quota not in ("max", "-1") and int(period) > 0:
                return max(1, min(n, math.ceil(int(quota) / int(period))))
        except (OSError, ValueError):
            continue
    return n


def cpu_last_level_cache() -> int | None:
    """Bytes of the largest cache level of CPU 0 (sysfs), None where the kernel does not say."""
    best: tuple[int, int] | None = None
    for folder in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*"):
        try:
            with open(os.path.join(folder, "level"), encoding="utf-8") as f:
                level = int(f.read())
            with open(os.path.join(folder, "size"), encoding="utf-8") as f:
                size = _parse_size(f.read())
        except (OSError, ValueError):
            continue
        if size and (best is None or level > best[0]):
            best = (level, size)
    return best[1] if best else None


def device_cache_bytes(device: str) -> int:
    """The last-level cache of the device measurements run on: GPU L2 from the driver, CPU L3 from sysfs."""
    if device.startswith("cuda"):
        import torch

        props = torch.cuda.get_device_properties(torch.device(device))
        size = int(getattr(props, "L2_cache_size", 0) or 0)
        if size > 0:
            return size
        return cache_bytes_of(f"cuda:{props.name}")
    return cpu_last_level_cache() or FALLBACK_CACHE_BYTES


def cache_bytes_of(hardware: str) -> int:
    """Best guess from a recorded hardware name ('cpu:<model>' or 'cuda:<name>') for rows without cache_bytes:
    a known GPU's L2; for CPUs this machine's cache (the rows were most likely measured here)."""
    if hardware.startswith("cuda"):
        for name, size in KNOWN_GPU_L2.items():
            if name in hardware:
                return size
        log.warning("unknown GPU %r: assuming a %d MiB L2", hardware, FALLBACK_CACHE_BYTES >> 20)
        return FALLBACK_CACHE_BYTES
    return cpu_last_level_cache() or FALLBACK_CACHE_BYTES


def same_hardware(a: str, b: str) -> bool:
    """Whether two hardware tags name the same kind of device ('cuda:NVIDIA H100' matches 'cuda:NVIDIA H100 80GB
    HBM3': a user may give the short name)."""
    a, b = " ".join(a.lower().split()), " ".join(b.lower().split())
    return bool(a and b) and (a.startswith(b) or b.startswith(a))


def mismatch_warning(model_hardware: str, target: str, *, asked: bool, planning: bool = False,
                     source: str | None = None) -> str | None:
    """One line when a model measured on one hardware is asked to plan or predict for another (None when they
    agree or the model does not say). `asked`: the target came from --hardware (or `source`, e.g. a
    DeviceTopology's hardware), else from this machine. `planning`: the model chooses a plan (embshard place), so
    the line also says that its cuts are the model's."""
    if not model_hardware or not target or same_hardware(model_hardware, target):
        return None
    source = source or ("--hardware" if asked else "this machine")
    # Which cuts pay differs between machines: a CPU-trained plan measured 1.25x slower on an H100 than the plan it
    # rejected (benchmarks/results/split_runs/run3-branches/gpu-quality-nvidia-h100.md), so the fix names --refine.
    what = "its predicted costs, and so the cuts its plans choose, are" if planning else "its predicted costs are"
    refine = "run `embshard place --refine K` on the target" if planning else ""
    # Naming the target with --hardware is a fix only where the target was this machine.
    more = [m for m in (refine, "" if asked else "pass --hardware to name the target") if m]
    return (f"warning: the model was measured on {model_hardware} but {source} is {target}: {what} for "
            f"{model_hardware} (fix: use a model trained on the target hardware, e.g. a pipeline run with "
            f"device=cuda there{''.join(', ' + m for m in more[:-1])}{' or ' + more[-1] if more else ''})")

