"""Measuring device shards: kernels (backends), inputs, the all-to-all (comm), shard sampling (sampler), the
measurement protocol (runner) and the fingerprint that makes a benchmark folder resumable. The benchmark stage
that writes costs/part-*.parquet is embshard.jobs.bench. torch/FBGEMM are imported only when measuring.
"""
from .runner import measure_placement

__all__ = ["measure_placement"]
