"""`embshard prune`: keep a local installation (the folder `embshard pipeline --out` and `embshard ui --out` use)
from growing without end under scheduled retraining.

Every run adds its folder `data/<run id>` (its tables, measurements, models' files, evaluation and exported plans),
its Airflow task logs (`airflow/logs/dag_id=*/run_id=<run id>`), the log of the `embshard pipeline` that ran it
(`logs/pipeline-*.log`) and three registry versions (two `embshard-cost`, one `embshard-policy`), each with a logged
model's files under `mlartifacts/models/m-*`. `embshard prune --out DIR` lists what it would delete and what that
frees; `--yes` deletes it:
- every run but the newest `--keep-runs` (by the time in its run id): its folder and its Airflow logs, and the
  pipeline logs but the newest as many. A run deleted cannot be finished by hand or exported again from its stages,
  and the plans it exported (`data/<run id>/export`) go with it. Only runs count: a folder of `data/` whose name is
  not an Airflow run id and that holds no run state (`state/run.json`) is left alone;
- every registry version of the folder's own store (`DIR/mlflow.db`) but the newest `--keep-versions` of each
  model, never one an alias names (champion, challenger: what training jobs load), one a kept run registered (its
  stages, run again, reload them) nor the cost model a kept policy version was trained against (its
  `cost_model_version` tag); each with its logged model and that model's files,
  unless a kept version was registered from the same logged model. Another store (a server, or one a moved folder's
  runs recorded) is never touched.
Nothing outside DIR is deleted: a link is left as it is (and what it points to), and a version whose files are
reached only through a link is kept, so that no version is left without its files. It refuses, before anything is
deleted, while a process works on the folder: an `embshard pipeline` or `embshard ui` recorded there (or under
AIRFLOW_HOME, for a run of this folder), any embshard process given a path inside DIR (a stage run by hand, a
pipeline whose Airflow home is elsewhere), or an Airflow process whose home is DIR's (a scheduler started by hand).
Only the embshard DAG's Airflow logs are prune's. The MLflow runs of the stages (metrics, parameters, plots) are
kept: they are small, and kept versions name theirs as their source.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import glob
import os
import re
import shutil
from dataclasses import dataclass, field

from .errors import EmbshardError, first_line

OUTPUT = None  # deletes; writes nothing

DEFAULT_KEEP_RUNS = 5
DEFAULT_KEEP_VERSIONS = 5
# The time an Airflow run id carries (manual__2026-11-27T06:15:44.350654+00:00), as written in a run's folder name
# too (':' and '+' made '-': run_layout.run_root).
_RUN_TIME = re.compile(r"(\d{4}-\d{2}-\d{2})T(\d{2})[:-](\d{2})[:-](\d{2})")
_RUN_ID = re.compile(r"^[a-z_]+__\d{4}-\d{2}-\d{2}T\d{2}[:-]\d{2}[:-]\d{2}")  # <run type>__<logical date>...
_PIPELINE_LOG = re.compile(r"^pipeline-\d{8}-\d{6}\.log$")
_FIX_OUT = "give the folder `embshard pipeline --out` used (e.g. runs/local)"
DAG_ID = "embshard_pipeline"  # airflow_local.DAG_ID: only its logs are prune's (an Airflow home may hold others)


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
    paths: list[str]          # files and folders deleted with it (inside the folder, no links)
    size: int                 # their bytes
    model_id: str | None = None  # a version's logged model (models:/m-...) deleted with it


@dataclass
class Plan:
    delete: list[Item]
    kept_runs: list[str]
    kept_versions: dict[str, list[str]]  # model -> versions kept (aliased ones marked "3 (champion)")
    store: str | None = None  # the folder's own MLflow store (None: it has none)
    notes: list[str] = field(default_factory=list)  # what was left alone, and why


def main(args: argparse.Namespace) -> int:
    if not str(args.out).strip():
        raise EmbshardError("is empty", path="''", field="out", fix=_FIX_OUT)
    root = os.path.abspath(args.out)
    for option in ("keep_runs", "keep_versions"):
        if getattr(args, option) < 0:
            what = "runs" if option == "keep_runs" else "versions (besides those aliases name)"
            raise EmbshardError(f"{getattr(args, option)} is negative", field=option.replace("_", "-"),
                                fix=f"give 0 or more: the newest {what} kept")
    if os.path.isfile(root):
        raise EmbshardError("is a file, not a folder", path=args.out, field="out", fix=_FIX_OUT)
    if not os.path.isdir(root):
        raise EmbshardError("no such folder", path=args.out, field="out", fix=_FIX_OUT)
    if not is_installation(root):
        raise EmbshardError("is not an embshard installation (no mlflow.db, run state in data/ or embshard records "
                            "in airflow/)", path=args.out, field="out", fix=_FIX_OUT)
    refuse_while_running(root)
    plan = find(root, args.keep_runs, args.keep_versions)
    if args.yes:
        apply(root, plan)
    print(report(root, plan, deleted=args.yes))
    return 0


def is_installation(root: str) -> bool:
    """What only an embshard installation holds: its MLflow store, a run's state, or embshard's records under its
    Airflow home (a plain Airflow home, `~/airflow`, is not one: its other DAGs' logs are not prune's)."""
    from .run_owner import OWNERS, UI

    return (os.path.isfile(os.path.join(root, "mlflow.db"))
            or bool(glob.glob(os.path.join(glob.escape(root), "data", "*", "state", "run.json")))
            or os.path.isdir(os.path.join(root, "airflow", OWNERS))
            or os.path.isfile(os.path.join(root, "airflow", UI)))


def refuse_while_running(root: str) -> None:
    """One line when a process works on `root`: an `embshard pipeline` or `embshard ui` recorded under its Airflow
    home, a pipeline recorded under AIRFLOW_HOME whose run's folder is in `root`, an embshard process given a path
    inside `root` (or started there with its default --out), or an Airflow process whose home is `root`'s (a
    scheduler not started by `embshard ui`)."""
    from .run_layout import run_root
    from .run_owner import live_pipelines, live_ui

    own = os.path.join(root, "airflow")
    running = [f"embshard pipeline (pid {o['pid']}, run {o['run_id']}) runs on this folder"
               for o in live_pipelines(own)]
    running += [ui for ui in [live_ui(own)] if ui]
    elsewhere = os.environ.get("AIRFLOW_HOME")
    if elsewhere and os.path.realpath(elsewhere) != os.path.realpath(own):
        running += [f"embshard pipeline (pid {o['pid']}, run {o['run_id']}, AIRFLOW_HOME {elsewhere}) runs on this "
                    "folder" for o in live_pipelines(elsewhere)
                    if os.path.isdir(run_root(os.path.join(root, "data"), o["run_id"]))]
    if not running:
        running = [f"{what} (pid {pid}: {cmd}) works on this folder" for pid, what, cmd in _processes_on(root)[:1]]
    if running:
        raise EmbshardError("; ".join(running), path=root, field="out",
                            fix="prune when it has finished (stop the UI first)")


def _processes_on(root: str) -> list[tuple[int, str, str]]:
    """(pid, what, command) of the other live processes working on `root`: embshard processes given a path inside
    it (resolved from their own working folder; `pipeline` and `ui` without --out use runs/local there), and
    Airflow processes whose AIRFLOW_HOME is its airflow/. This process and the ones it runs under (`timeout`,
    `uv run`, cron's shell) are not counted."""
    import psutil

    real = os.path.realpath(root)
    home = os.path.realpath(os.path.join(root, "airflow"))
    mine = {os.getpid(), *(p.pid for p in psutil.Process().parents())}
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            cmd = proc.info["cmdline"] or []
            if proc.pid in mine or not cmd:
                continue
            names = [os.path.basename(a) for a in cmd[:3]]
            if any(n == "airflow" or n.startswith("airflow ") for n in names):
                env_home = proc.environ().get("AIRFLOW_HOME")
                if env_home and os.path.realpath(os.path.join(proc.cwd(), env_home)) == home:
                    found.append((proc.pid, "airflow", " ".join(cmd)[:120]))
                continue
            if not any("embshard" in n for n in names):
                continue
            cwd = proc.cwd()
        except (psutil.Error, OSError):
            continue
        values = [a.split("=", 1)[1] if a.startswith("--") and "=" in a else a for a in cmd[1:]]
        if "--out" not in cmd and not any(a.startswith("--out=") for a in cmd) and ({"pipeline", "ui"} & set(cmd)):
            values.append("runs/quick" if "--quick" in cmd and "pipeline" in cmd else "runs/local")
        for value in values:
            if not value or value.startswith("-"):
                continue
            path = os.path.realpath(os.path.join(cwd, value.removeprefix("file://")))
            if path == real or path.startswith(real + os.sep):
                found.append((proc.pid, "embshard", " ".join(cmd)[:120]))
                break
    return found


def find(root: str, keep_runs: int, keep_versions: int) -> Plan:
    """What prune deletes under `root` (module docstring), deleting nothing."""
    notes: list[str] = []
    runs, kept_runs = _old_runs(root, keep_runs, notes)
    logs = sorted((p for p in glob.glob(os.path.join(glob.escape(root), "logs", "pipeline-*.log"))
                   if _PIPELINE_LOG.match(os.path.basename(p))), key=os.path.basename, reverse=True)
    old_logs = [Item("pipeline log", os.path.basename(p), *_deletable(root, [p], notes)) for p in logs[keep_runs:]]
    store = _store(root, notes)
    versions: list[Item] = []
    kept_versions: dict[str, list[str]] = {}
    if store is not None:
        versions, kept_versions = _old_versions(root, store, keep_versions, set(kept_runs), notes)
    return Plan([i for i in runs + old_logs if i.paths] + versions, kept_runs, kept_versions, store, notes)


def _deletable(root: str, paths: list[str], notes: list[str]) -> tuple[list[str], int]:
    """(the paths prune may delete: inside `root` and not links, noting the others; their bytes)."""
    real = os.path.realpath(root) + os.sep
    ok = []
    for p in paths:
        if os.path.islink(p) or not os.path.realpath(p).startswith(real):
            notes.append(f"left alone: {os.path.relpath(p, root)} (a link, or outside the folder)")
        elif os.path.lexists(p):
            ok.append(p)
    return ok, sum(_size(p) for p in ok)


def _store(root: str, notes: list[str]) -> str | None:
    """The folder's own MLflow store (DIR/mlflow.db), or None. Never MLFLOW_TRACKING_URI of the shell prune runs
    in, nor a store a run recorded elsewhere (a server, or the folder's place before it was moved or copied): the
    versions there are another installation's too."""
    import json

    db = os.path.join(root, "mlflow.db")
    own = f"sqlite:///{db}"
    for record in glob.glob(os.path.join(glob.escape(root), "data", "*", "state", "run.json")):
        with contextlib.suppress(OSError, ValueError, AttributeError):
            with open(record, encoding="utf-8") as f:
                uri = json.load(f).get("mlflow_tracking_uri")
            if isinstance(uri, str) and uri and uri != own:
                notes.append(f"left alone: the MLflow store {uri} (runs recorded it; prune only the folder's own)")
                break
    return own if os.path.isfile(db) else None


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


def _run_folders(root: str) -> dict[str, str]:
    """name -> folder of the runs under data/: folders named as an Airflow run id, or holding a run's state."""
    out = {}
    for folder in sorted(glob.glob(os.path.join(glob.escape(root), "data", "*"))):
        name = os.path.basename(folder)
        if os.path.isdir(folder) and (_RUN_ID.match(name) or os.path.isfile(os.path.join(folder, "state",
                                                                                          "run.json"))):
            out[name] = folder
    return out


def _old_runs(root: str, keep: int, notes: list[str]) -> tuple[list[Item], list[str]]:
    """(the runs past the newest `keep`, with their folders and logs; the run ids kept). A run is its folder
    under data/ and its Airflow log folders, matched by the folder-safe form of its id (run_layout.run_root)."""
    from .run_layout import run_root

    paths: dict[str, list[str]] = {name: [folder] for name, folder in _run_folders(root).items()}
    others = [os.path.basename(f) for f in glob.glob(os.path.join(glob.escape(root), "data", "*"))
              if os.path.basename(f) not in paths]
    if others:
        notes.append(f"left alone: data/{', data/'.join(sorted(others)[:3])}{' ...' if len(others) > 3 else ''} "
                     "(not runs)")
    for folder in sorted(glob.glob(os.path.join(glob.escape(root), "airflow", "logs", f"dag_id={DAG_ID}",
                                                "run_id=*"))):
        run_id = os.path.basename(folder)[len("run_id="):]
        paths.setdefault(os.path.basename(run_root("", run_id)), []).append(folder)
    order = sorted(paths, key=lambda name: _run_time(name, paths[name][0]), reverse=True)
    old = [Item("run", name, *_deletable(root, paths[name], notes)) for name in order[keep:]]
    return old, order[:keep]


def _old_versions(root: str, store: str, keep: int, kept_runs: set[str], notes: list[str]
                  ) -> tuple[list[Item], dict[str, list[str]]]:
    """(the registry versions of `store` prune deletes, with their logged models' folders; model -> versions
    kept). Kept: the newest `keep` of each model, those an alias names, those a kept run registered (a stage of it
    run again reloads them: state/*.json names them), and the cost model of every kept policy version."""
    from . import registry
    from .run_layout import run_root

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
    keep_set: dict[str, set[str]] = {
        name: {str(mv.version) for mv in mvs[:keep]} | set(aliases[name]) | {
            str(mv.version) for mv in mvs
            if mv.tags.get("airflow.run_id") and os.path.basename(run_root("", mv.tags["airflow.run_id"])) in kept_runs}
        for name, mvs in found.items()}
    # The cost model each kept policy version was trained against (registry.follow_cost_model gives it the
    # policy's alias when it is promoted).
    for mv in found[registry.POLICY_MODEL]:
        if str(mv.version) in keep_set[registry.POLICY_MODEL]:
            cost = mv.tags.get("cost_model_version", "")
            if cost and mv.tags.get("cost_model_uri", "").startswith(f"models:/{registry.COST_MODEL}"):
                keep_set[registry.COST_MODEL].add(str(cost))
    kept_models = {_model_id(mv) for name, mvs in found.items() for mv in mvs if str(mv.version) in keep_set[name]}
    delete: list[Item] = []
    kept: dict[str, list[str]] = {}
    models = os.path.join(root, "mlartifacts", "models")
    for name, mvs in found.items():
        for mv in mvs:
            if str(mv.version) in keep_set[name]:
                continue
            model_id = _model_id(mv)
            if model_id is None or model_id in kept_models:  # a kept (or an earlier) version has it too
                delete.append(Item(name, str(mv.version), [], 0))
                continue
            kept_models.add(model_id)  # deleted with this version: not again with another
            folder = os.path.join(models, model_id)
            held: list[str] = []
            paths, size = _deletable(root, [folder], held) if os.path.lexists(folder) else ([], 0)
            if held:  # its files are reached through a link: kept, so that no version loses its files
                notes.append(f"left alone: {name} version {mv.version} (its files {os.path.relpath(folder, root)} "
                             "are a link, or outside the folder)")
                keep_set[name].add(str(mv.version))
                continue
            delete.append(Item(name, str(mv.version), paths, size, model_id))
        named = aliases[name]
        kept[name] = [str(mv.version) + (f" ({', '.join(sorted(named[str(mv.version)]))})"
                                         if str(mv.version) in named else "")
                      for mv in mvs if str(mv.version) in keep_set[name]]
    return delete, kept


def _model_id(mv) -> str | None:
    """The logged model a version was registered from (its source models:/m-...), or None."""
    source = str(mv.source or "")
    return source[len("models:/"):] if source.startswith("models:/m-") else None


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
    lines += [f"  {note}" for note in plan.notes]
    lines.append(f"kept: {len(plan.kept_runs)} run(s)" + (f", newest {plan.kept_runs[0]}" if plan.kept_runs else ""))
    for name, versions in plan.kept_versions.items():
        lines.append(f"kept: {name} versions {', '.join(versions) or '(none)'}")
    lines.append(f"registry: {plan.store or '(none: no mlflow.db in the folder)'}")
    return "\n".join(lines)


def apply(root: str, plan: Plan) -> None:
    """Delete what `find` listed: registry versions first (the store says what exists), then files; never a link
    or anything outside `root` (checked again here)."""
    versions = [i for i in plan.delete if i.kind not in ("run", "pipeline log")]
    if versions:
        import mlflow
        from mlflow.exceptions import MlflowException

        client = mlflow.MlflowClient()
        for item in versions:
            try:
                client.delete_model_version(item.kind, item.name)
            except MlflowException as exc:
                if getattr(exc, "error_code", "") == "RESOURCE_DOES_NOT_EXIST":
                    continue  # deleted meanwhile (the MLflow UI, another prune)
                raise EmbshardError(f"could not delete {item.kind} version {item.name} ({first_line(exc)})",
                                    path=plan.store, field="registry",
                                    fix="check the MLflow store, then run prune again") from None
            if item.model_id:
                # gone already (another version of it deleted here, or by hand): its files go below
                with contextlib.suppress(MlflowException):
                    client.delete_logged_model(item.model_id)
    inside = os.path.realpath(root) + os.sep
    for item in plan.delete:
        for p in item.paths:
            if os.path.islink(p) or not os.path.realpath(p).startswith(inside):
                continue
            if os.path.isdir(p):
                shutil.rmtree(p)
            elif os.path.lexists(p):
                os.remove(p)


def _size(path: str) -> int:
    """Bytes a delete of `path` frees: links count as themselves, never as what they point to."""
    if not os.path.isdir(path) or os.path.islink(path):
        return os.lstat(path).st_size if os.path.lexists(path) else 0
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):  # gone meanwhile
                total += os.lstat(os.path.join(dirpath, f)).st_size
    return total


def _mb(n: int) -> str:
    return f"{n / 2**20:,.1f} MB"
