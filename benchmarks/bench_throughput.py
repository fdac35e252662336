"""Benchmark-stage throughput and repeatability on this machine (CPU, FBGEMM, 1 thread, defaults).

    python benchmarks/bench_throughput.py [--quick] [--tables N] [--repeat-shards 30]

Prints measurements per minute for random shards of 1, 5 and 15 tables (wall time of a whole measurement:
input generation, building the fused op, warm-up and timed iterations), and the repeatability: the same shards
measured twice (separately built ops, same inputs), p50/p90 of |a - b| / mean(a, b) of fwd+bwd compute.
Target: p90 <= 5%.
"""
from __future__ import annotations

import argparse
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer shards (smoke run)")
    ap.add_argument("--tables", type=int, default=200, help="synthetic table pool")
    ap.add_argument("--repeat-shards", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=None)
    args = ap.parse_args()

    from embshard.bench import runner
    from embshard.ingest.synthetic import generate_tables
    from embshard.tableset import TableSet

    ts = TableSet.from_frame(generate_tables(args.tables, seed=0, bins_batch_size=8192))
    cfg = runner.make_config(runner.MeasureSettings(batch_size=args.batch_size, comm_bandwidth_gbps=1.0,
                                                   comm_latency_us=100.0))
    print(f"hardware {cfg.hardware}, backend {cfg.backend}, batch {cfg.batch_size}, threads {cfg.threads}, "
          f"timer {cfg.timer}, {cfg.warmup}+{cfg.iterations} iterations, budget {cfg.budget_bytes / 2**30:.1f} GiB")
    rng = np.random.default_rng(0)
    per_size = 3 if args.quick else 8
    for k in (1, 5, 15):
        shards = [rng.choice(len(ts), k, replace=False) for _ in range(per_size)]
        t0 = time.perf_counter()
        costs, scales = [], []
        for s in shards:
            m = runner.measure_shard(ts, s, cfg, num_devices=4)
            costs.append(m["fwd_compute_ms"] + m["bwd_compute_ms"])
            scales.append(m["row_scale"])
        dt = time.perf_counter() - t0
        print(f"{k:2d} tables: {60 * per_size / dt:6.1f} measurements/min ({dt / per_size:.2f} s each); "
              f"compute median {np.median(costs):.2f} ms; row-scaled {sum(x < 1 for x in scales)}/{per_size}")

    n = 8 if args.quick else args.repeat_shards
    shards = [rng.choice(len(ts), int(rng.integers(1, 16)), replace=False) for _ in range(n)]
    first = [runner.measure_shard(ts, s, cfg, num_devices=4) for s in shards]
    second = [runner.measure_shard(ts, s, cfg, num_devices=4) for s in shards]
    rel = []
    for a, b in zip(first, second):
        x, y = a["fwd_compute_ms"] + a["bwd_compute_ms"], b["fwd_compute_ms"] + b["bwd_compute_ms"]
        rel.append(abs(x - y) / ((x + y) / 2))
    rel = np.asarray(rel)
    print(f"repeatability over {n} shards (1..15 tables) measured twice: relative difference "
          f"p50 {100 * np.median(rel):.1f}%, p90 {100 * np.quantile(rel, 0.9):.1f}%, max {100 * rel.max():.1f}% "
          f"(target p90 <= 5%)")


if __name__ == "__main__":
    main()
