"""Benchmark stage: measure fused device-shard costs (compute and communication) into costs/part-*.parquet.

`run(...)` is the stage entry point (CLI: `embshard bench`); `measure_placement(...)` measures the devices of a
Placement in-process; `sampler` chooses the shards. torch/FBGEMM are imported only when measuring.
"""
from .runner import measure_placement, run

__all__ = ["run", "measure_placement"]
