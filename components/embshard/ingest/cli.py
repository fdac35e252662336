"""`embshard ingest`: tables from DLRM traces, a table-spec file or the synthetic generator -> tables.parquet."""
from __future__ import annotations

import argparse


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--source", required=True, choices=["dlrm", "spec", "synthetic"],
                   help="dlrm: a .pt/.pt.gz trace (Meta's open format); spec: a CSV/Parquet/YAML table list "
                        "with TorchRec's names; synthetic: a seeded DLRM-like population")
    p.add_argument("--input", help="the trace or spec file (dlrm, spec)")
    p.add_argument("--out", required=True, help="output folder; writes OUT/tables.parquet")
    p.add_argument("--seed", type=int, default=0, help="seed of every random choice (default 0)")
    p.add_argument("--num-tables", type=int, default=None,
                   help="synthetic: how many tables (default 856); dlrm: read only the first N")
    g = p.add_argument_group("dlrm traces (they carry no dims or hash sizes)")
    g.add_argument("--dim", default="mixed",
                   help="embedding dim of every table, or 'mixed' = a seeded draw from the synthetic mix "
                        "4..256 (default)")
    g.add_argument("--data-type", default="fp32", choices=["fp32", "fp16"],
                   help="weight type, dlrm and synthetic (default fp32)")
    g.add_argument("--rows-file", help="hash sizes, one integer per table (default: max index + 1)")
    g = p.add_argument_group("synthetic")
    g.add_argument("--write-traces", action="store_true",
                   help="also write OUT/traces.pt (DLRM format) and take pooling and bins from it, so the "
                        "benchmark replays the same indices")
    g.add_argument("--trace-batch-size", type=int, default=4096, help="samples per table in traces.pt")
    g.add_argument("--trace-layout", default="flat", choices=["flat", "per_table", "per_table_cumulative"],
                   help="offsets layout of traces.pt (default flat, as the open dataset)")
    g.add_argument("--bins-batch-size", type=int, default=None,
                   help="synthetic/spec: samples in the batch the access bins are computed on (default 65536)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def main(args: argparse.Namespace) -> int:
    from .. import schemas
    from . import run

    kw: dict = {"progress": not args.no_progress}
    if args.source == "dlrm":
        kw.update(dim=args.dim, data_type=args.data_type, rows_file=args.rows_file)
    elif args.source == "synthetic":
        kw.update(write_traces=args.write_traces, trace_batch_size=args.trace_batch_size,
                  trace_layout=args.trace_layout, bins_batch_size=args.bins_batch_size,
                  bytes_per_element=4 if args.data_type == "fp32" else 2)
    else:
        kw.update(bins_batch_size=args.bins_batch_size)
    path = run(args.source, args.out, input=args.input, seed=args.seed, num_tables=args.num_tables, **kw)
    df = schemas.read(path, "tables")
    gib = df["size_bytes"].sum() / 2**30
    print(f"wrote {path}: {len(df)} tables, {gib:,.1f} GiB, rows {df['rows'].min():,}..{df['rows'].max():,}, "
          f"dims {df['dim'].min()}..{df['dim'].max()}, pooling {df['pooling_factor'].mean():.2f} mean "
          f"(source {df['source'].iloc[0].split(';')[0]})")
    return 0
