"""Large-trace ingestion: time and peak resident memory of `embshard ingest --source dlrm`.

The real open dataset file (856 tables, ~887M indices, 4.2 GB) must ingest in under 8 GB of resident memory.
This script writes a DLRM-format trace of at least 100M indices (default 200 synthetic tables, batch sized to
reach the target) into a temporary folder, ingests it in a child process and reports wall time and the
child's peak RSS (from wait4's rusage, so the generator in this process does not count), then removes
everything it wrote.

    python benchmarks/ingest_large_trace.py                 # >= 100M indices, .pt
    python benchmarks/ingest_large_trace.py --gz            # also the .pt.gz path (decompress + map)
    python benchmarks/ingest_large_trace.py --quick         # 5M indices, a smoke run
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

RSS_LIMIT_GB = 8.0


def _make_trace(path: str, num_tables: int, min_indices: int, seed: int) -> tuple[int, int, int]:
    """Write the trace in a child process; returns (tables, batch size, indices).

    A child, so that this process stays small: a forked child starts as a copy of its parent, and
    ru_maxrss of the ingest child would otherwise include the generator's memory.
    """
    code = f"""
import json, numpy as np, torch
from embshard.ingest.synthetic import generate_tables, write_dlrm_traces
tables = generate_tables({num_tables}, seed={seed}, bins_batch_size=256)
batch = int(np.ceil({min_indices} * 1.03 / float(tables["pooling_factor"].sum()) / 1024) * 1024)
write_dlrm_traces(tables, {path!r}, batch_size=batch, seed={seed}, layout="flat")
print(json.dumps([len(tables), batch, torch.load({path!r}, mmap=True, weights_only=True)[0].numel()]))
"""
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    tables, batch, n = json.loads(out.strip().splitlines()[-1])
    return int(tables), int(batch), int(n)


def _ingest(trace: str, out: str) -> tuple[float, float, int]:
    """(wall seconds, peak RSS GiB, exit code) of one `embshard ingest --source dlrm` child."""
    cmd = [sys.executable, "-m", "embshard.cli", "ingest", "--source", "dlrm", "--input", trace, "--out", out,
           "--seed", "0", "--no-progress"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    return wall, usage.ru_maxrss / 2**20, proc.returncode  # ru_maxrss is KiB on Linux


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-tables", type=int, default=200)
    p.add_argument("--min-indices", type=float, default=100e6)
    p.add_argument("--gz", action="store_true", help="also ingest a gzip-compressed copy")
    p.add_argument("--quick", action="store_true", help="a 5M-index smoke run")
    p.add_argument("--tmp-dir", default=None, help="where the trace is written (needs ~1 GB per 100M indices)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    min_indices = 5e6 if args.quick else args.min_indices
    num_tables = min(args.num_tables, 40) if args.quick else args.num_tables

    work = tempfile.mkdtemp(prefix="embshard-ingest-bench-", dir=args.tmp_dir)
    try:
        trace = os.path.join(work, "trace.pt")
        t0 = time.perf_counter()
        tables, batch, n = _make_trace(trace, num_tables, int(min_indices), args.seed)
        gen_s = time.perf_counter() - t0
        size_gb = os.path.getsize(trace) / 2**30
        print(f"trace: {tables} tables x {batch:,} samples, {n / 1e6:,.1f}M indices, {size_gb:.2f} GiB "
              f"(written in {gen_s:.1f} s)")
        runs = [("pt (mmap)", trace)]
        if args.gz:
            import gzip

            gz = trace + ".gz"
            with open(trace, "rb") as src, gzip.open(gz, "wb", compresslevel=1) as dst:
                shutil.copyfileobj(src, dst, 16 << 20)
            runs.append(("pt.gz (decompress + mmap)", gz))
        print(f"\n| file | indices | wall s | M indices/s | peak RSS GiB | RSS / file | under {RSS_LIMIT_GB:g} GB |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        ok = True
        first_wall = None
        for label, path in runs:
            out = os.path.join(work, "out-" + label.split()[0].replace(".", "-"))
            wall, rss, rc = _ingest(path, out)
            if rc != 0:
                print(f"ingest of {path} failed with exit code {rc}", file=sys.stderr)
                return 1
            first_wall = first_wall or wall
            under = rss * 2**30 / 1e9 < RSS_LIMIT_GB
            ok &= under
            print(f"| {label} | {n / 1e6:,.1f}M | {wall:.1f} | {n / 1e6 / wall:.1f} | {rss:.2f} | "
                  f"{rss / size_gb:.2f} | {'yes' if under else 'NO'} |")
        # the open dataset's file, at the .pt rate (linear: tables are independent)
        print(f"\nat this rate the open dataset's ~887M indices would take ~{887 / (n / 1e6) * first_wall:.0f} s")
        return 0 if ok else 1
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
