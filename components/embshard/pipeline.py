"""`embshard pipeline`: run the whole Airflow DAG locally (embedded default: sqlite Airflow and MLflow,
CPU FBGEMM, a small synthetic dataset) and print where the results are.

It is a real Airflow run of `dags/embshard_pipeline.py` (dag.test(): every task through Airflow's own task
runner, XComs and dynamic mapping included), not a re-implementation of the DAG.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import json
import os
import signal
import sys
import time
from pathlib import Path


def dags_folder() -> str:
    """The DAGs folder: $EMBSHARD_DAGS_FOLDER, else the repository's dags/ next to components/."""
    env = os.environ.get("EMBSHARD_DAGS_FOLDER")
    if env:
        return env
    return str(Path(__file__).resolve().parents[2] / "dags")


# What --out holds (the run's data, MLflow store and Airflow state): checked before any work
# (cli.check_output), so a file given as --out is one line.
OUTPUT = {"kind": "folder"}


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default=None,
                   help="folder for the run data, MLflow and Airflow state (AIRFLOW_HOME, EMBSHARD_DATA_ROOT, "
                        "MLFLOW_TRACKING_URI or EMBSHARD_CALIBRATION_DIR, when set, send their part elsewhere; "
                        "the run says so as it starts). Default runs/local; with --quick runs/quick, so that a "
                        "smoke run's model never judges or becomes the champion of the main store")
    p.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                   help="override a DAG parameter (see the DAG's Param form), e.g. --param num_tables=400")
    p.add_argument("--quick", action="store_true", help="a tiny configuration (smoke test, ~2 minutes)")


# (no large multi-hot tables: the smoke test stays small and fast)
QUICK_PARAMS = {"num_tables": 80, "hot_large_fraction": 0.0, "num_tasks": 4, "tables_per_task": "10-20",
                "bench_shards": 40, "bench_chunks": 2, "policy_iterations": 30, "eval_tasks": 2, "cost_members": 2,
                "eval_planners": ["size_greedy", "lookup_greedy", "size_lookup_greedy", "dim_greedy"]}


# What --out would hold, and the variable that moves it elsewhere when it is set (local_environment).
OUT_FOLDERS = {"AIRFLOW_HOME": "Airflow state", "EMBSHARD_DATA_ROOT": "run data",
               "MLFLOW_TRACKING_URI": "the MLflow store", "EMBSHARD_CALIBRATION_DIR": "the comm calibration"}


def out_folders(out: str) -> dict[str, str]:
    """Where --out alone puts each part of a local installation (the OUT_FOLDERS variables' values)."""
    out = os.path.abspath(out)
    return {"AIRFLOW_HOME": os.path.join(out, "airflow"), "EMBSHARD_DATA_ROOT": os.path.join(out, "data"),
            "MLFLOW_TRACKING_URI": f"sqlite:///{os.path.join(out, 'mlflow.db')}",
            # One communication calibration per hardware, kept for every local run (bench.comm.adopt_calibration).
            "EMBSHARD_CALIBRATION_DIR": os.path.join(out, "calibration")}


def local_environment(out: str) -> dict[str, str]:
    """The folders of a local installation rooted at `out` (Airflow home, DAGs, run data, MLflow store), as
    environment variables; already-set ones win. Shared by `embshard pipeline` and `embshard ui`."""
    own = out_folders(out)
    return {**{var: os.environ.get(var) or path for var, path in own.items()},
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False", "AIRFLOW__CORE__DAGS_FOLDER": dags_folder(),
            # The LocalExecutor starts this many worker processes: Airflow's 32 sat idle beside a DAG that runs one
            # run, and one task of it, at a time (max_active_runs=1; benchmark chunks one by one).
            "AIRFLOW__CORE__PARALLELISM": os.environ.get("AIRFLOW__CORE__PARALLELISM") or "4",
            "EMBSHARD_RUNNER": "local"}


def outside_out(out: str) -> list[str]:
    """One line per environment variable that sends part of a local installation somewhere other than `out`
    (they win over --out: an operator may point MLflow at a server); printed before the run, so that a shell's
    leftover AIRFLOW_HOME or MLFLOW_TRACKING_URI does not silently take the run elsewhere."""
    own = out_folders(out)
    lines = []
    for var, what in OUT_FOLDERS.items():
        value = os.environ.get(var)
        if value and value != own[var]:
            lines.append(f"note: {var} is set ({value}): {what} goes there, not under {os.path.abspath(out)} "
                         f"(unset {var} to keep it under --out)")
    return lines


def setup_environment(out: str) -> dict[str, str]:
    """Environment of an embedded run; call before importing airflow (it reads its config at import)."""
    os.makedirs(os.path.abspath(out), exist_ok=True)
    env = local_environment(out)
    os.environ.update(env)
    return env


def load_dag():
    path = os.path.join(dags_folder(), "embshard_pipeline.py")
    spec = importlib.util.spec_from_file_location("embshard_pipeline_dag", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.dag


def run(out: str = "runs/local", params: dict | None = None) -> dict:
    """Run the DAG once with `params`; returns the run's root, state and stage outputs. Bad params are one
    EmbshardError naming each field before Airflow starts (the DAG's check_params task checks them again)."""
    from . import params as params_mod

    # The DAG's first task, at once: every param, and CUDA where asked (the stages run on this machine).
    from .stages import check_params

    check_params("", params or {})
    if params and isinstance(params.get("eval_planners"), str):  # the DAG's form takes a list
        params = {**params, "eval_planners": params_mod.planners_of(params["eval_planners"])}
    env = setup_environment(out)
    from airflow import settings

    # Airflow reads its DAGs folder once, at import; when it was imported before this call (a test session, a
    # notebook), dag.test() would serialize the DAG from the stale folder and find nothing to run.
    settings.DAGS_FOLDER = env["AIRFLOW__CORE__DAGS_FOLDER"]
    with _one_pipeline(env["AIRFLOW_HOME"], out):  # before anything is written: a refused start leaves nothing
        _refuse_beside_a_scheduler(env["AIRFLOW_HOME"], out)
        return _run_dag(out, params, env)


def _run_dag(out: str, params: dict | None, env: dict[str, str]) -> dict:
    """`run` once this process holds the folder (_one_pipeline)."""
    from airflow.utils.db import initdb

    from . import run_context, stages
    from .errors import EmbshardError

    log_path = os.path.join(os.path.abspath(out), "logs", f"pipeline-{time.strftime('%Y%m%d-%H%M%S')}.log")
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    print(f"embshard pipeline: Airflow's, MLflow's and the stages' own logs go to {log_path}", flush=True)
    start = time.perf_counter()
    failures_before = len(stages.FAILURES)
    with _logs_to(log_path):
        dag = load_dag()
        check_conf(dag, params or {})  # before the database and the run: a bad value is one line, at once
        from airflow.models.dagrun import DagRun
        from airflow.utils.types import DagRunType

        from . import run_owner

        # The run's id, known before dag.test() makes the run (it derives the id from these dates), is recorded
        # with this process as its owner first: an `embshard ui` starting now sees it, and a later start on this
        # folder fails the run if this process dies without ending it (kill -9, out of memory).
        started = datetime.datetime.now(datetime.UTC)
        run_id = DagRun.generate_run_id(run_type=DagRunType.MANUAL, logical_date=started, run_after=started)
        home = env["AIRFLOW_HOME"]
        owned: dict = {"run_id": run_id, "path": run_owner.record_owner(home, run_id)}
        try:
            _refuse_beside_a_scheduler(home, out)
            initdb()
            _refuse_beside_a_scheduler(home, out, db=True)
            for line in run_owner.reap(dag.dag_id, home):
                print(line, flush=True)  # the log, and the console
                run_context.progress(line)
            try:
                with _stop_between_tasks(lambda ti: _owned(owned, home, ti.run_id)):
                    dag_run = dag.test(run_conf=params or {}, logical_date=started, run_after=started)
            except KeyboardInterrupt:
                _fail_interrupted_run(dag.dag_id, owned["run_id"])
                raise
            except ValueError as exc:  # Airflow's ParamValidationError (a ValueError) of a check we do not repeat
                err = param_error(exc)
                if err is None:
                    raise
                raise err from exc
        finally:
            run_owner.forget(owned["path"])
    elapsed = time.perf_counter() - start
    root = stages.run_root(env["EMBSHARD_DATA_ROOT"], dag_run.run_id)
    state = str(dag_run.state)
    result = {"run_id": dag_run.run_id, "state": state, "root": root, "seconds": elapsed, "env": env, "out": out,
              "log": log_path}
    if state != "success":
        summary = failure_summary(dag_run.get_task_instances(), stages.FAILURES[failures_before:])
        raise EmbshardError(f"the DAG run ended {state} ({summary}){_moved_before_failing(root)}", path=root,
                            fix=f"see the first failure, then run again; the task logs are in {log_path}")
    for name in ("promotion", "export", "policy", "cost_model"):
        p = os.path.join(root, "state", f"{name}.json")
        if os.path.exists(p):
            with open(p, encoding="utf-8") as f:
                result[name] = json.load(f)
    return result


def _fail_interrupted_run(dag_id: str, run_id: str) -> None:
    """Mark the run this command started failed, with its running task: left `running` in OUT/airflow, a later
    `embshard ui` on the same folder resumed it minutes after Ctrl-C, and its gate overwrote the `failed_run`
    verdict the next pipeline had tagged. Its tasks not run stay unrun; a run of a failed DagRun is never
    scheduled. (A run whose process was killed outright is failed by the next start: run_owner.reap.)"""
    from airflow.models.dagrun import DagRun
    from airflow.utils.session import create_session

    from .run_owner import fail_run

    with contextlib.suppress(Exception), create_session() as session:  # the interrupt is what the user must see
        for run in session.query(DagRun).filter(DagRun.dag_id == dag_id, DagRun.run_id == run_id):
            fail_run(session, run)


def _owned(owned: dict, home: str, run_id: str) -> None:
    """Re-record the owner under the id dag.test() gave its run, should it differ from the one derived before."""
    from . import run_owner

    if run_id != owned["run_id"]:
        new = run_owner.record_owner(home, run_id)
        run_owner.forget(owned["path"])
        owned.update(run_id=run_id, path=new)


PIPELINE_LOCK = "embshard-pipeline.lock"  # under AIRFLOW_HOME: held (flock) by the `embshard pipeline` running there


@contextlib.contextmanager
def _one_pipeline(home: str, out: str):
    """Hold the folder's pipeline lock while this pipeline runs, else refuse: dag.test() ignores max_active_runs,
    so two pipelines on one folder ran at once, both gates read "champion before none" and both promoted (the
    second candidate never measured against the first). An exclusive flock: taken atomically, and released by
    the kernel when the process ends, however it ends."""
    import fcntl

    from . import run_owner
    from .errors import EmbshardError

    os.makedirs(home, exist_ok=True)
    fd = os.open(os.path.join(home, PIPELINE_LOCK), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            others = [o for o in run_owner.live_pipelines(home) if o.get("pid") != os.getpid()]
            who = (f" (pid {others[0]['pid']}, run {others[0]['run_id']})" if others else "")
            raise EmbshardError(f"another `embshard pipeline` is running on this folder{who}; runs go one at a "
                                "time", path=os.path.abspath(out),
                                fix="wait for it to end, or give another --out") from None
        yield
    finally:
        os.close(fd)  # releases the lock


def _refuse_beside_a_scheduler(home: str, out: str, db: bool = False) -> None:
    """A scheduler on this folder's database (an `embshard ui`'s, or what a killed one left) also runs the
    dag.test() run's tasks: the run failed with its first failure unnamed, and max_active_runs=1 was bypassed.
    `db`: ask the database for a heartbeating scheduler (after initdb) instead of the UI's record."""
    from . import run_owner
    from .errors import EmbshardError

    if db:
        from airflow.utils.session import create_session

        with create_session() as session:
            what = run_owner.live_scheduler(session)
    else:
        what = run_owner.live_ui(home)
    if what:
        raise EmbshardError(f"{what}; its scheduler would run this pipeline's tasks too", path=os.path.abspath(out),
                            fix="trigger the run from that Airflow's UI or REST API instead, or stop it (Ctrl-C "
                                "in its terminal) first, or give another --out")


def _moved_before_failing(root: str) -> str:
    """What a failed run's gate had already done to the registry (its aliases stay: the gate's measurement holds
    whatever failed after it, e.g. the export), so that a red run does not hide a new champion."""
    try:
        with open(os.path.join(root, "state", "promotion.json"), encoding="utf-8") as f:
            decision = json.load(f)
    except (OSError, ValueError):
        return ""
    version, verdict = decision.get("candidate_version"), decision.get("verdict")
    if decision.get("promoted"):
        return (f"; its gate had already promoted version {version} to champion (it stays: `embshard champion "
                f"--set` rolls it back)")
    if verdict == "undecided":
        return f"; its gate had already made version {version} the challenger"
    return ""


def failure_summary(tis, failures: list[tuple[str, str]]) -> str:
    """Which task failed first (the earliest to end `failed`; tasks after it end upstream_failed), with its reason
    when it failed in this process (stages.FAILURES), then the tasks not successful."""
    from .run_owner import task_label as label

    bad = [ti for ti in tis if str(ti.state) not in ("success", "skipped")]
    failed = sorted((ti for ti in bad if str(ti.state) == "failed"),
                    key=lambda ti: (ti.end_date is None, ti.end_date or 0, label(ti)))
    reasons = dict(reversed(failures))  # a task's first reason
    head = ""
    if failed:
        first = label(failed[0])
        why = reasons.get(first)
        head = f"{first} failed first" + (f": {why}" if why else " (its log says why)") + "; "
    elif failures:
        head = f"{failures[0][0]} failed first: {failures[0][1]}; "
    others = [f"{label(ti)} {ti.state or 'not run'}" for ti in bad]
    return (f"{head}{len(bad)} tasks not successful: {', '.join(others[:6])}"
            f"{', ...' if len(others) > 6 else ''}")


@contextlib.contextmanager
def _stop_between_tasks(on_task=None):
    """dag.test() runs each task through `_run_task` and goes on after a failed one, and Airflow's task runner
    takes whatever a task raises, KeyboardInterrupt included, for a failed try (a retried one for benchmark): after
    SIGTERM or Ctrl-C (embshard.signals, which stopped the running stage) the next call raises KeyboardInterrupt
    outside any task, which ends dag.test() and the command. `on_task(ti)` is called before each task.

    Airflow's task runner installs its own SIGTERM handler as each task starts, which only calls the task's
    on_kill() and goes on, and leaves it installed: a SIGTERM outside the stage code (the task runner's own work,
    between tasks; most of a run of many short tasks) was ignored and the run went on to promote. So on_kill stops
    the command here (embshard.signals.interrupt), and embshard's handler is put back after each task."""
    from airflow.sdk.bases.operator import BaseOperator
    from airflow.sdk.definitions import dag as dag_module

    from . import signals

    original = getattr(dag_module, "_run_task", None)
    if original is None:  # another Airflow: a stopped stage still fails, the run goes on to its end
        yield
        return

    def run_task(*args, **kwargs):
        if signals.received is not None:
            raise KeyboardInterrupt
        if on_task is not None and kwargs.get("ti") is not None:
            on_task(kwargs["ti"])
        try:
            out = original(*args, **kwargs)
        finally:
            signals.stop_on_sigterm()  # the task runner's handler, left installed, only calls on_kill()
        if signals.received is not None:
            raise KeyboardInterrupt
        return out

    def on_kill(self):  # noqa: ARG001 (an operator method); what Airflow's handler calls on SIGTERM
        signals.interrupt(signal.SIGTERM)

    before_kill = BaseOperator.__dict__["on_kill"]
    dag_module._run_task = run_task
    BaseOperator.on_kill = on_kill  # the local runner's tasks are Python tasks: none has an on_kill of its own
    try:
        yield
    finally:
        dag_module._run_task = original
        BaseOperator.on_kill = before_kill


def param_error(exc: BaseException):
    """Airflow's ParamValidationError ("Invalid input for param devices: -3 is less than the minimum of 1",
    then the JSON schema over several lines) as one EmbshardError naming the param; None for other errors."""
    import re

    from .errors import EmbshardError

    if type(exc).__name__ != "ParamValidationError":
        return None
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    m = re.match(r"Invalid input for param (\S+): (.*)", first)
    name, why = (m.group(1), m.group(2)) if m else ("param", first)
    return EmbshardError(why, field=name, fix=f"give --param {name}=VALUE within the limits of the DAG's form "
                         "(the Trigger form of embshard_pipeline shows them)")


def check_conf(dag, params: dict) -> None:
    """Validate `params` against the DAG's Params (types, ranges, patterns) as the run would, without a run."""
    import copy

    merged = copy.deepcopy(dag.params)
    try:
        merged.update(params)
        merged.validate()
    except ValueError as exc:
        err = param_error(exc)
        if err is None:
            raise
        raise err from None


@contextlib.contextmanager
def _logs_to(path: str):
    """Everything written to stdout/stderr (Airflow's task runner, MLflow, progress bars) goes to `path`; the
    stages' one-line progress (run_context.progress) goes to the terminal."""
    from .run_context import PROGRESS_FD

    sys.stdout.flush()
    sys.stderr.flush()
    saved_out, saved_err = os.dup(1), os.dup(2)
    old_fd = os.environ.get(PROGRESS_FD)
    with open(path, "ab") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    os.environ[PROGRESS_FD] = str(saved_out)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved_out, 1)
        os.dup2(saved_err, 2)
        os.close(saved_out)
        os.close(saved_err)
        if old_fd is None:
            os.environ.pop(PROGRESS_FD, None)
        else:
            os.environ[PROGRESS_FD] = old_fd


def _parse_params(items: list[str]) -> dict:
    from .errors import EmbshardError
    from .stages import DEFAULT_PARAMS

    out: dict[str, object] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise EmbshardError(f"--param {item!r} has no '='", field="param", fix="write it as KEY=VALUE")
        if key not in DEFAULT_PARAMS:
            raise EmbshardError(f"unknown parameter {key!r} in --param {item!r}", field="param",
                                fix=f"use KEY=VALUE with KEY one of {', '.join(DEFAULT_PARAMS)}")
        default = DEFAULT_PARAMS[key]
        if value.strip().lower() == "null":  # the default, as a null in a conf (docs/contracts.md)
            out[key] = None
            continue
        if default is None:  # an optional param: its schema says the type (devices_per_host: an integer)
            from .params import SPECS

            if value.strip() in ("", "none"):
                out[key] = None
                continue
            if "integer" in SPECS[key].schema.get("type", ()):
                default = 0
        if isinstance(default, list):  # e.g. eval_planners=dim_greedy,size_greedy
            out[key] = [v.strip() for v in value.split(",") if v.strip()]
            continue
        if isinstance(default, bool):
            out[key] = value.strip().lower() in ("1", "true", "yes")
            if value.strip().lower() not in ("0", "1", "true", "false", "yes", "no"):
                raise EmbshardError(f"{key}={value!r} is not true or false", field=key, fix="use true or false")
            continue
        try:
            out[key] = value if default is None or isinstance(default, str) else type(default)(value)
        except ValueError:
            kind = {"int": "a whole number", "float": "a number"}.get(type(default).__name__, type(default).__name__)
            raise EmbshardError(f"{key}={value!r} is not {kind}", field=key,
                                fix=f"give {key}=<{kind}> (its default is {DEFAULT_PARAMS[key]!r})") from None
    return out


def main(args) -> int:
    if args.out is None:
        args.out = "runs/quick" if args.quick else "runs/local"
    given = _parse_params(args.param)
    params = dict(QUICK_PARAMS) if args.quick else {}
    if given.get("source", "synthetic") != "synthetic":  # --quick's generator sizes do not apply to a file
        from .params import SYNTHETIC_KEYS

        params = {k: v for k, v in params.items() if k not in SYNTHETIC_KEYS}
    params.update(given)
    for line in outside_out(args.out):
        print(line, flush=True)
    res = run(args.out, params)
    print(summary_text(res))
    return 0


def summary_text(res: dict) -> str:
    from .run_layout import in_root

    env, root = res["env"], res["root"]
    lines = ["", "=" * 78, f"embshard pipeline: {res['state']} in {res['seconds']:.0f} s   (run {res['run_id']})",
             f"run data: {root}"]
    if res.get("log"):
        lines.append(f"logs: {res['log']}")
    promo = res.get("promotion") or {}
    if promo:
        from .stage_report import promotion_lines

        lines += [line[2:] if line.startswith("  ") else line for line in promotion_lines(promo, root)
                  if not line.lstrip().startswith("plot:")]
    exp = res.get("export") or {}
    if exp:
        lines.append(f"placements: {in_root(root, exp['placements']) if exp.get('placements') else None}")
        lines.append(f"exported plans (plan.json + TorchRec plan per task): {os.path.join(root, 'export')}")
    store = env["MLFLOW_TRACKING_URI"]
    own_store = store == f"sqlite:///{os.path.join(os.path.abspath(res['out']), 'mlflow.db')}"
    # Commands that work from any folder (`make ... RUN_DIR=` only works from the repository, with a relative out)
    bin_dir = os.path.dirname(sys.executable)
    lines += [f"evaluation plot: {os.path.join(root, 'evaluation', 'evaluation.png')}",
              "look at it:",
              f"  MLflow UI:  {os.path.join(bin_dir, 'mlflow')} ui --backend-store-uri '{store}'"
              + ("" if own_store else "   (MLFLOW_TRACKING_URI, not --out)"),
              f"  Airflow UI: {os.path.join(bin_dir, 'embshard')} ui --out {os.path.abspath(res['out'])}   (a real "
              "scheduler; trigger embshard_pipeline there)",
              "=" * 78]
    return "\n".join(lines)

