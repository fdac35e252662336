"""Placing one set of tables with any planner, with predicted costs, the balanced estimate and the outputs."""
from __future__ import annotations

import argparse
import json
import logging
import os
from typing import Any

import numpy as np

from .. import schemas, storage
from ..checks import MAX_LOCAL_DEVICES, gib_text
from ..errors import EmbshardError, ModelFilesMissingError, ModelNotFoundError
from ..ingest.spec import is_spec_path, read_tables, spec_sizes
from ..placement import Placement
from ..planners import composition_of, get_planner, is_planner_name, learned_uri
from ..planners.base import BYTES_HINT, MEMORY_FIELD, check_capacity, check_feasible, full_warning
from ..registry import COST_CHAMPION_URI, POLICY_CHAMPION_URI
from ..tableset import TableSet
from ..torchrec_compat import unnamable_warning
from ..types import DeviceTopology, devices_per_host_of

# torch, MLflow, TorchRec and matplotlib are imported where they are used: a heuristic plan and every input error
# come back without them (seconds, not tens of seconds, for `embshard place`).
log = logging.getLogger(__name__)
NO_COST_MODEL_NOTE = ("predicted costs: none (this planner uses no cost model; give --cost-model "
                      f"{COST_CHAMPION_URI} to predict them)")


def resolve_task(tables: str, tasks: str | None, task_id: str | None, devices: int | None,
                 memory_bytes: int | None) -> tuple[TableSet, int, int, str, str, int | None]:
    """(tables, devices, memory per device, task id, where, devices per host of the task or None): `where` names
    the input file in errors."""
    if task_id is None and devices is not None and memory_bytes is not None and is_spec_path(tables):
        # A spec's access features take ~26 ms a table to sample: tables that cannot fit are said before that.
        try:
            sizes, names, rows = spec_sizes(tables)
            check_capacity(sizes, int(devices), int(memory_bytes), names=names, rows=rows)
        except EmbshardError as exc:
            raise exc.at(os.fspath(tables)) from None
    table_set = read_tables(tables)
    if task_id is None:
        if devices is None or memory_bytes is None:
            raise EmbshardError("devices and memory per device are required without a task id", field="devices",
                                fix="give devices and memory_bytes, or tasks and task_id")
        return table_set, int(devices), int(memory_bytes), "task", os.fspath(tables), None
    if tasks is None:
        raise EmbshardError("--task-id needs --tasks", field="tasks", fix="pass --tasks tasks.parquet")
    df = schemas.read(tasks, "tasks")
    row = df[df["task_id"] == task_id]
    if row.empty:
        raise EmbshardError(f"no task {task_id!r}", path=tasks, field="task_id",
                            fix=f"choose one of {', '.join(df['task_id'].head(5))}...")
    r = row.iloc[0]
    where = f"{os.fspath(tasks)} (task {task_id})"
    # A value given explicitly wins, also when it is wrong: the caller checked it (0 is not "not given").
    return (table_set.select(list(r["table_ids"]), where, source=os.fspath(tables)),
            int(r["num_devices"] if devices is None else devices),
            int(r["memory_bytes_per_device"] if memory_bytes is None else memory_bytes), task_id, where,
            devices_per_host_of(r))


def load_cost_model_or_none(uri: str | None):
    """The cost model `uri` names, or None without one: a planner that plans without a model loads none by default
    (loading one costs seconds, and its predictions are for the hardware it was measured on)."""
    if not uri:
        return None
    from ..costmodel import load

    return load(uri)


def planner_for(name: str, model_uri: str, time_budget_s: float | None, search_evaluations: int | None = None):
    kw: dict[str, Any] = {"model_uri": model_uri}
    if name.startswith("torchrec_"):  # its search's time limit: a person waits for this plan
        from ..planners.torchrec_planner import DEFAULT_TIMEOUT_S

        kw["timeout_s"] = DEFAULT_TIMEOUT_S if time_budget_s is None else time_budget_s
    elif time_budget_s is not None:
        kw["time_budget_s"] = time_budget_s
    if search_evaluations is not None:
        kw["search_evaluations"] = search_evaluations
    try:
        return get_planner(name, **kw)
    except ModelFilesMissingError:
        raise  # it names the version and the file: "train one" would be the wrong fix
    except ModelNotFoundError as exc:
        first = exc.fix or "train one with `make run` or `embshard train-policy ...`"  # e.g. where the store is
        # the same type: a registry that did not answer keeps its exit code (75: try again)
        raise type(exc)(
            f"no registered learned planner ({exc.message})", path=learned_uri(name, model_uri),
            fix=f"{first}; or pick a baseline with --planner size_lookup_greedy") from exc


def predicted(placement: Placement, planner, cost_model) -> tuple[np.ndarray | None, float | None]:
    model = getattr(planner, "cost_model", None) or cost_model
    if model is None:
        return None, None
    from ..planners.scoring import predicted_costs

    costs, estimate, checked = predicted_costs(model, placement)
    if checked is None:
        log.info("balanced estimate %.3f ms withheld: the cost model predicts a placement below it on these tables",
                 estimate)
    return costs, checked


def _hardware_warning(model, hardware: str | None, planning: bool = False) -> str | None:
    """`planning`: the planner chose the plan with this model (else it only predicts the plan's costs)."""
    if model is None:
        return None
    from ..bench.backends import check_target
    from ..planners.scoring import model_hardware

    return check_target(model_hardware(model), hardware, planning)


def _record_warnings(placement: Placement, logged: list[str | None], lines: list[str | None]) -> None:
    """Log `lines` that the planner did not already give, and record them, the `logged` ones (said before planning)
    and the planner's own in the plan's meta.warnings (plan.json, placements.parquet): a training job that reads
    only the plan learns what `place` said."""
    said = [line for line in logged if line] + list(placement.meta.get("warnings") or [])
    for line in lines:
        if line and line not in said:
            log.warning(line)
            said.append(line)
    if said:
        placement.meta["warnings"] = list(dict.fromkeys(said))


# Long plans (thousands of tables with the learned planner take tens of seconds) say that they are going on:
# a line on stderr after PROGRESS_AFTER_S, then every PROGRESS_EVERY_S, with the planner's current phase.
PROGRESS_AFTER_S = 5.0
PROGRESS_EVERY_S = 10.0


class PlanningProgress:
    """`with PlanningProgress("planning ...") as progress:` prints progress lines on stderr while the block runs
    longer than PROGRESS_AFTER_S; `progress.phase(text)` (a planner's `on_phase` hook) names what it is doing."""

    def __init__(self, what: str, stream=None):
        import threading

        self.what, self.stream, self.current = what, stream, "starting"
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="embshard-place-progress", daemon=True)
        self.lines = 0

    def phase(self, text: str) -> None:
        self.current = text

    def _run(self) -> None:
        import sys
        import time

        start = time.perf_counter()
        wait = PROGRESS_AFTER_S
        while not self._done.wait(wait):
            stream = self.stream or sys.stderr
            print(f"place: {self.what}: {time.perf_counter() - start:.0f} s, {self.current}", file=stream,
                  flush=True)
            self.lines += 1
            wait = PROGRESS_EVERY_S

    def __enter__(self) -> PlanningProgress:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()


def place(tables: str, out: str, *, devices: int | None = None, memory_bytes: int | None = None,
          planner: str = "learned", model_uri: str = POLICY_CHAMPION_URI,
          cost_model_uri: str | None = None, tasks: str | None = None, task_id: str | None = None,
          time_budget_s: float | None = None, search_evaluations: int | None = None,
          hardware: str | None = None, refine_k: int = 0, refine_rounds: int = 5,
          devices_per_host: int | None = None, calibration_dir: str | None = None,
          memory_field: str = "memory_bytes") -> dict:
    """`memory_field`: what the caller calls `memory_bytes` (the CLI: memory_gb), named by a memory error when the
    memory is the caller's, not a tasks file's. `devices_per_host`: the devices share hosts of that many
    (TorchRec's rank order), which lets a planner cut a table row-wise over one host's devices (table-row-wise);
    None: the task's, else one host. `hardware`: what the plan is for (default: this machine); a model measured on
    other hardware is warned about in one line, since its predicted costs are for its own hardware. `refine_k` > 0:
    the K best distinct candidate plans are measured here side by side (embshard.refine) and the measured best is
    written, with the all-to-all calibration in `calibration_dir` (default: EMBSHARD_CALIBRATION_DIR, else
    calibrated now)."""
    from ..export.placements import plan_frame
    from ..export.plan_json import write_plan_json
    from ..placement_report import device_table, plot_device_costs

    # Every check that needs no model comes before any model is loaded (or torch imported).
    table_set, D, mem, tid, where, task_per_host = resolve_task(tables, tasks, task_id, devices, memory_bytes)

    def as_given(exc: EmbshardError) -> EmbshardError:
        """`exc` naming the user's file, and the caller's memory field where the memory is theirs (the library's
        memory_bytes_per_device is a tasks file's column: a user who typed --memory-gb had been told of it)."""
        if memory_bytes is None or exc.field != MEMORY_FIELD:
            return exc.at(where)
        fix = (exc.fix or "").replace(BYTES_HINT, "")
        return type(exc)(exc.message, path=where, field=memory_field, fix=fix or None)

    try:
        check_feasible(table_set, D, mem, tid)
    except EmbshardError as exc:
        raise as_given(exc) from None
    try:
        topology = DeviceTopology.on_hosts(D, mem, task_per_host if devices_per_host is None else devices_per_host)
    except EmbshardError as exc:  # --devices-per-host's mistake (the file's only when it is the task's own)
        raise (exc.at(where) if devices_per_host is None else exc) from None
    # Said now (before a long plan), recorded in the plan's meta with the others once it is made.
    early: list[str | None] = [unnamable_warning(table_set.table_ids)]
    if topology.hosts is None and D > MAX_LOCAL_DEVICES:  # export would refuse it (torchrec_plan.to_torchrec_plan)
        early.append(f"{D} devices on one host: the TorchRec export needs the GPUs per host (torch numbers a host's "
                     f"GPUs 0-{MAX_LOCAL_DEVICES - 1}); give --devices-per-host here or to export")
    for line in early:
        if line:
            log.warning(line)
    if not is_planner_name(planner):
        get_planner(planner)  # the unknown-planner error, with the list of planners
    # A learned planner predicts with its own cost model; a bad --cost-model fails before planning.
    learned = composition_of(planner) is not None
    cost_model = None if learned else load_cost_model_or_none(cost_model_uri)
    p = planner_for(planner, model_uri, time_budget_s, search_evaluations)
    if hasattr(p, "warned_lines"):  # said above: the planner does not say them again
        p.warned_lines().update(line for line in early if line)
    if refine_k:
        from ..refine import explore

        explore(p)  # the cuts the planner does not keep, carried on, are candidates too
    try:
        with PlanningProgress(f"planning {len(table_set):,} tables on {D:,} devices ({planner})") as progress:
            if hasattr(p, "on_phase"):
                p.on_phase = progress.phase
            else:  # TorchRec's planners report no phases: say what runs, and for how long at most
                timeout = getattr(p, "timeout_s", None)
                progress.phase("its search" + (f" (asked to stop by {timeout:.0f} s; TorchRec checks that between "
                                               "proposals)" if timeout else ""))
            placement = p.plan(table_set, topology, task_id=tid)
    except EmbshardError as exc:  # name the user's file, not the internal task name
        raise as_given(exc) from None
    own = getattr(p, "cost_model", None)
    pricing = own or cost_model  # the model that chose or prices the plan (None: no costs, and no torch imported)
    refined = None
    if refine_k:
        placement, refined = _refine(placement, p, cost_model, refine_k, refine_rounds, hardware, where,
                                     calibration_dir)
    costs, lb = predicted(placement, p, cost_model)
    late: list[str | None] = []
    if pricing is not None:
        from ..planners.scoring import model_hardware, unseen_types_warning

        if hardware_of_model := model_hardware(pricing):
            placement.meta["model_hardware"] = hardware_of_model
        late += [_hardware_warning(pricing, hardware, planning=own is not None),
                 unseen_types_warning(pricing, table_set)]
    # Logged where the planner did not (a learned planner gives the types line itself), all in the plan's meta.
    _record_warnings(placement, early, [*late, full_warning(placement)])
    with storage.staged_dir(out) as stage:  # all three files or none
        write_plan_json(placement, os.path.join(stage, "plan.json"), device_costs=costs, balanced_estimate=lb)
        schemas.write(plan_frame(placement, costs, lb), os.path.join(stage, "placements.parquet"), "placements")
        plot_device_costs(placement, costs, os.path.join(stage, "devices.png"), lb)
    split = batch = None
    if costs is not None and pricing is not None:  # what the step cost is made of, and its batch
        from ..costmodel.scoring import placement_split

        split = placement_split(pricing, placement)
        batch = getattr(getattr(pricing, "config", None), "batch_size", None)
    report = device_table(placement, costs, lb, full_table=storage.join(out, "plan.json"), device_split=split,
                          batch_size=batch)
    if costs is None:
        report += "\n" + NO_COST_MODEL_NOTE
    return {"plot": storage.join(out, "devices.png"), "placement": placement, "device_costs": costs,
            "balanced_estimate": lb, "plan_json": storage.join(out, "plan.json"),
            "placements": storage.join(out, "placements.parquet"), "refinement": refined, "report": report}


def _warn_if_priced_for_another_network(cost_model, hardware: str, calibration_dir: str | None) -> None:
    """The refinement measures with this machine's all-to-all calibration; say so when the model that chose the
    candidates was trained on another (only where one is already stored: none is made here for this)."""
    from ..bench.comm import calibration_mismatch, model_from_dict, run_calibration

    trained = getattr(getattr(cost_model, "config", None), "comm_calibration", None)
    stored = run_calibration(calibration_dir, hardware) if trained and calibration_dir is not None else None
    if not stored:
        return
    msg = calibration_mismatch(trained, model_from_dict(stored))
    if msg:
        log.warning("place --refine: %s", msg)


def _refine(placement: Placement, planner, cost_model, k: int, rounds: int, hardware: str | None, where: str,
            calibration_dir: str | None = None):
    """The measured refinement (embshard.refine) on this machine, which must be the hardware the plan is for."""
    from ..bench.backends import hardware as hardware_of
    from ..bench.backends import resolve_device
    from ..bench.comm import shared_calibration_dir
    from ..bench.runner import MeasureSettings
    from ..hardware import same_hardware
    from ..refine import check_k, check_rounds, refine, winner_placement

    k, rounds = check_k(k), check_rounds(rounds)
    here = hardware_of(resolve_device("auto"))
    if hardware and not same_hardware(here, hardware):
        raise EmbshardError(f"--refine measures on this machine ({here}), but the plan is for {hardware}",
                            field="refine", fix="run `embshard place --refine` on the target hardware, or drop "
                                                "--refine (or --hardware)")
    settings = MeasureSettings(device="auto", calibration_dir=calibration_dir or shared_calibration_dir())
    model = getattr(planner, "cost_model", None) or cost_model
    _warn_if_priced_for_another_network(model, here, settings.calibration_dir)
    try:
        result = refine(placement, k, rounds=rounds, settings=settings, cost_model=model)
    except EmbshardError as exc:
        raise exc.at(where) from None
    return winner_placement(result, k), result


# --- `embshard place` ---------------------------------------------------------------------------
# What `embshard place` writes and reads: its --out is checked before any work (cli.check_output).
OUTPUT = {"kind": "folder", "writes": ("plan.json", "placements.parquet", "devices.png"),
          "inputs": ("tables", "tasks", "model", "cost_model")}


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tables", required=True,
                   help="tables.parquet, or a table spec (CSV/YAML/Parquet with TorchRec's names, read as "
                        "`embshard ingest --source spec` reads it); all its tables are placed unless --task-id")
    p.add_argument("--tasks", help="tasks.parquet, with --task-id: place that task's tables")
    p.add_argument("--task-id", help="the task to place (its devices/memory are used unless given)")
    p.add_argument("--devices", type=int, help="number of devices")
    p.add_argument("--memory-gb", type=gib_text, help="memory per device for embedding weights, GiB (weights only: "
                   "leave out what optimizer state, buffers and the dense model need)")
    p.add_argument("--planner", default="learned", help="learned (default, from the registry) or a baseline: "
                   "random, round_robin, dim_greedy, size_greedy, lookup_greedy, size_lookup_greedy, "
                   "torchrec_table_wise, torchrec_full; or another composition of the learned planner's model: "
                   "no_splits (no split search: it cuts only what cannot fit; 0.2-1.0x the learned planner's time), "
                   "policy_only (the policy's rollout alone), or an ablation (no_replicas, no_branches, ...)")
    p.add_argument("--model", default=None, help=f"learned planner's model URI (default {POLICY_CHAMPION_URI})")
    p.add_argument("--cost-model", default=None,
                   help="cost model for predicted costs of non-learned planners, e.g. "
                        f"{COST_CHAMPION_URI} (default: none, no predicted costs: a heuristic loads no model)")
    p.add_argument("--search-evaluations", type=int, default=None,
                   help="work budget of the learned planner's search, in scored moves/swaps (default: by task "
                        "size); the plan is the same on every machine. Checked between search rounds, and a round "
                        "scores every move and swap off the slowest device (about 30,000 at 5,000 tables on 1,024 "
                        "devices), so a small budget is passed by up to a round; the plan's meta says what was used")
    p.add_argument("--time-budget-s", type=float, default=None,
                   help="safety cap on the learned planner's search time (default 60 s); a plan that hits it "
                        "depends on the machine's speed, and the report says so. For torchrec_* planners: the time "
                        "limit of TorchRec's search (default 60 s; it keeps its best plan so far). TorchRec checks it "
                        "only between proposals: torchrec_full of thousands of tables can run minutes past it")
    p.add_argument("--hardware", default=None,
                   help="the hardware the plan is for, e.g. 'cuda:NVIDIA H100' (default: this machine's GPU, else "
                        "its CPU); a warning when the model was measured on other hardware")
    p.add_argument("--refine", type=int, default=None, metavar="K",
                   help="measure the K best distinct candidate plans (the planner's, its other drafts, the greedy "
                        "heuristics', TorchRec's) side by side on this machine and write the measured best (1-16); "
                        "a refinement only when this machine is the hardware the plan is for")
    p.add_argument("--calibration-dir", default=None, metavar="DIR",
                   help="with --refine: the folder of the comm_calibration.json its all-to-all model uses, e.g. a "
                        "pipeline folder's OUT/calibration, or a run's data folder (default: "
                        "EMBSHARD_CALIBRATION_DIR, else calibrated now, ~15 s)")
    p.add_argument("--refine-rounds", type=int, default=5, metavar="R",
                   help="paired measuring rounds of --refine (default 5; at least 2, which gives an interval of "
                        "the two rounds' range only)")
    p.add_argument("--devices-per-host", type=int, default=None, metavar="L",
                   help="devices per host (host h holds devices h*L .. h*L+L-1, TorchRec's rank order): a planner "
                        "may then cut a table row-wise over one host (table_row_wise); written to plan.json as "
                        "hosts (default: with --task-id the task's devices_per_host, else one host)")
    p.add_argument("--out", required=True, help="output folder")


def _say_older_plan(out: str) -> None:
    """After a failed plan, say that a plan.json already in `out` is an older one, left as it was: a script that
    reads OUT/plan.json after the command had no way to tell it from this run's, but by the exit code."""
    path = storage.join(out, "plan.json")
    try:
        if not storage.exists(path):
            return
        made = json.loads(storage.read_text(path)).get("created_at", "an unrecorded time")
    except Exception:  # noqa: BLE001 - only a note beside the error being raised: it must not replace it
        made = "an unrecorded time"
    log.warning("%s is an older plan (made at %s), left as it was: this run wrote nothing", path, made)


def main(args) -> int:
    from .. import checks
    from ..errors import EmbshardError

    if (args.devices is None or args.memory_gb is None) and not args.task_id:
        missing = [flag for flag, v in (("--devices", args.devices), ("--memory-gb", args.memory_gb)) if v is None]
        raise EmbshardError(f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} required without "
                            "--task-id", field="memory_gb" if args.devices is not None else "devices",
                            fix="give --devices N --memory-gb M (weights' GiB per device)")
    if args.hardware is not None and not args.hardware.strip():  # an unset variable: not "this machine"
        raise EmbshardError("--hardware is empty", field="hardware",
                            fix="name the target, e.g. 'cuda:NVIDIA H100', or leave --hardware out (this machine)")
    if args.model is not None and composition_of(args.planner) is None:  # it had been ignored without a word
        raise EmbshardError(f"--model names a learned planner's model; {args.planner} uses none", field="model",
                            fix="drop --model, or give --planner learned (or another learned composition); "
                                "--cost-model prices a heuristic's plan")
    # Given values are checked as given: 0 is an error, never "use the task's value".
    devices = None if args.devices is None else checks.devices(args.devices, field="devices")
    memory = None if args.memory_gb is None else checks.memory_bytes(args.memory_gb, field="memory_gb")
    if args.time_budget_s is not None:
        checks.positive_finite(args.time_budget_s, field="time_budget_s", upper=86_400)
    if args.search_evaluations is not None and not 0 <= args.search_evaluations <= 10**10:
        raise EmbshardError(f"invalid value {args.search_evaluations}", field="search_evaluations",
                            fix="give an integer from 0 (no search) to 10^10")
    refine_k = 0
    if args.refine is not None:  # given: checked as given (0 is an error, not "off")
        from ..refine import check_k, check_rounds

        refine_k = check_k(args.refine)
        check_rounds(args.refine_rounds)
    elif args.refine_rounds != 5:  # its default: a rounds count without --refine measures nothing
        raise EmbshardError("has no effect without --refine", field="refine_rounds",
                            fix="add --refine K, or drop --refine-rounds")
    try:
        result = place(args.tables, args.out, devices=devices, memory_bytes=memory,
                       planner=args.planner, model_uri=args.model or POLICY_CHAMPION_URI,
                       cost_model_uri=args.cost_model,
                       tasks=args.tasks, task_id=args.task_id, time_budget_s=args.time_budget_s,
                       search_evaluations=args.search_evaluations, hardware=args.hardware, refine_k=refine_k,
                       refine_rounds=args.refine_rounds, devices_per_host=args.devices_per_host,
                       calibration_dir=args.calibration_dir, memory_field="memory_gb")
    except EmbshardError:
        _say_older_plan(args.out)
        raise
    if result["refinement"] is not None:
        print(result["refinement"].report())
    print(result["report"])
    print(f"wrote {result['plan_json']}, {result['placements']} and {result['plot']}")
    return 0
