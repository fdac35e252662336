"""The ingest stage (`embshard ingest`): DLRM traces, table-spec files or the synthetic generator ->
DIR/tables.parquet. The readers are in embshard.ingest (dlrm, spec, synthetic); heavy work (torch, the samplers)
is imported inside the functions.
"""
from __future__ import annotations

import argparse
import logging
import os
import re

SOURCES = ("dlrm", "spec", "synthetic")
TABLES_FILE = "tables.parquet"
TRACES_FILE = "traces.pt"


def run(source: str, out: str, input: str | list[str] | None = None, seed: int = 0, num_tables: int | None = None,
        **kw) -> str:
    """Ingest tables from `source` into `<out>/tables.parquet`; returns that path.

    source="synthetic": `num_tables` (default 856) seeded tables; kw `write_traces=True` also writes
      `<out>/traces.pt` in the DLRM format (kw `trace_batch_size`, default 4096; `trace_layout`) and takes
      the pooling factors and bins from those traces, so rows point at them; `bins_batch_size`,
      `bytes_per_element`, `hot_large_fraction`, `fp16_fraction` (about that fraction of the tables in FP16).
    source="dlrm": `input` a .pt/.pt.gz trace, or several files of one trace (a glob pattern, a comma-separated
      list or a list: ingest.dlrm.trace_files); kw `dim` (int or "mixed"), `data_type` ("fp32"/"fp16"),
      `rows_file`; `num_tables` reads only the first N tables.
    source="spec": `input` a CSV/Parquet/YAML table spec; kw `bins_batch_size`.
    kw `progress` (default True) shows a bar over tables. Writes are atomic: on error nothing is left behind.
    """
    from .. import checks, schemas, storage
    from ..errors import EmbshardError

    progress = kw.pop("progress", True)
    seed = checks.seed(seed)
    if kw.get("bins_batch_size") is not None:
        kw["bins_batch_size"] = _positive_int(kw["bins_batch_size"], "bins_batch_size")
    if source not in SOURCES:
        raise EmbshardError(f"unknown source {source!r}", field="source", fix=f"use one of {', '.join(SOURCES)}")
    if source in ("dlrm", "spec") and not input:
        raise EmbshardError(f"--input is required for source {source!r}", field="input",
                            fix="give the trace file (.pt/.pt.gz)" if source == "dlrm"
                            else "give the spec file (.csv/.parquet/.yaml)")
    out_path = storage.join(out, TABLES_FILE)
    local_out = "://" not in os.fspath(out) or os.fspath(out).startswith("file://")
    traces_written = None  # synthetic --write-traces: (the traces at a temporary name, where they go)
    if source == "synthetic":
        df, traces_written = _synthetic(out, seed, 856 if num_tables is None else int(num_tables), progress,
                                        local_out, kw)
    elif source == "dlrm":
        from ..ingest.dlrm import TraceOptions, remove_stale_temps, tables_from_trace, temp_tag

        opts = TraceOptions(dim=kw.pop("dim", "mixed"), data_type=kw.pop("data_type", "fp32"),
                            rows_file=kw.pop("rows_file", None), seed=seed, num_tables=num_tables,
                            # a .pt.gz is decompressed beside the output (a big file; /tmp may be small)
                            tmp_dir=kw.pop("tmp_dir", None) or (storage.existing_folder(
                                os.fspath(out).removeprefix("file://")) if local_out else None),
                            tmp_tag=temp_tag(out_path))
        _no_extra(kw)
        if opts.tmp_dir and opts.tmp_tag:  # a killed ingest into this output may have left its decompressed copy
            remove_stale_temps(opts.tmp_dir, opts.tmp_tag)
        assert input is not None  # required for dlrm, checked above
        df = tables_from_trace(input, opts, progress=progress)
    else:
        from ..ingest.spec import tables_from_spec

        batch = kw.pop("bins_batch_size", None)
        _no_extra(kw)
        assert input is not None  # required for spec, checked above
        if isinstance(input, (list, tuple)):
            if len(input) != 1:
                raise EmbshardError(f"{len(input)} files given; a spec is one file", field="input",
                                    fix="give one spec file (several are read only as files of one dlrm trace)")
            input = input[0]
        df = tables_from_spec(input, seed=seed, bins_batch_size=batch, progress=progress)
    from .. import pools

    df = df.assign(pool=pools.assign(df["table_id"], seed))  # decided once, here (see embshard.pools)
    # Tasks sampled from the tables this ingest replaces go first: killed after it, the old tables stand alone (their
    # tasks had been left beside the new tables, and `place --tasks` planned them).
    _drop_stale_tasks(out)
    if traces_written is not None:
        # The traces and the tables that point at them are one pair: the old tables go before the new traces take
        # their name, so that a kill in between leaves no tables rather than old tables over new traces (which
        # `bench` had measured without a word).
        tmp, final = traces_written
        try:
            storage.remove(out_path)
            os.replace(tmp, final)
        except BaseException:
            if os.path.exists(tmp):
                os.remove(tmp)
            raise
    schemas.write(df, out_path, "tables")
    # Here, not in main: the pipeline's ingest stage calls run() (ids TorchRec cannot name fail only at export).
    from ..torchrec_compat import warn_if_unnamable

    warn_if_unnamable(df["table_id"], logging.getLogger(__name__))
    return out_path


def _drop_stale_tasks(out: str) -> None:
    """Tasks sampled from the tables this ingest replaced name tables that may no longer exist: remove them."""
    from .. import schemas, storage

    stale = storage.join(out, schemas.TASKS_FILE)
    if storage.exists(stale):
        fs, p = storage.resolve(stale)
        fs.delete_file(p)
        logging.getLogger(__name__).warning("removed %s: it was sampled from the tables this ingest replaced; "
                                            "run `embshard tasks` again", stale)


def _positive_int(value, field: str, default: int = 65536) -> int:
    from ..errors import EmbshardError

    try:
        ok = float(value).is_integer() and int(value) >= 1
    except (TypeError, ValueError, OverflowError):
        ok = False
    if not ok:
        raise EmbshardError(f"invalid value {value!r}", field=field, fix=f"give an integer >= 1 (default {default})")
    return int(value)


def _no_extra(kw: dict) -> None:
    from ..errors import EmbshardError

    if kw:
        name = sorted(kw)[0]
        raise EmbshardError("option does not apply to this source", field=name, fix=f"drop '{name}'")


def _synthetic(out: str, seed: int, num_tables: int, progress: bool, local_out: bool, kw: dict):
    from ..errors import EmbshardError
    from ..ingest.synthetic import BINS_BATCH_SIZE, generate_tables, write_dlrm_traces

    write_traces = bool(kw.pop("write_traces", False))
    trace_batch = _positive_int(kw.pop("trace_batch_size", 4096), "trace_batch_size", default=4096)
    layout = kw.pop("trace_layout", "flat")
    bins_batch = int(kw.pop("bins_batch_size", None) or BINS_BATCH_SIZE)
    bpe = int(kw.pop("bytes_per_element", 4))
    hot_large = float(kw.pop("hot_large_fraction", 0.0))
    fp16 = float(kw.pop("fp16_fraction", 0.0))
    _no_extra(kw)
    df = generate_tables(num_tables, seed=seed, bytes_per_element=bpe,
                         bins_batch_size=trace_batch if write_traces else bins_batch, hot_large_fraction=hot_large,
                         fp16_fraction=fp16)
    if not write_traces:
        return df, None
    if not local_out:
        raise EmbshardError("traces can only be written to a local folder", field="out",
                            fix="use a local --out, or drop --write-traces")
    import uuid

    from ..ingest.dlrm import tables_from_trace

    out_dir = os.fspath(out).removeprefix("file://")
    os.makedirs(out_dir, exist_ok=True)
    trace_path = os.path.join(out_dir, TRACES_FILE)
    # Written beside its final name and moved there with the tables (run): a killed ingest had left new traces
    # beside the old tables.
    tmp = os.path.join(out_dir, f".{TRACES_FILE}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        write_dlrm_traces(df, tmp, batch_size=trace_batch, seed=seed, layout=layout)
        # Features from the very indices the benchmark will replay; shapes stay the generator's.
        traced = tables_from_trace(
            tmp, rows=df["rows"].to_numpy(), dims=df["dim"].to_numpy(), table_ids=list(df["table_id"]),
            source=f"synthetic:seed={seed};traces={TRACES_FILE};batch={trace_batch};layout={layout}",
            progress=progress)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    traced["trace_file"] = os.path.abspath(trace_path)  # where the traces will be (read here at their temp name)
    traced["bytes_per_element"] = df["bytes_per_element"].to_numpy()  # per table (fp16_fraction)
    traced["size_bytes"] = traced["rows"] * traced["dim"] * traced["bytes_per_element"]
    traced["zipf_alpha"] = df["zipf_alpha"].to_numpy()
    return traced, (tmp, trace_path)


# --- `embshard ingest` --------------------------------------------------------------------------
# What `embshard ingest` writes and reads: its --out is checked before any work (cli.check_output).
OUTPUT = {"kind": "folder", "writes": ("tables.parquet", "tasks.parquet", "traces.pt"),
          "inputs": ("input", "rows_file")}


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--source", required=True, choices=["dlrm", "spec", "synthetic"],
                   help="dlrm: a .pt/.pt.gz trace (Meta's open format); spec: a CSV/Parquet/YAML table list "
                        "with TorchRec's names; synthetic: a seeded DLRM-like population")
    p.add_argument("--input", nargs="+", action="extend",
                   help="the trace or spec file (dlrm, spec); dlrm: also several files of one trace (Meta's dataset "
                        "holds one batch per file: --input fbgemm_t856_bs65536_*.pt, or the pattern quoted, or a "
                        "comma-separated list), whose features then describe all of them")
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
    g.add_argument("--hot-large-fraction", type=float, default=0.0,
                   help="fraction of the tables drawn as large multi-hot features (1e7-1e8 rows, 20-120 lookups "
                        "per sample; default 0: sizes and pooling drawn independently)")
    g.add_argument("--fp16-fraction", type=float, default=0.0,
                   help="fraction of the tables drawn with FP16 weights, the others of --data-type (default 0)")
    g.add_argument("--trace-batch-size", type=int, default=4096, help="samples per table in traces.pt")
    g.add_argument("--trace-layout", default="flat", choices=["flat", "per_table", "per_table_cumulative"],
                   help="offsets layout of traces.pt (default flat, as the open dataset)")
    g.add_argument("--bins-batch-size", type=int, default=None,
                   help="synthetic/spec: samples in the batch the access bins are computed on (default 65536)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


# (option, argparse dest, its default, the sources it applies to)
SOURCE_OPTIONS = (("--input", "input", None, ("dlrm", "spec")), ("--dim", "dim", "mixed", ("dlrm",)),
                  ("--rows-file", "rows_file", None, ("dlrm",)),
                  ("--write-traces", "write_traces", False, ("synthetic",)),
                  ("--hot-large-fraction", "hot_large_fraction", 0.0, ("synthetic",)),
                  ("--fp16-fraction", "fp16_fraction", 0.0, ("synthetic",)),
                  ("--trace-batch-size", "trace_batch_size", 4096, ("synthetic",)),
                  ("--trace-layout", "trace_layout", "flat", ("synthetic",)))


def main(args: argparse.Namespace) -> int:
    from .. import schemas
    from ..errors import EmbshardError

    if args.input is not None and any(not str(x).strip() for x in args.input):
        raise EmbshardError("an --input is empty (an unset shell variable?)", field="input",
                            fix="give the trace or spec file's path")
    for option, dest, default, sources in SOURCE_OPTIONS:  # an option of another source is a mistake, not a no-op
        if args.source not in sources and getattr(args, dest) != default:
            raise EmbshardError(f"does not apply to --source {args.source}", field=option,
                                fix=f"drop {option} (it is for --source {' or '.join(sources)})")
    kw: dict = {"progress": not args.no_progress}
    if args.source == "dlrm" and args.input:
        # A pattern or a list names the files only once expanded: the output must be none of them either.
        from .. import storage
        from ..ingest.dlrm import trace_files

        storage.check_output(args.out, kind="folder", writes=tuple(OUTPUT["writes"]),
                             inputs={"--input": trace_files(args.input)})
    if args.source == "dlrm":
        kw.update(dim=args.dim, data_type=args.data_type, rows_file=args.rows_file)
    elif args.source == "synthetic":
        kw.update(write_traces=args.write_traces, trace_batch_size=args.trace_batch_size,
                  trace_layout=args.trace_layout, bins_batch_size=args.bins_batch_size,
                  bytes_per_element=4 if args.data_type == "fp32" else 2,
                  hot_large_fraction=args.hot_large_fraction, fp16_fraction=args.fp16_fraction)
    else:
        kw.update(bins_batch_size=args.bins_batch_size)
    path = run(args.source, args.out, input=args.input, seed=args.seed, num_tables=args.num_tables, **kw)
    df = schemas.read(path, "tables")
    gib = df["size_bytes"].sum() / 2**30
    print(f"wrote {path}: {len(df)} tables, {gib:,.1f} GiB, rows {df['rows'].min():,}..{df['rows'].max():,}, "
          f"dims {df['dim'].min()}..{df['dim'].max()}, pooling {df['pooling_factor'].mean():.2f} mean "
          f"(source {_source_words(df)}){_types_words(df)}")
    return 0


def _types_words(df) -> str:
    """', 10 of them FP16' where some tables are FP16 and others not ('' otherwise)."""
    half = int((df["bytes_per_element"] == 2).sum())
    return f", {half} of them FP16" if 0 < half < len(df) else (", all FP16" if half else "")


def _source_words(df) -> str:
    """A tables frame's source as the summary line shows it: its kind and input; several trace files as the first
    (the one replayed, `trace_file`) and a count (the column lists them all)."""
    source = str(df["source"].iloc[0])
    count = re.search(r";files=(\d+);", source)
    if count is None:
        return source.split(";")[0]
    n = int(count.group(1))
    return f"dlrm:{df['trace_file'].iloc[0]} and {n - 1} more files"
