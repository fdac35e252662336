"""The communication formulas shared by the benchmark (bench.comm, which measures and calibrates) and the cost
model's scorer (costmodel.scoring, which prices replicas): the all-to-all of pooled outputs and the ring
all-reduce of a replica's gradient, each latency + bytes / bandwidth (bench.comm's docstring says which bytes).
Imports nothing of the project, so the algorithms may use it without depending on the benchmark.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# A GPU pod has one GPU and cannot measure NCCL; these are typical effective per-GPU all-to-all numbers of an
# NVLink node (documented assumption, recorded as the model's source).
NVLINK_DEFAULT = {"latency_s": 30e-6, "bandwidth_Bps": 100e9}


@dataclass(frozen=True)
class CommModel:
    latency_s: float
    bandwidth_Bps: float
    source: str  # how the constants were obtained
    spread: float = 0.0  # largest relative range of either constant over the calibration's repeats
    busy_cores: float = 0.0  # cores other processes kept busy just before a CPU calibration (bench.comm)

    def time_ms(self, batch_size: int, sum_dims: int, num_devices: int) -> float:
        if num_devices <= 1 or sum_dims <= 0:
            return 0.0
        return 1e3 * (self.latency_s + exchanged_bytes(batch_size, sum_dims, num_devices) / self.bandwidth_Bps)

    def allreduce_ms(self, grad_bytes, num_devices: int):
        """A ring all-reduce of `grad_bytes` over `num_devices` devices (a replica's gradient; bench.comm); of
        each of an array of gradients too."""
        if isinstance(grad_bytes, np.ndarray):
            ms = 1e3 * (self.latency_s + allreduce_bytes(grad_bytes, num_devices) / self.bandwidth_Bps)
            return np.where((grad_bytes > 0) & (num_devices > 1), ms, 0.0)
        if num_devices <= 1 or grad_bytes <= 0:
            return 0.0
        return 1e3 * (self.latency_s + allreduce_bytes(grad_bytes, num_devices) / self.bandwidth_Bps)


def allreduce_bytes(grad_bytes, num_devices: int):
    """Bytes each device sends in a ring all-reduce of `grad_bytes` (a number or an array): 2 (D-1)/D of them."""
    g = grad_bytes if isinstance(grad_bytes, np.ndarray) else float(grad_bytes)
    return 2.0 * g * (num_devices - 1) / num_devices if num_devices > 1 else 0.0 * g


def replica_grad_bytes(rows, dim, bytes_per_element=4):
    """The dense gradient of a replica (or of each of arrays of them), all-reduced every step (bench.comm), in the
    table's own precision (a data-parallel table's gradient has its weights' type: 2 bytes for FP16)."""
    if isinstance(rows, np.ndarray):
        return (rows.astype(np.float64) * np.asarray(dim, dtype=np.float64)
                * np.asarray(bytes_per_element, dtype=np.float64))
    return float(rows) * float(dim) * float(bytes_per_element)


def allreduce_numel(grad_bytes: float, num_devices: int, world: int) -> int:
    """Floats of an all_reduce among `world` ranks in which each rank moves what a device of a `num_devices`-device
    ring all-reduce of `grad_bytes` moves (0 when there is nothing to reduce)."""
    if num_devices <= 1 or grad_bytes <= 0:
        return 0
    return int(math.ceil(grad_bytes / 4.0 * ((num_devices - 1) / num_devices) / ((world - 1) / world)))


def exchanged_bytes(batch_size: int, sum_dims: int, num_devices: int) -> float:
    return batch_size * sum_dims * 4.0 * (num_devices - 1) / num_devices
