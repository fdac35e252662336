"""`embshard prune`: keep a local installation (the folder `embshard pipeline --out` and `embshard ui --out` use)
from growing without end under scheduled retraining.

Every run adds its folder `data/<run id>` (its tables, measurements, models' files, evaluation and exported plans),
its Airflow task logs (`airflow/logs/dag_id=*/run_id=<run id>`), the log of the `embshard pipeline` that ran it
(`logs/pipeline-*.log`) and three registry versions (two `embshard-cost`, one `embshard-policy`), each with a logged
model's files under `mlartifacts/models/m-*`. `embshard prune --out DIR` lists what it would delete and what that
frees; `--yes` deletes it:
- every run but the newest `--keep-runs` (by the time in its run id): its folder and its Airflow logs, and the
  pipeline logs but the newest as many. A run deleted cannot be finished by hand or exported again from its stages,
  and the plans it exported (`data/<run id>/export`) go with it;
- every registry version but the newest `--keep-versions` of each model, never one an alias names (champion,
  challenger: what training jobs load) nor the cost model a kept policy version was trained against (its
  `cost_model_version` tag); each with its logged model and that model's files.
The MLflow runs of the stages (metrics, parameters, plots) are kept: they are small, and kept versions name theirs
as their source. It refuses, before anything is deleted, while an `embshard pipeline` or `embshard ui` runs on the
folder (a run writes its folder and registers versions; the UI's scheduler may start one at any time).
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import glob
import os
import re
import shutil
from dataclasses import dataclass

from .errors import EmbshardError

OUTPUT = None  # deletes; writes nothing

DEFAULT_KEEP_RUNS = 5
DEFAULT_KEEP_VERSIONS = 5
# The time an Airflow run id carries (manual__2026-11-27T06:15:44.350654+00:00), as written in a run's folder name
# too (':' and '+' made '-': run_layout.run_root).
_RUN_TIME = re.compile(r"(\d{4}-\d{2}-\d{2})T(\d{2})[:-](\d{2})[:-](\d{2})")
_PIPELINE_LOG = re.compile(r"pipeline-(\d{8}-\d{6})\.log$")


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True,
                   help="the installation's folder (what `embshard pipeline --out` and `embshard ui --out` were "
                        "given, e.g. runs/local)")
    p.add_argument("--keep-runs", type=int, default=DEFAULT_KEEP_RUNS, metavar="N",
                   help=f"runs kept, the newest (default {DEFAULT_KEEP_RUNS}): their folders, Airflow logs and "
                        "pipeline logs")
    p.add_argument("--keep-versions", type=int, default=DEFAULT_KEEP_VERSIONS, metavar="N",
                   help=f"registry versions kept per model, the newest (default {DEFAULT_KEEP_VERSIONS}), besides "
                        "those an alias names and the cost models of kept policy versions")
    p.add_argument("--yes", action="store_true", help="delete (without it: list what would be deleted)")


@dataclass
class Item:
    """One thing prune deletes: a run (its folder and logs), a pipeline log, or a registry version."""

    kind: str                 # "run", "pipeline log" or the registered model's name
    name: str                 # the run id, the log's file name, or the version
    paths: list[str]          # files and folders deleted with it
    size: int                 # their bytes
    model_id: str | None = None  # a version's logged model (models:/m-...)


@dataclass
class Plan:
    delete: list[Item]
    kept_runs: list[str]
    kept_versions: dict[str, list[str]]  # model -> versions kept (aliased ones marked "3 (champion)")
    store: str | None = None  # the MLflow store whose versions are listed (None: the folder has none)


def main(args: argparse.Namespace) -> int:
    root = os.path.abspath(args.out)
    for option in ("keep_runs", "keep_versions"):
        if getattr(args, option) < 0:
            raise EmbshardError(f"{getattr(args, option)} is negative", field=option.replace("_", "-"),
                                fix="give 0 or more (0 keeps only what aliases name)")
    if not os.path.isdir(root):
        raise EmbshardError("no such folder", path=args.out, field="out", fix="give the folder `embshard pipeline "
                            "--out` used (e.g. runs/local)")
    if not any(os.path.exists(os.path.join(root, x)) for x in ("data", "mlflow.db", "airflow")):
        raise EmbshardError("is not an embshard installation (no data/, mlflow.db or airflow/ in it)", path=args.out,
                            field="out", fix="give the folder `embshard pipeline --out` used (e.g. runs/local)")
    refuse_while_running(root)
    plan = find(root, args.keep_runs, args.keep_versions)
    print(report(root, plan, deleted=args.yes))
    if args.yes:
        apply(root, plan)
    return 0


def refuse_while_running(root: str) -> None:
    """One line when an `embshard pipeline` or `embshard ui` runs on `root` (run_owner's records)."""
    from .run_owner import live_pipelines, live_ui

    home = os.path.join(root, "airflow")
    running = [f"embshard pipeline (pid {o['pid']}, run {o['run_id']})" for o in live_pipelines(home)]
    ui = live_ui(home)
    if ui:
        running.append(f"embshard ui ({ui})")
    if running:
        raise EmbshardError(f"{'; '.join(running)} runs on this folder", path=root, field="out",
                            fix="prune when it has finished (stop the UI first)")


def find(root: str, keep_runs: int, keep_versions: int) -> Plan:
    """What prune deletes under `root` (module docstring), deleting nothing."""
    runs, kept_runs = _old_runs(root, keep_runs)
    logs = sorted(glob.glob(os.path.join(root, "logs", "pipeline-*.log")), key=os.path.basename, reverse=True)
    logs = [p for p in logs if _PIPELINE_LOG.search(p)]
    old_logs = [Item("pipeline log", os.path.basename(p), [p], _size(p)) for p in logs[keep_runs:]]
    store = _store(root)
    versions: list[Item] = []
    kept_versions: dict[str, list[str]] = {}
    if store is not None:
        versions, kept_versions = _old_versions(root, store, keep_versions)
    return Plan(runs + old_logs + versions, kept_runs, kept_versions, store)


def _store(root: str) -> str | None:
    """The installation's MLflow store: the one its newest run recorded (state/run.json, what its stages used),
    else the folder's own mlflow.db; None when it has neither. Never MLFLOW_TRACKING_URI of the shell prune runs
    in: a variable set for other work would have pruned another registry."""
    import json

    runs = sorted(glob.glob(os.path.join(root, "data", "*", "state", "run.json")),
                  key=lambda f: _run_time(f.split(os.sep)[-3], f), reverse=True)
    for record in runs:
        with contextlib.suppress(OSError, ValueError):
            with open(record, encoding="utf-8") as f:
                uri = json.load(f).get("mlflow_tracking_uri")
            if isinstance(uri, str) and uri:
                return uri
    db = os.path.join(root, "mlflow.db")
    return f"sqlite:///{db}" if os.path.exists(db) else None


def _run_time(name: str, fallback: str) -> tuple[str, str]:
    """Sort key of a run: the time in its id, else its folder's modification time (both as ISO text)."""
    m = _RUN_TIME.search(name)
    if m:
        return (f"{m.group(1)}T{m.group(2)}:{m.group(3)}:{m.group(4)}", name)
    try:
        stamp = datetime.datetime.fromtimestamp(os.path.getmtime(fallback), datetime.UTC)
        return (stamp.strftime("%Y-%m-%dT%H:%M:%S"), name)
    except OSError:
        return ("", name)


def _old_runs(root: str, keep: int) -> tuple[list[Item], list[str]]:
    """(the runs past the newest `keep`, with their folders and logs; the run ids kept). A run is its folder
    under data/ and its Airflow log folders, matched by the folder-safe form of its id (run_layout.run_root)."""
    from .run_layout import run_root

    data = os.path.join(root, "data")
    paths: dict[str, list[str]] = {}
    for folder in sorted(glob.glob(os.path.join(data, "*"))):
        if os.path.isdir(folder):
            paths.setdefault(os.path.basename(folder), []).append(folder)
    for folder in sorted(glob.glob(os.path.join(root, "airflow", "logs", "dag_id=*", "run_id=*"))):
        run_id = os.path.basename(folder)[len("run_id="):]
        paths.setdefault(os.path.basename(run_root("", run_id)), []).append(folder)
    order = sorted(paths, key=lambda name: _run_time(name, paths[name][0]), reverse=True)
    old = [Item("run", name, paths[name], sum(_size(p) for p in paths[name])) for name in order[keep:]]
    return old, order[:keep]


def _old_versions(root: str, store: str, keep: int) -> tuple[list[Item], dict[str, list[str]]]:
    """(the registry versions of `store` prune deletes, with their logged models' folders; model -> versions
    kept)."""
    from . import registry

    registry.check_server(store)
    import mlflow

    mlflow.set_tracking_uri(store)
    mlflow.set_registry_uri(store)
    client = mlflow.MlflowClient()
    found = {name: sorted(client.search_model_versions(f"name='{name}'"), key=lambda mv: int(mv.version),
                          reverse=True)
             for name in (registry.POLICY_MODEL, registry.COST_MODEL)}
    # Aliases from the registered model (a search's versions do not carry them): version -> its aliases.
    aliases: dict[str, dict[str, list[str]]] = {name: {} for name in found}
    for name, mvs in found.items():
        if mvs:
            for alias, version in client.get_registered_model(name).aliases.items():
                aliases[name].setdefault(str(version), []).append(alias)
    keep_set: dict[str, set[str]] = {name: {str(mv.version) for mv in mvs[:keep]} | set(aliases[name])
                                     for name, mvs in found.items()}
    # The cost model each kept policy version was trained against (registry.follow_cost_model gives it the
    # policy's alias when it is promoted).
    for mv in found[registry.POLICY_MODEL]:
        if str(mv.version) in keep_set[registry.POLICY_MODEL]:
            cost = mv.tags.get("cost_model_version", "")
            if cost and mv.tags.get("cost_model_uri", "").startswith(f"models:/{registry.COST_MODEL}"):
                keep_set[registry.COST_MODEL].add(str(cost))
    delete: list[Item] = []
    kept: dict[str, list[str]] = {}
    artifacts = os.path.realpath(os.path.join(root, "mlartifacts"))
    for name, mvs in found.items():
        named = aliases[name]
        kept[name] = [str(mv.version) + (f" ({', '.join(sorted(named[str(mv.version)]))})"
                                         if str(mv.version) in named else "")
                      for mv in mvs if str(mv.version) in keep_set[name]]
        for mv in mvs:
            if str(mv.version) in keep_set[name]:
                continue
            source = str(mv.source or "")
            model_id = source[len("models:/"):] if source.startswith("models:/m-") else None
            folder = os.path.join(artifacts, "models", model_id) if model_id else None
            paths = [folder] if folder and os.path.isdir(folder) else []
            delete.append(Item(name, str(mv.version), paths, sum(_size(p) for p in paths), model_id))
    return delete, kept


def report(root: str, plan: Plan, deleted: bool) -> str:
    verb = "deleted" if deleted else "would delete (give --yes to delete)"
    lines = [f"embshard prune {root}: {verb}:"]
    for item in plan.delete:
        what = f"{item.kind} {item.name}"
        lines.append(f"  {what:<64} {_mb(item.size):>10}")
    if not plan.delete:
        lines.append("  nothing")
    total = sum(i.size for i in plan.delete)
    lines.append(f"  {'total':<64} {_mb(total):>10}")
    lines.append(f"kept: {len(plan.kept_runs)} run(s)" + (f", newest {plan.kept_runs[0]}" if plan.kept_runs else ""))
    for name, versions in plan.kept_versions.items():
        lines.append(f"kept: {name} versions {', '.join(versions) or '(none)'}")
    lines.append(f"registry: {plan.store or '(none: no run recorded one, and no mlflow.db in the folder)'}")
    return "\n".join(lines)


def apply(root: str, plan: Plan) -> None:
    """Delete what `find` listed: registry versions first (the store says what exists), then files."""
    versions = [i for i in plan.delete if i.kind not in ("run", "pipeline log")]
    if versions:
        import mlflow

        client = mlflow.MlflowClient()
        for item in versions:
            client.delete_model_version(item.kind, item.name)
            if item.model_id:
                from mlflow.exceptions import MlflowException

                # gone already (with its version, or by hand): its files go below
                with contextlib.suppress(MlflowException):
                    client.delete_logged_model(item.model_id)
    inside = os.path.realpath(root) + os.sep
    for item in plan.delete:
        for p in item.paths:
            if not os.path.realpath(p).startswith(inside):
                continue  # never outside the installation, whatever a link says
            if os.path.isdir(p) and not os.path.islink(p):
                shutil.rmtree(p)
            elif os.path.lexists(p):
                os.remove(p)


def _size(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):  # gone meanwhile
                total += os.path.getsize(os.path.join(dirpath, f))
    return total


def _mb(n: int) -> str:
    return f"{n / 2**20:,.1f} MB"
