"""How well do the benchmark's shard measurements reproduce? The floor under any cost model's error.

`python -m benchmarks.label_noise --run runs/local/data/<run>` takes shards the run measured, measures them again
in PASSES separate passes (each a fresh `embshard bench` run: new operators, new inputs, a new random order, as
the pipeline's benchmark stage does), and compares the compute costs (forward + backward) of the passes:
- single pass vs single pass: the MAPE a perfect model would show against one measured label (x sqrt(2),
  since both sides are noisy) and its Spearman;
- the drift of each pass's median shard (the machine's speed moving between passes);
- the same after removing each pass's drift, and for medians of several passes.
Writes benchmarks/results/label_noise.md.
"""
from __future__ import annotations

import argparse
import glob
import os
import tempfile

import numpy as np
import pandas as pd

from .common import hardware, progress, write_text

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def _mape(a: pd.Series, b: pd.Series) -> float:
    return float(100 * np.mean(np.abs(a - b) / b))


def measure(run_root: str, shards: int, passes: int, batch_size: int, work: str) -> pd.DataFrame:
    """(shards x passes) compute ms of `shards` shards of the run, measured in `passes` separate passes."""
    from embshard.bench.runner import MeasureSettings
    from embshard.jobs import bench

    sh = pd.read_parquet(os.path.join(run_root, "shards.parquet"))
    sh = sh.sample(min(shards, len(sh)), random_state=1).reset_index(drop=True)
    cols = {}
    for k in range(passes):
        order = sh.sample(frac=1.0, random_state=100 + k).reset_index(drop=True)
        path = os.path.join(work, f"shards-{k}.parquet")
        order.to_parquet(path)
        out = os.path.join(work, f"pass-{k}")
        bench.run(os.path.join(run_root, "tables.parquet"), path, out,
                  MeasureSettings(batch_size=batch_size, seed=k), progress=False)
        c = pd.concat([pd.read_parquet(f) for f in glob.glob(os.path.join(out, "costs", "*.parquet"))])
        c = c.set_index("sample_id")
        cols[k] = (c["fwd_compute_ms"] + c["bwd_compute_ms"]).loc[sh["sample_id"]]
        progress(f"label noise: pass {k + 1}/{passes} done (median shard {cols[k].median():.3f} ms)")
    return pd.DataFrame(cols)


def summarize(m: pd.DataFrame) -> dict:
    from scipy.stats import spearmanr

    p = m.shape[1]
    pairs = [(i, j) for i in range(p) for j in range(p) if i != j]
    norm = m / m.median(axis=0)
    half = p // 2
    out = {"shards": len(m), "passes": p,
           "single_mape": float(np.mean([_mape(m[i], m[j]) for i, j in pairs])),
           "single_spearman": float(np.mean([spearmanr(m[i], m[j])[0] for i, j in pairs])),
           "single_mape_drift_removed": float(np.mean([_mape(norm[i], norm[j]) for i, j in pairs])),
           "pass_medians": [float(x) for x in m.median(axis=0)]}
    if half >= 2:
        a, b = m[list(range(half))].median(axis=1), m[list(range(half, 2 * half))].median(axis=1)
        out[f"median_of_{half}_mape"] = _mape(a, b)
    return out


def markdown(s: dict, hw_line: str, run_root: str, batch_size: int) -> str:
    med = s["pass_medians"]
    lines = ["# How well the benchmark's measurements reproduce", "", f"Hardware: {hw_line}", "",
             f"{s['shards']} shards of `{run_root}` measured again in {s['passes']} separate passes (each a fresh "
             f"`embshard bench` run at batch {batch_size}: new operators, new inputs, a new random order; compute "
             "= forward + backward). This is the floor under any cost model's error on this machine: a model "
             "can only be judged against labels as good as these.", "",
             "| comparison | compute MAPE % |", "| --- | ---: |",
             f"| one pass against another | {s['single_mape']:.1f} |",
             f"| the same, each pass's drift removed (divided by its median shard) | "
             f"{s['single_mape_drift_removed']:.1f} |"]
    for k, v in s.items():
        if k.startswith("median_of_"):
            n = k.split("_")[2]
            lines.append(f"| median of {n} passes against the median of {n} others | {v:.1f} |")
    lines += ["", f"Spearman between passes: {s['single_spearman']:.3f}. Median shard per pass (ms): "
              + ", ".join(f"{x:.3f}" for x in med) + f" (spread {100 * (max(med) / min(med) - 1):.0f}%: the "
              "machine's speed moves between passes minutes apart).", "",
              "A perfect model compared with one measured label would show about the one-pass MAPE / sqrt(2) "
              f"(~{s['single_mape'] / np.sqrt(2):.0f}%): the cost model's MAPE on unseen tables "
              "(costmodel.md) should be read against that, not against 0."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.label_noise", description=__doc__.splitlines()[0])
    p.add_argument("--run", required=True, help="a pipeline run's data root (has shards.parquet, tables.parquet)")
    p.add_argument("--shards", type=int, default=48)
    p.add_argument("--passes", type=int, default=6)
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--out", default=RESULTS)
    args = p.parse_args(argv)
    os.environ.setdefault("EMBSHARD_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="embshard-label-noise-") as work:
        m = measure(args.run, args.shards, args.passes, args.batch_size, work)
    s = summarize(m)
    write_text(os.path.join(args.out, "label_noise.md"), markdown(s, hardware().line(), args.run, args.batch_size))
    progress(f"label noise: one pass vs another {s['single_mape']:.1f}% MAPE; written to {args.out}/label_noise.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
