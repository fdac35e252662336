"""The pipeline's stages as functions of (run root, params): the one place where the DAG's knobs meet the
components. The local runner calls them in-process from Airflow tasks; the kubernetes runner calls the same
functions in pods through `embshard stage NAME --root ROOT --params JSON`. Every stage reads and writes fixed
paths under the run root, so stages pass nothing but that root.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Callable

from . import params as params_mod
from .errors import EmbshardError
from .run_layout import (  # noqa: F401  (PATHS: importable from here, as before)
    PATHS,
    _join,
    in_root,
    path,
    relative_to_root,
    run_root,
)
from .stage_report import promotion_lines, report, speed_words  # noqa: F401  (importable from here, as before)

log = logging.getLogger(__name__)
XCOM_DIR = "/airflow/xcom"  # the sidecar-shared folder of KubernetesPodOperator's XCom push

# The run's parameters (defaults, schema, descriptions, checks, time limits) live in embshard.params.
DEFAULT_PARAMS: dict = params_mod.DEFAULT_PARAMS
MAX_POLICY_ROUNDS = params_mod.MAX_POLICY_ROUNDS

# Outer loop: tasks measured per round.
MEASURED_PLAN_TASKS = 4  # the CLI's --measure-tasks default (outer_loop.run) is the same; a test holds them equal

# The run root of a DAG run, in Python (local runner) and as a Jinja template (pod arguments): same result.
RUN_ROOT_TEMPLATE = "{data_root}/{{{{ run_id | replace(':', '-') | replace('+', '-') }}}}"
# All of the run's params as one JSON object, rendered by Airflow into a pod's arguments (or an environment
# variable they refer to, k8s.env_ref). Kubernetes replaces $(NAME) in both with an environment variable and $$
# with $, so every $ is doubled: a param holding "$(HOME)" reaches the stage as it was typed.
PARAMS_TEMPLATE = ("{% filter replace('$', '$$') %}"
                   "{ {%- for k, v in params.items() %}{{ k | tojson }}: {{ v | tojson }}"
                   "{%- if not loop.last %}, {% endif %}{%- endfor %} }"
                   "{% endfilter %}")


def merged(params: dict | None) -> dict:
    """The run's params, defaults filled in, checked (every stage checks them again: a pod gets them as JSON)."""
    return params_mod.check(params, check_files=False)


def _state(root: str, name: str, value: dict | None = None, keys: tuple[str, ...] | None = None) -> dict:
    """Small JSON facts one stage leaves for the next (e.g. which model version it registered)."""
    from . import storage

    target = _join(path(root, "state"), f"{name}.json")
    if value is not None:  # paths under the root recorded relative to it (run_layout.in_root reads them)
        recorded = {k: relative_to_root(root, v) for k, v in value.items()}
        storage.write_text(target, json.dumps(recorded, indent=1, default=str))
        return value
    if not storage.exists(target):
        raise EmbshardError("missing stage output", path=target, fix=f"run the stage that writes {name} first")
    try:
        state = json.loads(storage.read_text(target))
    except (ValueError, UnicodeDecodeError):
        state = None
    if not isinstance(state, dict) or (keys is not None and not set(keys) <= set(state)):
        need = f"an object with {', '.join(keys)}" if keys else "a JSON object"
        raise EmbshardError(f"corrupt stage output (not {need})", path=target,
                            fix=f"run the stage that writes {name} again")
    return state


def _existing(root: str, key: str, stage: str) -> str:
    """The path of a run file an earlier stage wrote; missing: the one-line error that names that stage."""
    from . import storage

    target = path(root, key)
    if not storage.exists(target):
        raise EmbshardError("missing stage output", path=target, fix=f"run the {stage} stage first")
    return target


class StageSkipped(Exception):
    """A stage with nothing to do in this run (an outer-loop round beyond `policy_rounds`): the local runner
    marks the task skipped, a pod exits with SKIP_EXIT_CODE (KubernetesPodOperator's skip_on_exit_code)."""


SKIP_EXIT_CODE = 99


def check_params(root: str, params: dict, check_files: bool = True) -> dict:  # noqa: ARG001 (stage signature)
    """The run's first task: every parameter checked at once (unknown keys, types, ranges, the rules between
    fields, the input file and the tables it lists), in seconds and before any work; a bad run fails here, naming
    each field and fix. `check_files` False where this process does not see the files the stages read (a
    cluster's Airflow worker: the data volume is mounted in the stage pods only; ingest reports a missing file)."""
    p = params_mod.check(params, check_files=check_files)
    if check_files and str(p["device"]).startswith("cuda"):
        # Here the stages run in this machine's processes: CUDA asked for and absent fails now, not after ingest
        # (a cluster's worker is no GPU node: there the measuring pods say it).
        from .bench.backends import check_device

        check_device(str(p["device"]))
    return {"checked": len(p), "device": p["device"], "source": p["source"]}


def trigger_note(events, params: dict) -> list[str]:
    """What check_params says of a run an asset update started (Airflow's `triggering_asset_events`; empty or None
    for a manual or scheduled run): which update, and that the run ingests its params' tables (the DAG's defaults,
    a team's own through EMBSHARD_PARAMS_FILE), not anything an event's extra names. An extra that names params
    is said to be unread, with where to give them instead: such a run had quietly retrained on the defaults."""
    lines: list[str] = []
    for asset in events or {}:
        for event in events[asset] or []:
            where = getattr(getattr(event, "asset", None), "uri", None) or getattr(asset, "uri", asset)
            source = getattr(event, "source_dag_id", None)
            by = f" by {source} (run {getattr(event, 'source_run_id', None)})" if source else ""
            lines.append(f"this run was started by an update of asset {where}{by}; it ingests the tables its params "
                         f"name: source={params.get('source')}"
                         + (f", input={params.get('input')}" if params.get("input") else ""))
            extra = getattr(event, "extra", None) or {}
            named = [k for k in extra if k in params_mod.SPECS] if isinstance(extra, dict) else []
            if named:
                lines.append(f"the asset event's extra names params ({', '.join(named)}) that a run does not read "
                             f"(fix: put them in the file {params_mod.PARAMS_FILE_ENV} names, the defaults of "
                             "scheduled and asset-triggered runs, or trigger the DAG with them as its conf)")
    return lines


def ingest(root: str, params: dict) -> dict:
    from .jobs.ingest import run as ingest_run
    from .jobs.tasks import run as tasks_run

    p = merged(params)
    synthetic = p["source"] == "synthetic"
    kw: dict = {}
    if synthetic:
        kw = {"hot_large_fraction": float(p["hot_large_fraction"]), "fp16_fraction": float(p["fp16_fraction"])}
    elif p["source"] == "dlrm":  # a trace carries no dims, weight type or hash sizes (`embshard ingest --dim` ...)
        rows_file, dim = (p["rows_file"] or "").strip(), str(p["dim"]).strip().lower()  # " Mixed", "64" (checked)
        kw = {"dim": dim if dim == "mixed" else int(float(dim)), "data_type": p["data_type"],
              "rows_file": rows_file.removeprefix("file://") or None}  # read as a local file, like ingest's
    tables = ingest_run(p["source"], root, input=p["input"] or None, seed=int(p["seed"]),
                        num_tables=int(p["num_tables"]) if synthetic else None, **kw)
    _check_population(tables, p)
    tasks = tasks_run(tables, root, num_tasks=int(p["num_tasks"]), tables_per_task=p["tables_per_task"],
                      devices=p["devices"], memory_gb=p["memory_gb"], seed=int(p["seed"]),
                      devices_per_host=None if p["devices_per_host"] is None else int(p["devices_per_host"]))
    return _state(root, "ingest", {"tables": tables, "tasks": tasks})


def _check_population(tables: str, p: dict) -> None:
    """A run learns from at least params.MIN_TABLES tables: said by check_params where it can read the input, here
    where it cannot (a cluster's check_params leaves the file to the ingest pod), before the benchmark, not in
    train_cost_model after it."""
    import pyarrow.parquet as pq

    from . import storage

    fs, path = storage.resolve(tables)
    with fs.open_input_file(path) as f:
        small = params_mod.population_problem(pq.ParquetFile(f).metadata.num_rows, p["source"])
    if small:
        raise EmbshardError(small[0], path=p["input"] or None, field="input", fix=small[1])


def measuring_device(p: dict) -> str:
    """The device this stage measures on (the `device` param; auto: this process's GPU, else the CPU), checked
    before any work: device=cuda where no GPU is visible is a one-line error, never a CPU measurement; so is
    device=auto in a pod that was given GPUs torch cannot see (a node driver too old for the image's CUDA build),
    which would otherwise measure the CPU on a GPU node."""
    from .bench.backends import cuda_absence, resolve_device
    from .k8s import GPUS_GIVEN_ENV

    device = resolve_device(str(p["device"]))
    given = os.environ.get(GPUS_GIVEN_ENV, "").strip()
    if device == "cpu" and str(p["device"]) == "auto" and given.isdigit() and int(given) > 0:
        raise EmbshardError(f"this pod was given {given} GPU(s) but torch sees none ({cuda_absence()}); "
                            "device=auto would measure the CPU", field="device",
                            fix="run an image whose CUDA build the node's NVIDIA driver supports (the default cu130 "
                                "needs driver R580 or newer; docker build --build-arg CUDA_TAG=cu128 for older), "
                                "or set the run's device param to cpu to measure the CPU on purpose")
    log.info("measuring on %s (device param %r)", device, p["device"])
    return device


def sample_shards(root: str, params: dict) -> dict:
    from .bench import backends, comm
    from .jobs.shards import run as shards_run

    p = merged(params)
    device = measuring_device(p)
    tables, tasks = _existing(root, "tables", "ingest"), _existing(root, "tasks", "ingest")  # before calibrating
    # Before any chunk measures: the run takes the shared communication calibration of the hardware it measures
    # on (one per hardware, reused by every run, recalibrated only when asked), so runs and models agree on comm.
    comm.adopt_calibration(root, backends.hardware(device), device=device, recalibrate=bool(p["recalibrate_comm"]))
    shards = shards_run(tables, tasks, root, num_shards=int(p["bench_shards"]), seed=int(p["seed"]))
    return _state(root, "shards", {"shards": shards, "chunks": list(range(int(p["bench_chunks"])))})


def benchmark(root: str, params: dict, chunk: int) -> dict:
    from .jobs.bench import run as bench_run

    p = merged(params)
    st = measure_settings(root, p)
    # sampled once by sample_shards; every chunk reads the same list
    shards = in_root(root, _state(root, "shards", keys=("shards",))["shards"])
    parts = bench_run(path(root, "tables"), shards, root, settings=st, chunk=int(chunk),
                      num_chunks=int(p["bench_chunks"]))
    return {"chunk": int(chunk), "parts": parts, "device": st.device}


def measure_settings(root: str, p: dict):
    """How every measuring stage of a run measures: on the run's device (checked here, before any work), with
    the same batch (0: the device's default), the all-to-all measured among the host's GPUs when it has several,
    and the run's one communication calibration (written under the run root by sample_shards), so costs stay
    comparable across stages."""
    from .bench.comm import measured_ranks
    from .bench.runner import MeasureSettings

    device = measuring_device(p)
    batch = int(p["bench_batch_size"])
    return MeasureSettings(device=device, batch_size=batch if batch > 0 else None, calibration_dir=root,
                           comm_ranks=measured_ranks(device))


def loop_layout(root: str):
    """Where the outer loop's rounds write under a run root (embshard.outer_loop, shared with the CLI)."""
    from .outer_loop import LoopLayout

    return LoopLayout(policy=path(root, "policy"), cost_model=path(root, "cost_model"))


def round_skipped(p: dict, round_index: int | None) -> str | None:
    """Why an outer-loop round's stage has nothing to do in a run of params `p` (a round beyond `policy_rounds`),
    else None. The kubernetes runner asks before it starts a pod; the stage asks again itself."""
    rounds = int({**DEFAULT_PARAMS, **p}["policy_rounds"])
    if round_index is not None and round_index > rounds:
        return f"round {round_index} of {rounds}: nothing to do"
    return None


def _check_round(p: dict, round_index: int) -> None:
    why = round_skipped(p, round_index)
    if why:
        raise StageSkipped(why)


def train_cost_model(root: str, params: dict, round_index: int = 1) -> dict:
    """Round 1: the cost model from the benchmark's costs. Round r > 1 (the outer loop's refit): from the
    benchmark's costs and the measured plans of every round so far."""
    from .outer_loop import fit_cost_model

    p = merged(params)
    _check_round(p, round_index)
    res = fit_cost_model(path(root, "tables"), path(root, "costs"), loop_layout(root), round_index=round_index,
                         seed=int(p["seed"]), members=int(p["cost_members"]), calibration_dir=root)
    state = {"model_uri": res["model_uri"], "version": str(res["model_version"]), "round": round_index,
             "summary": res.get("summary", "")}
    _state(root, f"cost_model-round-{round_index}", state)  # what that round's policy trains against
    return _state(root, "cost_model", state)


def train_policy(root: str, params: dict, round_index: int = 1) -> dict:
    """One round of the policy, from the previous round's weights, against the latest cost model; the last
    round (`policy_rounds`) registers the candidate that evaluation measures."""
    from .outer_loop import train_policy_round

    p = merged(params)
    _check_round(p, round_index)
    cm = _cost_model_of_round(root, round_index)
    # Round r starts from round r-1's policy (its own state), not from "the latest policy": a stage run again
    # (Airflow's Clear) gets the same inputs whatever ran after it.
    prev = _policy_of_round(root, round_index - 1)[0] if round_index > 1 else None
    res = train_policy_round(path(root, "tables"), path(root, "tasks"), loop_layout(root),
                             cost_model_uri=cm["model_uri"], iterations=int(p["policy_iterations"]),
                             rounds=int(p["policy_rounds"]), round_index=round_index, init_policy=prev,
                             seed=int(p["seed"]), curriculum=str(p["policy_curriculum"]))
    state = {"policy_dir": res["policy_dir"], "round": round_index, "model_uri": res.get("model_uri"),
             "version": res.get("version"), "cost_model_uri": res["cost_model_uri"],
             "val_ratio": res["final_val_ratio"]}
    _state(root, f"policy-round-{round_index}", state)  # what the next round starts from and measures
    if round_index < int(p["policy_rounds"]):  # the run's candidate (what evaluation measures) is the last round's
        return state
    return _state(root, "policy", state)


def _round_state(root: str, name: str, round_index: int, keys: tuple[str, ...]) -> dict | None:
    """Round `round_index`'s `name` state (state/<name>-round-<r>.json), so that a round run again (Airflow's
    Clear) reads its own round's inputs whatever ran after it. Roots written before the per-round files: the
    latest state (state/<name>.json) when it is that round's, else None (the caller says what to run)."""
    from . import storage

    if storage.exists(_join(path(root, "state"), f"{name}-round-{round_index}.json")):
        return _state(root, f"{name}-round-{round_index}", keys=keys)
    latest = _state(root, name, keys=keys)
    return latest if int(latest.get("round", 1)) == round_index else None


def _cost_model_of_round(root: str, round_index: int) -> dict:
    """Round `round_index`'s cost model (_round_state): what that round's policy trains against."""
    cm = _round_state(root, "cost_model", round_index, ("model_uri",))
    if cm is None:
        stage = "train_cost_model" if round_index == 1 else f"refit_cost_model_r{round_index}"
        latest = _state(root, "cost_model")
        raise EmbshardError(f"the run's cost model is round {latest.get('round', 1)}'s, not round {round_index}'s",
                            path=_join(path(root, "state"), "cost_model.json"),
                            fix=f"run train_cost_model --round {round_index} first (the DAG's {stage})")
    return cm


def measure_policy_plans(root: str, params: dict, round_index: int = 2) -> dict:
    """The outer loop's measuring step before round `round_index`: the last policy's plans, measured."""
    from .outer_loop import measure_round

    p = merged(params)
    _check_round(p, round_index)
    policy_dir, cost_model_uri = _policy_of_round(root, round_index - 1)  # the round before's, run again or not
    costs = measure_round(path(root, "tables"), path(root, "tasks"), loop_layout(root),
                          policy_dir=policy_dir, cost_model_uri=cost_model_uri,
                          round_index=round_index, num_tasks=MEASURED_PLAN_TASKS,
                          settings=measure_settings(root, p), seed=int(p["seed"]))
    return {"round": round_index, "costs": costs}


def _policy_of_round(root: str, round_index: int) -> tuple[str, str]:
    """(folder, cost model URI) of round `round_index`'s policy, from the state that round left (_round_state)."""
    state = _round_state(root, "policy", round_index, ("policy_dir", "cost_model_uri"))
    if state is None:
        raise EmbshardError(f"missing stage output (round {round_index}'s policy)",
                            path=_join(path(root, "state"), f"policy-round-{round_index}.json"),
                            fix=f"run train_policy round {round_index} first")
    return in_root(root, state["policy_dir"]), state["cost_model_uri"]


def evaluate_and_promote(root: str, params: dict) -> dict:
    from .jobs.promote import evaluate_and_promote as promote

    p = merged(params)
    pol = _state(root, "policy", keys=("version",))
    from . import schemas, storage
    from .jobs.evaluate import OUTPUT as EVALUATION

    # The device and the inputs first: a try that fails on them leaves the decision an earlier try recorded.
    settings = measure_settings(root, p)
    schemas.read(path(root, "tables"), "tables")
    schemas.read(path(root, "tasks"), "tasks")
    # Then a decision an earlier try left (perhaps about another candidate) goes, with the measurements it was
    # made on: a try stopped before it decides leaves none, never a stale one beside no decision.
    evaluation = path(root, "evaluation")
    for stale in (_join(path(root, "state"), "promotion.json"), _join(evaluation, "decision.json"),
                  *(_join(evaluation, name) for name in EVALUATION["writes"])):
        storage.remove(stale)
    # All rounds in this process, unlike the quality suites' fresh process per round (--round-processes): a
    # process spawned from an Airflow task runner failed (tests/test_airflow_real.py), so the gate keeps the
    # long-process bias docs/method.md describes (large tables 12-17% faster after a while).
    decision = promote(path(root, "tables"), path(root, "tasks"), path(root, "evaluation"),
                       candidate_version=pol["version"],
                       baselines=params_mod.planners_of(p["eval_planners"]),
                       max_tasks=int(p["eval_tasks"]), margin=float(p["promotion_margin"]),
                       settings=settings, rounds=int(p["eval_rounds"]))
    return _state(root, "promotion", decision)


def export_placements(root: str, params: dict) -> dict:
    from . import registry, schemas, storage
    from .jobs.export import place_tasks
    from .jobs.export import run as export_run
    from .planners import get_planner

    p = merged(params)
    # The inputs first: a missing or corrupt file is an error, not a reason to skip.
    schemas.read(_existing(root, "tables", "ingest"), "tables")
    schemas.read(_existing(root, "tasks", "ingest"), "tasks")
    registry.use(path(root, "export"))
    if registry.version_for_alias(registry.POLICY_MODEL, registry.CHAMPION) is None:
        # The gate kept every candidate so far from being champion: nothing a training job should load yet.
        decision = _join(path(root, "evaluation"), "decision.json")
        why = (f"the candidate was not promoted: see {decision}" if storage.exists(decision) else
               "no evaluate_and_promote decision in this root either")
        raise StageSkipped(f"no embshard-policy@champion in the registry yet ({why})")
    # refine_k > 0: each task's K best candidates measured here, on the run's device (embshard.refine)
    placements = place_tasks(path(root, "tables"), path(root, "tasks"), get_planner("learned@champion"),
                             _join(path(root, "export"), "planned.parquet"), split=p["export_tasks"],
                             refine_k=int(p["refine_k"]), refine_rounds=int(p["eval_rounds"]),
                             settings=measure_settings(root, p) if int(p["refine_k"]) else None)
    res = export_run(placements, path(root, "tables"), path(root, "export"), tasks=path(root, "tasks"))
    return _state(root, "export", {"placements": placements, **{k: v for k, v in res.items()
                                                                  if isinstance(v, (str, int, float))}})


STAGES: dict[str, Callable[..., dict]] = {
          "check_params": check_params, "ingest": ingest, "sample_shards": sample_shards, "benchmark": benchmark,
          "train_cost_model": train_cost_model, "train_policy": train_policy,
          "measure_policy_plans": measure_policy_plans, "evaluate_and_promote": evaluate_and_promote,
          "export_placements": export_placements}
ROUND_STAGES = ("train_cost_model", "train_policy", "measure_policy_plans")


AIRFLOW_RUN_ENV = "EMBSHARD_AIRFLOW_RUN_ID"  # the Airflow run a stage belongs to (run_context.lineage_env, pods)


def _note_run(root: str, params: dict) -> None:
    """What a stage run again by hand needs of its run (`embshard stage NAME --root ROOT`): the params the run was
    started with and its MLflow store, recorded by ingest (state/run.json). Without them a by-hand stage ran on
    the default params and registered into a new, empty store inside the root. Also the Airflow run it belongs
    to, which `_check_own_root` compares."""
    _state(root, "run", {"params": merged(params), "mlflow_tracking_uri": os.environ.get("MLFLOW_TRACKING_URI"),
                         "airflow_run_id": os.environ.get(AIRFLOW_RUN_ENV) or None})


def _check_own_root(root: str) -> None:
    """A stage of an Airflow run refuses a root that another Airflow run's ingest wrote: run ids that differ only
    in ':' or '+' against '-' ('retrain:1', 'retrain-1') share a root (run_layout.run_root), and the second run
    had silently reused the first's measurements and overwritten its state, models and exports. A stage run by
    hand (no Airflow run) or a root written before the run was recorded is not checked."""
    from . import storage

    mine = os.environ.get(AIRFLOW_RUN_ENV)
    if not mine or not storage.exists(_join(path(root, "state"), "run.json")):
        return
    owner = _state(root, "run").get("airflow_run_id")
    if owner and owner != mine:
        raise EmbshardError(f"this run folder belongs to Airflow run {owner!r}, not to {mine!r}: run ids that "
                            "differ only in ':' or '+' against '-' share a folder", path=root, field="run_id",
                            fix="trigger the run again with a run id of its own (or Airflow's default one)")


def recorded_run(root: str) -> dict | None:
    """The run's recorded params and MLflow store (state/run.json), None for a root written before they were."""
    from . import storage

    if not storage.exists(_join(path(root, "state"), "run.json")):
        return None
    return _state(root, "run")


def _note_code_version(root: str, name: str) -> None:
    """A run's stages should all run one version of the code (a `git pull` or an upgraded image mid-run mixes
    them, and a stage then fails on, or trains with, code its inputs were not made with): ingest, the run's first
    stage that writes, records it (state/code_version.json); a later stage running other code says so."""
    from . import storage
    from .version import code_version

    mine = code_version(fresh=True)
    if name == "ingest":
        _state(root, "code_version", {"code_version": mine})
        return
    if not storage.exists(_join(path(root, "state"), "code_version.json")):
        return  # a root written before this was recorded
    started = _state(root, "code_version", keys=("code_version",))["code_version"]
    if started != mine:
        log.warning("stage %s runs code %s, but this run's ingest ran %s: its inputs were made by other code "
                    "(fix: run the pipeline again from ingest on one version)", name, mine, started)


def failure_reason(exc: BaseException) -> str:
    """The first line of a stage's error, as the console and `embshard pipeline`'s summary give it."""
    if type(exc).__name__ == "AirflowTaskTimeout":  # its own text is "Timeout, PID: N"
        return ("over its time limit (the task's execution_timeout, sized from the run's params: give a larger "
                "timeout_scale if the stage was not hung)")
    # SQLAlchemy puts its context before the cause ("(raised as a result of Query-invoked autoflush; ...)" over
    # "(sqlite3.OperationalError) database or disk is full"): the cause is the line to show.
    lines = [line for line in str(exc).splitlines()
             if line.strip() and not line.startswith(("(raised as a result of", "(Background on this error"))]
    return lines[0] if lines else type(exc).__name__


# The stages that log to MLflow or register models (the others only read and write the run root).
REGISTERS = ("train_cost_model", "train_policy", "measure_policy_plans", "evaluate_and_promote", "export_placements")


def run(name: str, root: str, params: dict, chunk: int | None = None, round_index: int | None = None) -> dict:
    """Run one stage on a run root; returns its small JSON-able result. Raises StageSkipped when an outer-loop
    round has nothing to do."""
    if name not in STAGES:
        raise EmbshardError(f"unknown stage {name!r}", field="stage", fix=f"use one of {', '.join(STAGES)}")
    fn = STAGES[name]
    if round_index is not None:
        first = 2 if name == "measure_policy_plans" else 1  # it measures the round before's policy
        if name not in ROUND_STAGES:
            raise EmbshardError(f"stage {name} has no rounds", field="round",
                                fix=f"drop --round (only {', '.join(ROUND_STAGES)} take one)")
        if int(round_index) < first:
            raise EmbshardError(f"round {round_index}: {name}'s rounds start at {first}", field="round",
                                fix=f"give --round {first} or more (up to policy_rounds)")
        if int(round_index) > MAX_POLICY_ROUNDS:  # the DAG's tasks stop there; a round beyond is a typo
            raise EmbshardError(f"round {round_index}: a run has at most {MAX_POLICY_ROUNDS} rounds", field="round",
                                fix=f"give --round {first}..{MAX_POLICY_ROUNDS} (up to the run's policy_rounds)")
    _check_own_root(root)
    if name == "ingest":
        return _ingest_or_nothing(root, params)
    if name != "check_params":
        _note_code_version(root, name)
    if name in REGISTERS:
        from . import registry

        registry.check_store()  # before the work: a store that cannot take its results fails it at once
    if name == "benchmark":
        return fn(root, params, int(chunk or 0))
    if name in ROUND_STAGES and round_index is not None:
        return fn(root, params, int(round_index))
    return fn(root, params)


def _ingest_or_nothing(root: str, params: dict) -> dict:
    """The ingest stage, leaving nothing half-written when it fails: the run's facts it records first
    (state/run.json, state/code_version.json) and what it wrote before failing (tables.parquet when its tasks
    could not be sampled) are removed, unless an earlier ingest of the root had written them."""
    from . import storage

    outputs = [_join(path(root, "state"), f) for f in ("run.json", "code_version.json", "ingest.json")] + [
        path(root, "tables"), path(root, "tasks")]
    made = [p for p in outputs if not storage.exists(p)]
    try:
        _note_code_version(root, "ingest")
        _note_run(root, params)
        return STAGES["ingest"](root, params)
    except BaseException:
        for p in made:
            if storage.exists(p):
                storage.remove(p)
        raise


# (task, first line of its error) of the stages that failed in this process (the local runner: `embshard
# pipeline` names the first in its own error)
FAILURES: list[tuple[str, str]] = []


def run_in_task(name: str, data_root: str, mlflow_uri: str, params: dict, *, run_id: str, dag_id: str,
                task_id: str | None = None, try_number: int | None = None, chunk: int | None = None,
                round_index: int | None = None) -> dict:
    """A stage inside an Airflow task of the local runner: the run's one data root and MLflow store, lineage
    tags for MLflow, progress on stdout, a readable block in the task log; returns the result (the XCom)."""
    from . import run_context

    root = run_root(data_root, run_id)
    label = (task_id or name) + (f"[{chunk}]" if chunk is not None else "")
    env = {**run_context.lineage_env(dag_id, run_id, task_id or name, root, try_number),
           "EMBSHARD_DATA_ROOT": data_root, "MLFLOW_TRACKING_URI": mlflow_uri}
    start = time.perf_counter()
    # Airflow's task runner has just replaced the SIGTERM handler with one that lets the task go on: put back
    # ours, so that a `kill` of `embshard pipeline` (or of a worker) stops the stage (embshard.signals).
    from .signals import stop_on_sigterm

    stop_on_sigterm()
    # A start line, so that the console says which stage runs (its progress bars go to its log).
    run_context.progress(f"  {label:<28} started")
    try:
        with run_context.stage_output(env):
            result = run(name, root, params, chunk, round_index)
    except StageSkipped as exc:
        run_context.progress(f"  {label:<28} skipped: {exc}")
        raise
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM (embshard.signals): stopped, not a failure of the stage
        run_context.progress(f"  {label:<28} stopped after {time.perf_counter() - start:6.1f} s")
        FAILURES.append((label, "stopped"))
        raise
    except BaseException as exc:
        reason = failure_reason(exc)
        run_context.progress(f"  {label:<28} FAILED after {time.perf_counter() - start:6.1f} s: {reason[:300]}")
        FAILURES.append((label, reason))
        raise
    run_context.progress(f"  {label:<28} done in {time.perf_counter() - start:6.1f} s")
    log_report(name, result, root)
    return _jsonable(result)


def end_failed_task_runs(mlflow_uri: str, data_root: str, dag_id: str, run_id: str, task_id: str) -> list[str]:
    """What a failed task of the local runner leaves behind in MLflow, ended (its on_failure_callback): the runs
    its stage left RUNNING are marked KILLED (registry.end_stale_runs). A stage that raises ends its own run as
    FAILED; one killed hard (SIGKILL, out of memory) cannot. Best effort: Airflow's supervisor fails a SIGKILLed
    task without running callbacks (3.3.2's LocalExecutor), and then the next stage that logs to MLflow, a retry
    or the next run's, ends it (registry.start_run). Returns the MLflow run ids ended."""
    import mlflow

    from . import registry

    mlflow.set_tracking_uri(mlflow_uri)
    ended = registry.end_stale_runs(run_id, task_id, dag_id=dag_id, run_root=run_root(data_root, run_id),
                                    reason=f"Airflow task {task_id} of run {run_id} failed while this run was "
                                    "open (its process was killed)")
    for mlflow_run in ended:
        log.warning("ended MLflow run %s as KILLED: task %s failed while it was running", mlflow_run, task_id)
    return ended


def _jsonable(value):
    """A stage result as an XCom: JSON values only (NaN and infinities, which JSON cannot hold, become null)."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else None
    if value is None or isinstance(value, (str, int, bool)):
        return value
    try:
        return _jsonable(float(value))  # numpy scalars
    except (TypeError, ValueError):
        return str(value)


def log_report(name: str, result: dict, root: str) -> None:
    """The report into the task's log through logging, not print: Airflow's task runner reads stdout and log
    records on two sockets, so a printed block could arrive after its "::group::Post Execute" record and land in
    that collapsed group; a log record keeps its place before it. One record per line keeps the block aligned."""
    sys.stdout.flush()  # anything printed before (progress) first
    for line in report(name, result, root).splitlines():
        log.info("%s", line)


# --root is what a stage writes under: checked before any work (cli.check_output), a file given is one line.
OUTPUT = {"kind": "folder", "option": "root"}


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", choices=list(STAGES), help="the stage to run")
    p.add_argument("--root", required=True, help="run root (folder, file:// or s3:// URI); the MLflow store is "
                   "MLFLOW_TRACKING_URI, else the run's own (recorded by its ingest in state/run.json), else (a "
                   "local root) ROOT/mlflow.db, shared by every stage of the root")
    p.add_argument("--params", default=None,
                   help="pipeline parameters as JSON, over the run's own (state/run.json, recorded by its ingest), "
                        "else over the defaults (embshard.stages.DEFAULT_PARAMS)")
    p.add_argument("--chunk", type=int, default=0, help="benchmark chunk index (benchmark stage only)")
    p.add_argument("--round", type=int, default=None, dest="round_index",
                   help=f"outer-loop round of {', '.join(ROUND_STAGES)} (default: 1; measure_policy_plans: 2)")


def main(args) -> int:
    try:
        params = json.loads(args.params if args.params is not None else "{}")
    except json.JSONDecodeError as exc:
        raise EmbshardError(f"not valid JSON ({exc.msg})", field="params", fix="pass a JSON object") from None
    if not isinstance(params, dict):
        raise EmbshardError(f"a JSON {type(params).__name__}, not an object", field="params",
                            fix='pass a JSON object of run params, e.g. \'{"num_tables": 64}\'')
    # By hand too, what a stage registers is tagged with its run root (embshard.run_root), as inside Airflow.
    root = str(args.root)
    os.environ.setdefault("EMBSHARD_RUN_ROOT", root if "://" in root else os.path.abspath(root))
    run_facts = recorded_run(root) if args.name not in ("check_params", "ingest") else None
    if run_facts:
        # A stage of a pipeline's run, run again by hand: that run's params (the ones given go over them) and store.
        params = {**(run_facts.get("params") or {}), **params}
        store, given = run_facts.get("mlflow_tracking_uri"), os.environ.get("MLFLOW_TRACKING_URI")
        if store and not given:
            os.environ["MLFLOW_TRACKING_URI"] = store
        where = f", from {_join(path(root, 'state'), 'run.json')}"
        if given and given != store:  # the store the stage will use, not the recorded one it will not
            where += f"; MLflow store {given} (MLFLOW_TRACKING_URI" + (f", not the run's {store})" if store else ")")
        elif store:
            where = f" and MLflow store {store}" + where
        print(f"embshard stage {args.name}: the run's params" + (" (with those given)" if args.params else "")
              + where, flush=True)
    if not os.environ.get("MLFLOW_TRACKING_URI") and "://" not in str(args.root):
        # By hand, without a store named: the root's own, so that every stage of the root (train_cost_model,
        # train_policy, the gate, export) registers and finds the same models. (The DAG and its pods name one.)
        os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{os.path.join(os.path.abspath(args.root), 'mlflow.db')}"
    try:
        res = run(args.name, args.root, params, args.chunk, args.round_index)
    except StageSkipped as exc:
        print(f"embshard stage {args.name}: skipped ({exc})")
        return SKIP_EXIT_CODE
    print(report(args.name, res, args.root))
    print(json.dumps(res, indent=1, default=str))
    if args.name == "sample_shards" and os.path.isdir(XCOM_DIR):
        # KubernetesPodOperator(do_xcom_push=True) reads this: the benchmark chunks to map over.
        with open(os.path.join(XCOM_DIR, "return.json"), "w", encoding="utf-8") as f:
            json.dump(list(range(int(merged(params)["bench_chunks"]))), f)
    return 0
