"""`python -m benchmarks` (`make bench`): the side-by-side benchmark harness; writes benchmarks/results/.

    python -m benchmarks                      # full run (~45 min on 2 cores): trains the models with one Airflow run
    python -m benchmarks --run runs/local     # reuse the models of a `make run` folder (no retraining)
    python -m benchmarks --quick              # CI smoke test of the harness (< 2 min), writes to a temp folder
    python -m benchmarks --jobs quality,planning --run runs/local   # a subset of the reports
    python -m benchmarks --jobs quality --suite split --run runs/local   # the split suite -> quality_splits.md
    python -m benchmarks --jobs quality --suite scale --run runs/local   # 500-1,000 tables -> quality_scale.md
    python -m benchmarks --suite all          # `make bench`: everything, the three quality pages included

Reports (each a Markdown page naming the hardware, plus plots): quality.md/.png, planning_time.md/.png,
costmodel.md (+ parity plot), pipeline.md, place_wall_time.md (`embshard place` start to exit; its own tiny models,
so `--jobs place` alone trains nothing and leaves README.md as it is), and README.md linking them with the
headline numbers. Raw rows go to
results/raw/ (not committed).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import tempfile
import time

JOBS = ("quality", "planning", "costmodel", "pipeline", "place")
SUITES = ("main", "split", "scale")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "benchmarks", "results")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n", 2)[2])
    p.add_argument("--quick", action="store_true", help="tiny everything (CI check of the harness, < 2 min)")
    p.add_argument("--out", default=None,
                   help="results folder (default benchmarks/results; with --quick a new temporary folder)")
    p.add_argument("--run", default=None, metavar="DIR",
                   help="reuse the trained models of this pipeline folder (e.g. runs/local) instead of training")
    p.add_argument("--workdir", default=None,
                   help="where the harness's own pipeline run and suite files go (default runs/bench, or a "
                        "temporary folder with --quick)")
    p.add_argument("--jobs", default=",".join(JOBS), help=f"comma-separated subset of {', '.join(JOBS)}")
    p.add_argument("--calibration-dir", default=None, metavar="DIR",
                   help="quality: the folder whose comm_calibration.json prices the CPU's all-to-all (default: the "
                        "run's own, what its models were trained with). Runs calibrated apart measure different "
                        "networks; give one folder to compare several runs' models on one ruler")
    p.add_argument("--tasks-scale", type=int, default=1, metavar="K",
                   help="quality: K times the tasks of every suite (default 1: 3 per suite, 2 at 100-200 tables; "
                        "K=2 doubles the run's time and narrows the intervals)")
    p.add_argument("--suite", default="main",
                   help="quality: main (the main suites, quality.md), split (quality_splits.md: tables larger "
                        "than a device and dominant tables on 8-32 devices), scale (quality_scale.md: "
                        "500-1,000 tables on 32-128 devices; about an hour on 2 cores), a comma-separated list of "
                        "them, or all (what `make bench` runs)")
    args = p.parse_args(argv)
    args.suites = list(SUITES) if args.suite == "all" else [s for s in args.suite.split(",") if s]
    if not args.suites or any(s not in SUITES for s in args.suites):
        p.error(f"--suite: choose from {', '.join(SUITES)}, a comma-separated list of them, or all")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    jobs = [j for j in args.jobs.split(",") if j]
    bad = [j for j in jobs if j not in JOBS]
    if bad:
        print(f"error: unknown job {bad[0]!r} (choose from {', '.join(JOBS)})", file=sys.stderr)
        return 2
    from .quality import MAX_TASKS_SCALE

    if not 1 <= args.tasks_scale <= MAX_TASKS_SCALE:
        print(f"error: --tasks-scale must be 1-{MAX_TASKS_SCALE}, got {args.tasks_scale}", file=sys.stderr)
        return 2
    out = os.path.abspath(args.out or (tempfile.mkdtemp(prefix="embshard-bench-quick-") if args.quick else RESULTS))
    work = os.path.abspath(args.workdir or (tempfile.mkdtemp(prefix="embshard-bench-work-") if args.quick
                                            else os.path.join(REPO, "runs", "bench")))
    os.makedirs(os.path.join(out, "raw"), exist_ok=True)
    os.makedirs(work, exist_ok=True)
    os.environ.setdefault("EMBSHARD_NUM_THREADS", "1")
    try:
        return _run(args, jobs, out, work)
    except Exception as exc:  # EmbshardError: one line, exit 2 (the CLI convention)
        from embshard.errors import EmbshardError

        if isinstance(exc, EmbshardError):
            print(f"error: {exc}", file=sys.stderr)
            return 2
        raise


def _run(args, jobs: list[str], out: str, work: str) -> int:
    import torch

    from . import costmodel_accuracy, pipeline_stages, planning_time, quality, report
    from .common import git_commit, hardware, progress, write_text

    # One intra-op thread for everything, planning included: the planners' small tensor ops get slower, not
    # faster, with more threads on a shared 2-core machine (measured: 0.8 s -> 15 s for one plan under load).
    torch.set_num_threads(int(os.environ["EMBSHARD_NUM_THREADS"]))
    t_start = time.perf_counter()
    started = dt.datetime.now(dt.UTC)
    commit = git_commit()  # the code this run starts with (others may commit while it runs)
    hw = hardware()
    hw_line = hw.line()
    progress(f"harness: {'quick' if args.quick else 'full'} run; results -> {out}; work -> {work}")
    progress(f"hardware: {hw_line}")

    # 0. `embshard place` wall time: its own world and tiny registered models (no pipeline run needed).
    if "place" in jobs:
        from . import place_wall_time

        pcfg = place_wall_time.quick_config() if args.quick else place_wall_time.PlaceConfig()
        frame = place_wall_time.run(pcfg, tempfile.mkdtemp(prefix="place-", dir=work))
        frame.to_csv(os.path.join(out, "raw", "place_wall_time.csv"), index=False)
        write_text(os.path.join(out, "place_wall_time.md"), place_wall_time.markdown(frame, pcfg, hw_line))
        if jobs == ["place"]:
            progress(f"harness: done in {(time.perf_counter() - t_start) / 60:.1f} min; "
                     f"{os.path.join(out, 'place_wall_time.md')}")
            return 0

    # 1. The models: one real Airflow run of the pipeline (timed per stage), or an existing run folder.
    if args.run:
        info = pipeline_stages.reuse(args.run)
    else:
        params = pipeline_stages.QUICK_PARAMS if args.quick else pipeline_stages.FULL_PARAMS
        info = pipeline_stages.train(os.path.join(work, "pipeline"), dict(params))
    progress(f"models: policy {info.policy_uri}, cost model {info.cost_model_uri}, bench batch {info.batch_size}, "
             f"MLflow {info.tracking_uri}")
    pages: dict[str, dict] = {}
    if "pipeline" in jobs:
        write_text(os.path.join(out, "pipeline.md"), pipeline_stages.markdown(info, hw_line))
        if info.stages is not None:
            info.stages.to_csv(os.path.join(out, "raw", "pipeline_stages.csv"), index=False)
        pages["pipeline"] = {"md": "pipeline.md"}

    # 2. Cost-model accuracy (from the run's report).
    if "costmodel" in jobs:
        # The report of the train_cost_model stage's last round: the model it names (the policy may use a later
        # refit of it). The first round's report is in cost_model/, a later round's in cost_model/round-<r>/.
        stage = info.state.get("cost_model") or {}
        reported = stage.get("model_uri") or info.cost_model_uri
        full = costmodel_accuracy.load(info.root, stage.get("round"))
        text, head = costmodel_accuracy.markdown(full, info.root, out, hw_line, reported, info.cost_model_uri,
                                                 stage.get("round"))
        write_text(os.path.join(out, "costmodel.md"), text)
        pages["costmodel"] = {"md": "costmodel.md", "headline": head}
        progress("cost model: " + "; ".join(
            f"{s} compute MAPE learned {h['learned']['mape']:.1f}% vs sum-of-singles {h['sum_singles']['mape']:.1f}% "
            f"vs analytic {h['analytic']['mape']:.1f}%" for s, h in head.items()))

    # 3. Placement quality, measured: the main suites, or the split or scale suite on a page of its own.
    for suite in args.suites if "quality" in jobs else []:
        if suite == "split":
            cfg, name, page = quality.split_config(), "quality_splits", quality.split_markdown
        elif suite == "scale":
            cfg, name, page = quality.scale_config(), "quality_scale", quality.markdown
        else:
            cfg = quality.quick_config() if args.quick else quality.full_config(args.tasks_scale)
            name, page = "quality", quality.markdown
        t0 = time.perf_counter()
        comm_root = args.calibration_dir or info.root
        frame = quality.run(info.policy_uri, cfg, os.path.join(work, name), info.batch_size, comm_root=comm_root)
        secs = time.perf_counter() - t0
        frame.drop(columns=[c for c in ("error",) if c in frame.columns]).to_csv(
            os.path.join(out, "raw", f"{name}.csv"), index=False)
        png = quality.plot(quality.summarize(frame), os.path.join(out, f"{name}.png"), hw_line)
        write_text(os.path.join(out, f"{name}.md"),
                   page(frame, cfg, hw_line, info.policy_uri, info.batch_size, secs, png)
                   + quality.calibration_note(comm_root, info.root))
        pages[name] = {"md": f"{name}.md", "png": f"{name}.png",
                       "headline": quality.headline(quality.summarize(frame), frame), "seconds": secs}

    # 4. Planning time scaling (no kernels).
    if "planning" in jobs:
        cfg = planning_time.quick_config() if args.quick else planning_time.full_config()
        t0 = time.perf_counter()
        df = planning_time.run(info.policy_uri, cfg)
        df.to_csv(os.path.join(out, "raw", "planning_time.csv"), index=False)
        png = planning_time.plot(df, os.path.join(out, "planning_time.png"), cfg, hw_line)
        write_text(os.path.join(out, "planning_time.md"),
                   planning_time.markdown(df, cfg, hw_line, info.policy_uri, png))
        pages["planning"] = {"md": "planning_time.md", "png": "planning_time.png", "frame": df,
                             "seconds": time.perf_counter() - t0}
        # 5,000 tables on 1,024 devices by simulation (a fresh process per cell: its own peak memory).
        from . import planning_scale

        scfg = planning_scale.quick_config() if args.quick else planning_scale.ScaleConfig()
        sdf = planning_scale.run(info.policy_uri, scfg)
        sdf.to_csv(os.path.join(out, "raw", "planning_scale.csv"), index=False)
        write_text(os.path.join(out, "planning_scale.md"), planning_scale.markdown(sdf, scfg, hw_line, info.policy_uri))

    total = time.perf_counter() - t_start
    if "main" not in args.suites:  # pages of their own: the results README (the main suites' headline) stays
        progress(f"harness: done in {total / 60:.1f} min; pages {', '.join(p['md'] for p in pages.values())}")
        return 0
    command = "python -m benchmarks" + (" --quick" if args.quick else "") + (f" --run {args.run}" if args.run else "")
    text, headline = report.readme(pages, info, hw_line, started, total, quick=args.quick, command=command,
                                   commit=commit)
    write_text(os.path.join(out, "README.md"), text)
    with open(os.path.join(out, "raw", "headline.json"), "w", encoding="utf-8") as f:
        json.dump(headline, f, indent=1, default=float)
    progress(f"harness: done in {total / 60:.1f} min; results page {os.path.join(out, 'README.md')}")
    return 0


if __name__ == "__main__":  # the guard matters: the comm calibration spawns processes that re-import this module
    sys.exit(main())
