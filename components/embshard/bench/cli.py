"""`embshard bench`: measure fused device-shard costs into DIR/costs/part-*.parquet."""
from __future__ import annotations

import argparse


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tables", required=True, help="tables.parquet")
    p.add_argument("--shards", default=None,
                   help="a shards Parquet file (sample_id, table_ids, num_devices, origin) or random:N "
                        "(N random shards of 1..15 tables from the train pool)")
    p.add_argument("--placements", default=None, help="placements.parquet: add every device shard of these placements")
    p.add_argument("--tasks", default=None, help="tasks.parquet: the train pool for random:N, device counts for --placements")
    p.add_argument("--out", required=True, help="run folder; parts go to OUT/costs/")
    p.add_argument("--backend", default="auto", choices=["auto", "fbgemm", "torch"],
                   help="fused operator: FBGEMM TBE, or torch embedding_bag (auto: FBGEMM when it runs)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--batch-size", type=int, default=None, help="samples per batch (default: 2048 on CPU, 65536 on GPU)")
    p.add_argument("--chunk", type=int, default=None, help="measure only this chunk (a pod runs one); default: all")
    p.add_argument("--num-chunks", type=int, default=1, help="shard i belongs to chunk i %% num-chunks")
    p.add_argument("--num-devices", type=int, default=4, help="devices of random shards' tasks (comm model)")
    p.add_argument("--max-tables", type=int, default=15, help="largest random shard")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--iterations", type=int, default=None, help="timed iterations (>= 10; default 15 CPU, 20 GPU)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up iterations (default 5)")
    p.add_argument("--max-shard-gb", type=float, default=None,
                   help="memory one measurement may use; larger shards get their biggest tables' rows capped "
                        "(default 2 on CPU, 80%% of free memory on GPU)")
    p.add_argument("--timer", default="auto", choices=["auto", "wall", "thread_cpu"],
                   help="CPU clock (auto: thread CPU time at 1 thread, else wall)")
    p.add_argument("--comm-ranks", type=int, default=None,
                   help="measure the all-to-all for real among N local ranks (gloo on CPU, NCCL on GPUs)")
    p.add_argument("--comm-bandwidth-gbps", type=float, default=None, help="comm model bandwidth (GB/s), skips calibration")
    p.add_argument("--comm-latency-us", type=float, default=None, help="comm model latency (us), with the bandwidth")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def main(args: argparse.Namespace) -> int:
    from .runner import run

    parts = run(args.tables, args.shards, args.out, backend=args.backend, device=args.device,
                batch_size=args.batch_size, num_devices=args.num_devices, chunk=args.chunk,
                num_chunks=args.num_chunks, tasks=args.tasks, placements=args.placements, seed=args.seed,
                warmup=args.warmup, iterations=args.iterations, max_shard_gb=args.max_shard_gb, timer=args.timer,
                comm_ranks=args.comm_ranks, comm_bandwidth_gbps=args.comm_bandwidth_gbps,
                comm_latency_us=args.comm_latency_us, max_tables=args.max_tables, progress=not args.no_progress)
    if parts:
        import pandas as pd

        from .. import schemas

        df = pd.concat([schemas.read(p, "costs") for p in parts], ignore_index=True)
        total = df["fwd_compute_ms"] + df["bwd_compute_ms"] + df["fwd_comm_ms"] + df["bwd_comm_ms"]
        print(f"{len(df)} shards in {len(parts)} part(s) under {args.out}/costs: total cost median "
              f"{total.median():.2f} ms (min {total.min():.2f}, max {total.max():.2f}); "
              f"{df['backend'].iloc[0]} on {df['hardware'].iloc[0]}, comm {df['comm_source'].iloc[0]}")
    else:
        print("nothing to measure in this chunk")
    return 0
