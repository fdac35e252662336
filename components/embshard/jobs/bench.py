"""The benchmark stage (`embshard bench`): measure fused device-shard costs into DIR/costs/part-*.parquet.

Shard i of the (deterministic) shard list belongs to chunk i % num_chunks, so a pod runs exactly one chunk with
the same CLI; each chunk writes DIR/costs/part-{chunk:05d}-of-{num_chunks:05d}.parquet (costs contract). A
finished part is skipped on rerun. Inside a chunk every measured shard is committed at once, atomically, to
DIR/costs/.partial/<part>/<shard index>.parquet (hidden from readers of the costs folder); a killed chunk keeps
those and its rerun measures only the rest; the part is then written from them and the partial folder removed.
A fingerprint of the inputs and settings (bench.fingerprint) decides whether a folder may be resumed.
How one shard is measured (protocol, clocks, caps) is bench.runner's job.
"""
from __future__ import annotations

import argparse
import logging
import os
import re

import numpy as np
import pandas as pd

from .. import schemas, storage
from ..bench import fingerprint
from ..bench.runner import (
    DEFAULT_MAX_SHARD_GB_CPU,
    BenchConfig,
    InputPrefetcher,
    MeasureSettings,
    close_config,
    input_workers,
    make_config,
    measure_shard,
    resolve_settings,
)
from ..bench.sampler import check_pieces, load_shards, piece_lists, replica_list
from ..errors import EmbshardError
from ..tableset import TableSet

log = logging.getLogger(__name__)


def _row(sample_id, table_ids, m: dict, cfg: BenchConfig, origin, chunk) -> dict:
    return {"sample_id": sample_id, "table_ids": list(table_ids), **{k: m[k] for k in (
        "fwd_compute_ms", "bwd_compute_ms", "fwd_comm_ms", "bwd_comm_ms")},
        "hardware": cfg.hardware, "cache_bytes": cfg.cache_bytes, "backend": cfg.backend,
        "batch_size": cfg.batch_size,
        "iterations": m["iterations"], "measured_at": pd.Timestamp.now(tz="UTC"),
        "num_devices": m["num_devices"], "comm_source": cfg.comm_source, "row_scale": m["row_scale"],
        "spread": m["spread"], "origin": origin, "chunk": chunk, "weights_precision": m.get("weights_precision"),
        "timer": cfg.timer, "num_threads": cfg.threads, "comm_model": cfg.comm_detail}


_PART = re.compile(r"^part-(\d{5})-of-(\d{5})\.parquet$")


def part_name(chunk: int, num_chunks: int) -> str:
    return f"part-{chunk:05d}-of-{num_chunks:05d}.parquet"


def _tableset(tables) -> TableSet:
    if isinstance(tables, TableSet):
        return tables
    if isinstance(tables, pd.DataFrame):
        return TableSet.from_frame(tables, "<tables>")
    return TableSet.read(tables)


def run(tables, shards, out: str, settings: MeasureSettings | None = None, *, num_devices: int = 4,
        chunk: int | None = None, num_chunks: int = 1, tasks: str | None = None, placements: str | None = None,
        max_tables: int = 15, progress: bool = True, replace_changed: bool = False) -> list[str]:
    """Measure the shards of chunk `chunk` (all chunks when None) into DIR/costs; returns the part files of the
    chunks handled (written now or finished before). See the module doc for chunking and resuming.
    `settings`: how to measure (its seed also draws random shards and the measuring order); the communication
    calibration is read from (or written to) settings.calibration_dir, by default OUT. `replace_changed`: a costs
    folder measured with other inputs or settings is deleted and measured again, not refused (for a folder the
    pipeline owns, e.g. an outer-loop round re-run after the round before it was retrained)."""
    from tqdm.auto import tqdm

    settings = settings or MeasureSettings()
    if settings.calibration_dir is None:
        settings = settings.replace(calibration_dir=out)
    seed = settings.seed

    ts = _tableset(tables)
    shard_df = load_shards(shards, table_ids=list(ts.table_ids), tasks=tasks, placements=placements,
                           num_devices=num_devices, seed=seed, max_tables=max_tables)
    where = shards if isinstance(shards, str) and not shards.startswith("random:") else "shards"
    members = [ts.index_of(list(ids), where=where) for ids in shard_df["table_ids"]]
    pieces = [piece_lists(shard_df, i) for i in range(len(shard_df))]  # (col_sizes, row_ranges) per shard
    check_pieces(ts, members, pieces, shard_df, where)
    if num_chunks < 1:
        raise EmbshardError(f"num_chunks={num_chunks}", field="num_chunks", fix="use num_chunks >= 1")
    if chunk is not None and not 0 <= chunk < num_chunks:
        raise EmbshardError(f"chunk {chunk} of {num_chunks}", field="chunk",
                            fix=f"use a chunk in 0..{num_chunks - 1}")
    costs_dir = storage.join(out, "costs")
    # Same inputs and settings, or no resuming: the fingerprint decides before anything is measured or skipped.
    # The same keys as before the settings object (a folder measured then still resumes).
    fp = {"tables_sha256": fingerprint.tables_hash(ts), "shards_sha256": fingerprint.shards_hash(shard_df),
          "num_shards": len(shard_df), **resolve_settings(settings), "seed": int(seed),
          "comm": {"ranks": settings.comm_ranks, "bandwidth_gbps": settings.comm_bandwidth_gbps,
                   "latency_us": settings.comm_latency_us}}
    if replace_changed and storage.exists(costs_dir) and not fingerprint.matches(costs_dir, fp):
        log.info("%s was measured with other inputs or settings (an earlier try): measuring again", costs_dir)
        storage.remove_dir(costs_dir)
    _check_chunking(costs_dir, num_chunks)
    has_results = bool(storage.list_files(costs_dir, ".parquet")) or storage.exists(storage.join(costs_dir, ".partial"))
    fp_pending = fingerprint.check_or_adopt(costs_dir, fp, has_results)
    chunks = [chunk] if chunk is not None else list(range(num_chunks))
    piece_cols = [c for c in schemas.PIECE_COLUMNS if c in shard_df.columns]

    # What is left to do, before any heavy setup.
    plan: list[tuple[int, str, str, list[int], set[int]]] = []
    done_parts: list[str] = []
    for c in chunks:
        part = storage.join(costs_dir, part_name(c, num_chunks))
        idx = [i for i in range(len(shard_df)) if i % num_chunks == c]
        if storage.exists(part):
            why = schemas.unreadable(part, "costs")
            if why is None:
                done_parts.append(part)
                continue
            # Writes are atomic, so only something outside (a disk, a hand edit) breaks a finished chunk: measure
            # it again rather than resume a file every later stage would refuse.
            log.warning("finished chunk %d cannot be read (%s): measuring it again", c, why)
            storage.remove(part)
        if not idx:
            log.info("chunk %d of %d has no shards", c, num_chunks)
            continue
        partial = storage.join(costs_dir, ".partial", part_name(c, num_chunks)[:-len(".parquet")])
        finished = set()
        for p in storage.list_files(partial, ".parquet"):
            why = schemas.unreadable(p, "costs")
            if why is None:
                finished.add(_sub_index(p))
            else:
                log.warning("a measured shard of chunk %d cannot be read (%s): measuring it again", c, why)
                storage.remove(p)
        plan.append((c, part, partial, idx, finished))
    todo = sum(len([i for i in idx if i not in fin]) for _, _, _, idx, fin in plan)
    if not plan:
        return done_parts

    cfg = make_config(settings)
    log.info("bench: %d shards to measure on %s (%s, batch %d, %d threads, timer %s, comm %s)", todo,
             cfg.hardware, cfg.backend, cfg.batch_size, cfg.threads, cfg.timer, cfg.comm_detail)
    written = list(done_parts)
    fail_after = int(os.environ.get("EMBSHARD_BENCH_FAIL_AFTER", "-1"))  # test hook: simulate a crash
    measured = 0
    # The measuring order, fixed before anything is measured (input workers make the inputs in this order).
    # A seeded shuffle per chunk: load drifting over a long chunk then spreads over all kinds of shards instead
    # of biasing the ones listed last (e.g. one table pool).
    order: list[tuple[int, int]] = []  # (position in plan, shard index)
    for pi, (c, _part, _partial, idx, finished) in enumerate(plan):
        perm = np.random.default_rng(seed + c).permutation(len(idx))
        order += [(pi, idx[k]) for k in perm if idx[k] not in finished]
    jobs = []
    for _, i in order:
        jobs.append((members[i], pieces[i][0], str(shard_df.iloc[i]["sample_id"]), pieces[i][1],
                     replica_list(shard_df, i)))
    workers = input_workers(cfg.device) if len(jobs) > 1 else 0
    if workers:
        log.info("bench: %d input worker processes", workers)
    try:
        with tqdm(total=todo, unit="shard", desc="bench", disable=not progress, dynamic_ncols=True) as bar, \
                InputPrefetcher(ts, cfg, jobs, workers) as pre:
            k = 0
            for pi, (c, part, partial, idx, _finished) in enumerate(plan):
                while k < len(order) and order[k][0] == pi:
                    i = order[k][1]
                    if measured == fail_after:
                        raise RuntimeError(f"EMBSHARD_BENCH_FAIL_AFTER={fail_after}: simulated crash")
                    s = shard_df.iloc[i]
                    m = measure_shard(ts, members[i], cfg, num_devices=int(s["num_devices"]), col_sizes=jobs[k][1],
                                      where=str(s["sample_id"]), inputs=pre.get(k), row_ranges=jobs[k][3],
                                      replicas=jobs[k][4])
                    row = _row(s["sample_id"], s["table_ids"], m, cfg, s["origin"], c)
                    if jobs[k][4] is not None:  # a replica's comm terms (schemas: costs)
                        row["allreduce_ms"], row["replica_a2a_ms"] = m["allreduce_ms"], m["replica_a2a_ms"]
                    for col in piece_cols:  # the pieces measured travel to the costs row (-1 = whole)
                        v = s[col]
                        row[col] = None if v is None else [int(x) for x in v]
                    if fp_pending:  # with the first result: a failed first shard leaves nothing behind
                        fingerprint.write(costs_dir, fp)
                        fp_pending = False
                    schemas.write(pd.DataFrame([row]), storage.join(partial, f"{i:06d}.parquet"), "costs")
                    measured += 1
                    k += 1
                    bar.update(1)
                    bar.set_postfix_str(f"{len(s['table_ids'])} tables "
                                        f"{m['fwd_compute_ms'] + m['bwd_compute_ms']:.1f} ms", refresh=False)
                written.append(_finish_part(part, partial, idx))
    finally:
        close_config(cfg)
    return sorted(written)


def _sub_index(path: str) -> int:
    return int(os.path.basename(path).split(".")[0])


def _finish_part(part: str, partial: str, idx: list[int]) -> str:
    subs = {_sub_index(p): p for p in storage.list_files(partial, ".parquet")}
    missing = [i for i in idx if i not in subs]
    if missing:
        raise EmbshardError(f"shards {missing[:3]} of this chunk were not measured", path=partial,
                            fix="rerun the same command")
    frames = [schemas.read(subs[i], "costs") for i in idx]
    df = pd.concat(frames, ignore_index=True).drop_duplicates("sample_id", keep="first")
    schemas.write(df, part, "costs")
    fs, p = storage.resolve(partial)
    fs.delete_dir(p)
    return part


def _check_chunking(costs_dir: str, num_chunks: int) -> None:
    for f in storage.list_files(costs_dir, ".parquet"):
        m = _PART.match(os.path.basename(f))
        if m and int(m.group(2)) != num_chunks:
            raise EmbshardError(f"this folder holds parts of a {int(m.group(2))}-chunk run, not {num_chunks}",
                                path=costs_dir, field="num_chunks",
                                fix="rerun with the same --num-chunks (the pipeline's bench_chunks), or write to a new "
                                    "--out")


# What `embshard bench` writes and reads: its --out is checked before any work (cli.check_output).
OUTPUT = {"kind": "folder", "writes": ("costs",), "inputs": ("tables", "shards", "placements", "tasks")}


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tables", required=True, help="tables.parquet")
    p.add_argument("--shards", default=None,
                   help="a shards Parquet file (sample_id, table_ids, num_devices, origin) or random:N "
                        "(N random shards of 1..15 tables from the train pool)")
    p.add_argument("--placements", default=None, help="placements.parquet: add every device shard of these placements")
    p.add_argument("--tasks", default=None,
                   help="tasks.parquet: the train pool for random:N, device counts for --placements")
    p.add_argument("--out", required=True, help="run folder; parts go to OUT/costs/")
    p.add_argument("--backend", default="auto", choices=["auto", "fbgemm", "torch"],
                   help="fused operator: FBGEMM TBE, or torch embedding_bag (auto: FBGEMM when it runs)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--batch-size", type=int, default=None,
                   help="samples per batch (default: 2048 on CPU, 65536 on GPU)")
    p.add_argument("--chunk", type=int, default=None, help="measure only this chunk (a pod runs one); default: all")
    p.add_argument("--num-chunks", type=int, default=1, help="shard i belongs to chunk i %% num-chunks")
    p.add_argument("--num-devices", type=int, default=4, help="devices of random shards' tasks (comm model)")
    p.add_argument("--max-tables", type=int, default=15, help="largest random shard")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--iterations", type=int, default=None, help="timed iterations (>= 10; default 15 CPU, 20 GPU)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up iterations (default 5)")
    p.add_argument("--max-shard-gb", type=float, default=None,
                   help="memory one measurement may use; larger shards get their biggest tables' rows capped "
                        f"(default {DEFAULT_MAX_SHARD_GB_CPU:g} on CPU and at most half the free host memory; "
                        "80%% of free memory on GPU)")
    p.add_argument("--max-table-gb", type=float, default=None,
                   help="also cap each table's weights by itself, whatever shares its shard (default: no such "
                        "cap; the shard's cap above is shared by its tables)")
    p.add_argument("--timer", default="auto", choices=["auto", "wall", "thread_cpu"],
                   help="CPU clock (auto: thread CPU time at 1 thread, else wall)")
    p.add_argument("--comm-ranks", type=int, default=None,
                   help="measure the all-to-all for real among N local ranks (gloo on CPU, NCCL on GPUs)")
    p.add_argument("--comm-bandwidth-gbps", type=float, default=None,
                   help="comm model bandwidth (GB/s), skips calibration")
    p.add_argument("--comm-latency-us", type=float, default=None, help="comm model latency (us), with the bandwidth")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def settings_of(args: argparse.Namespace) -> MeasureSettings:
    """The measuring settings of `embshard bench`'s flags (calibration: the run folder, --out)."""
    return MeasureSettings(backend=args.backend, device=args.device, batch_size=args.batch_size,
                           warmup=args.warmup, iterations=args.iterations, seed=args.seed,
                           max_shard_gb=args.max_shard_gb, max_table_gb=args.max_table_gb, timer=args.timer,
                           calibration_dir=args.out,
                           comm_ranks=args.comm_ranks, comm_bandwidth_gbps=args.comm_bandwidth_gbps,
                           comm_latency_us=args.comm_latency_us)


def main(args: argparse.Namespace) -> int:
    parts = run(args.tables, args.shards, args.out, settings_of(args), num_devices=args.num_devices,
                chunk=args.chunk, num_chunks=args.num_chunks, tasks=args.tasks, placements=args.placements,
                max_tables=args.max_tables, progress=not args.no_progress)
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
