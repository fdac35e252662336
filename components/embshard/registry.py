"""Generic MLflow helpers shared by the cost model and the policy.

Tracking URI: `MLFLOW_TRACKING_URI`, else a sqlite store `mlflow.db` inside the run directory (or the current
folder). Artifacts of a local sqlite store live beside the database in `mlartifacts/`, never in the cwd.
Models are pyfunc `PythonModel`s whose class lives in this package (importable, nothing from `__main__`),
logged with explicit pip requirements (skips MLflow's slow dependency inference) and registered with tags;
versions are addressed by aliases (`champion`, `challenger`), never by the deprecated stages.
"""
from __future__ import annotations

import contextlib
import logging
import os
import warnings
from typing import Any

from .errors import EmbshardError, ModelFilesMissingError, ModelNotFoundError, StoreUnreachableError, first_line

DEFAULT_EXPERIMENT = "embshard"
# The registered models and their aliases: defined here only.
COST_MODEL = "embshard-cost"
POLICY_MODEL = "embshard-policy"
CHAMPION, CHALLENGER = "champion", "challenger"
# The promotion gate's verdict on an `embshard-policy` version, in its `verdict` tag (reason in `verdict_reason`).
# PENDING is set at registration; the gate replaces it with one of GATE_VERDICTS. A version still PENDING after its
# Airflow run is over was registered by a run that failed before the gate: the next pipeline run's gate tags it
# FAILED_RUN. Versions registered from the command line stay PENDING until a gate judges them. A version left
# PENDING by a stage of the same run root run again (its re-run registered another candidate) is SUPERSEDED by that
# root's next gate.
VERDICT_TAG, VERDICT_REASON_TAG = "verdict", "verdict_reason"
PENDING, FAILED_RUN, SUPERSEDED = "pending", "failed_run", "superseded"
PROMOTED, UNDECIDED, NOT_BETTER, SLOWER, INFEASIBLE = (
    "promoted", "undecided", "not_better", "measurably_slower", "infeasible")
GATE_VERDICTS = (PROMOTED, UNDECIDED, NOT_BETTER, SLOWER, INFEASIBLE)


def alias_uri(name: str, alias: str = CHAMPION) -> str:
    return f"models:/{name}@{alias}"


COST_CHAMPION_URI = alias_uri(COST_MODEL)      # models:/embshard-cost@champion
POLICY_CHAMPION_URI = alias_uri(POLICY_MODEL)  # models:/embshard-policy@champion


def tracking_uri(run_dir: str | os.PathLike | None = None) -> str:
    """MLFLOW_TRACKING_URI if set, else sqlite:///<run_dir or cwd>/mlflow.db (absolute)."""
    env = os.environ.get("MLFLOW_TRACKING_URI")
    if env:
        return env
    root = os.path.abspath(os.fspath(run_dir) if run_dir is not None else os.getcwd())
    os.makedirs(root, exist_ok=True)
    return f"sqlite:///{os.path.join(root, 'mlflow.db')}"


def _sqlite_file(store: str) -> str | None:
    """The database file of a local sqlite store URI; None for another store or an in-memory one."""
    db = store[len("sqlite:///"):] if store.startswith("sqlite:///") else None
    return db if db and db != ":memory:" else None


def _artifact_root(uri: str) -> str | None:
    """For a local sqlite store: file:// folder beside the database; else None (the server decides)."""
    if uri.startswith("sqlite:///"):
        db = uri[len("sqlite:///"):]
        return "file://" + os.path.join(os.path.dirname(os.path.abspath(db)), "mlartifacts")
    return None


def connect(run_dir: str | os.PathLike | None = None) -> str:
    """Point MLflow tracking and registry at `tracking_uri(run_dir)`; returns the URI."""
    import mlflow

    uri = tracking_uri(run_dir)
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    return uri


def use(run_dir: str | os.PathLike | None = None, experiment: str = DEFAULT_EXPERIMENT) -> str:
    """`connect(run_dir)` and select `experiment` (created with a local artifact root where the store is
    local). Returns the URI."""
    import mlflow

    uri = connect(run_dir)
    client = mlflow.MlflowClient()
    if client.get_experiment_by_name(experiment) is None:
        client.create_experiment(experiment, artifact_location=_artifact_root(uri))
    mlflow.set_experiment(experiment)
    return uri


def default_pip_requirements() -> list[str]:
    """Pinned requirements of the running environment (explicit: MLflow need not infer them)."""
    from importlib import metadata

    reqs = []
    for dist in ("embshard", "mlflow", "torch", "numpy", "pandas", "pyarrow"):
        try:
            reqs.append(f"{dist}=={metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            continue
    return reqs


def signature(input_example, output_example, params: dict | None = None, required=None):
    """The model's signature, inferred from an example call; input columns outside `required` are optional
    (MLflow checks the columns and types of every predict call against it)."""
    from mlflow.models import infer_signature
    from mlflow.types.schema import ColSpec, Schema

    with warnings.catch_warnings():
        # MLflow's hint that integer columns cannot hold missing values: ours (rows, dim, shard ...) never miss.
        warnings.filterwarnings("ignore", message="Hint: Inferred schema contains integer", category=UserWarning)
        sig = infer_signature(input_example, output_example, params=params)
    if required is not None:
        keep = set(required)
        sig.inputs = Schema([ColSpec(c.type, c.name, required=c.name in keep) for c in sig.inputs.inputs])
    return sig


class _DropMessage:
    """A logging filter that drops records whose message starts with `prefix`."""

    def __init__(self, prefix: str):
        self.prefix = prefix

    def filter(self, record) -> bool:
        return not str(record.msg).startswith(self.prefix)


def start_run(**kwargs):
    """mlflow.start_run with the Airflow lineage tags of this process (dag, run, task, run root). Inside an Airflow
    run it first ends what killed processes left RUNNING (end_stale_runs): earlier tries of its task (Airflow runs
    one try at a time) and stages of the DAG's earlier runs under the same data root (its runs go one at a time,
    so those are over). A task SIGKILLed under a scheduler is failed by Airflow's supervisor without running
    callbacks (seen with Airflow 3.3.2's LocalExecutor), so its run is ended here, by the next stage that logs."""
    import mlflow

    from .run_context import mlflow_tags

    tags = mlflow_tags()
    run_id, dag_id, root = tags.get("airflow.run_id"), tags.get("airflow.dag_id"), tags.get("embshard.run_root")
    try_number = tags.get("airflow.try_number", "")
    if try_number.isdigit() and int(try_number) > 1 and "airflow.task_id" in tags and run_id:
        end_stale_runs(run_id, tags["airflow.task_id"], other_try_than=try_number, dag_id=dag_id, run_root=root,
                       reason=f"try {try_number} of its Airflow task started; this earlier try was killed")
    if run_id and dag_id and root and "/" in root.rstrip("/"):
        end_stale_runs(run_id, other_runs=True, dag_id=dag_id, data_root=root.rstrip("/").rsplit("/", 1)[0],
                       reason=f"a later Airflow run of {dag_id} ({run_id}) started a stage: runs go one at a "
                              "time, so the stage that opened this run was killed")
    return mlflow.start_run(tags={**tags, **kwargs.pop("tags", {})}, **kwargs)


END_REASON_TAG = "embshard.end_reason"


def end_stale_runs(airflow_run_id: str, task_id: str | None = None, *, other_try_than: str | None = None,
                   dag_id: str | None = None, run_root: str | None = None, other_runs: bool = False,
                   data_root: str | None = None, reason: str) -> list[str]:
    """Mark KILLED the MLflow runs still RUNNING that Airflow run `airflow_run_id` (of `dag_id`, working under
    `run_root`: scheduled run ids repeat across deployments sharing one MLflow server; its task `task_id`; tries
    other than `other_try_than`) started, with `reason` in their END_REASON_TAG. `other_runs`: those of the other
    Airflow runs instead, whose run roots lie under `data_root` (this deployment's). A stage's process killed hard
    (SIGKILL, out of memory, a lost pod) cannot end its own run, which then read as running in the MLflow UI for
    good. Returns the MLflow run ids ended. Best effort: a store that cannot be searched ends nothing (a log
    line)."""
    import mlflow

    def quoted(value: str) -> str:
        return "'" + str(value).replace("\\", "\\\\").replace("'", "\\'") + "'"

    ended: list[str] = []
    if other_runs and data_root is None:
        return ended  # other deployments' runs are not ours to end
    where = ["attributes.status = 'RUNNING'",
             f"tags.`airflow.run_id` {'!=' if other_runs else '='} {quoted(airflow_run_id)}"]
    if data_root is not None:
        where.append(f"tags.`embshard.run_root` LIKE {quoted(data_root.rstrip('/') + '/%')}")
    for tag, value in (("airflow.dag_id", dag_id), ("embshard.run_root", run_root), ("airflow.task_id", task_id)):
        if value is not None:
            where.append(f"tags.`{tag}` = {quoted(value)}")
    if other_try_than is not None:
        where.append(f"tags.`airflow.try_number` != {quoted(other_try_than)}")
    try:
        client = mlflow.MlflowClient()
        experiments = [e.experiment_id for e in client.search_experiments()]
        runs = client.search_runs(experiments, " and ".join(where), max_results=1000) if experiments else []
        for run in runs:
            client.set_tag(run.info.run_id, END_REASON_TAG, reason)
            client.set_terminated(run.info.run_id, "KILLED")
            ended.append(run.info.run_id)
    except Exception as exc:  # cleanup must never fail the stage or the callback that asked for it
        logging.getLogger(__name__).warning("could not end the MLflow runs left running by %s: %s",
                                            airflow_run_id, first_line(exc))
    return ended


def log_and_register(python_model, artifacts: dict[str, str], registered_name: str, tags: dict[str, Any],
                     input_example=None, pip_requirements: list[str] | None = None, signature=None,
                     description: str = ""):
    """Log a pyfunc model in the active run (one is started if none is) and register it as a new version of
    `registered_name`, tagged with `tags` and the Airflow lineage (on the version), with a description that
    says what made it. Returns the MLflow ModelVersion."""
    import mlflow

    from .run_context import mlflow_tags

    started = mlflow.active_run() is None
    if started:
        start_run()
    try:
        with warnings.catch_warnings():
            # The signature is given (inferred from an example call, `signature`), so no input example is stored;
            # MLflow's hint about one would otherwise reach every task log with raw colour codes.
            if signature is not None:
                warnings.filterwarnings("ignore", message=".*An input example was not provided",
                                        category=UserWarning)
            # MLflow warns on every PythonModel object (CloudPickle). Ours are classes of this package: the
            # pickle names an importable class, and every stage's log carried the warning for nothing.
            pickle_note = _DropMessage("Passing a Python object as `python_model`")
            logging.getLogger("mlflow.pyfunc").addFilter(pickle_note)
            try:
                info = mlflow.pyfunc.log_model(
                    name="model", python_model=python_model, artifacts=artifacts, input_example=input_example,
                    signature=signature, pip_requirements=pip_requirements or default_pip_requirements(),
                    registered_model_name=registered_name)
            finally:
                logging.getLogger("mlflow.pyfunc").removeFilter(pickle_note)
        client = mlflow.MlflowClient()
        version = str(info.registered_model_version)
        for k, v in {**tags, **mlflow_tags()}.items():
            client.set_model_version_tag(registered_name, version, k, str(v))
        lineage = mlflow_tags()
        origin = (f"Airflow {lineage['airflow.dag_id']} run {lineage['airflow.run_id']}, task "
                  f"{lineage['airflow.task_id']}" if "airflow.run_id" in lineage else "a command-line run")
        run = mlflow.active_run()
        assert run is not None, "log_and_register starts a run when none is active"
        client.update_model_version(registered_name, version, description=(
            f"{description} Made by {origin}, MLflow run {run.info.run_id}.").strip())
        return client.get_model_version(registered_name, version)
    finally:
        if started:
            mlflow.end_run()


def drop_challenger() -> None:
    """Remove `challenger` from the policy and from the cost model that followed it."""
    delete_alias(POLICY_MODEL, CHALLENGER)
    delete_alias(COST_MODEL, CHALLENGER)


def follow_cost_model(policy_version, alias: str) -> str | None:
    """Give the cost model the policy version was trained against (its `cost_model_version` tag) the same alias:
    `embshard-cost@champion` prices what `embshard-policy@champion` plans with. Returns that cost model version
    (None: the policy names none in the registry, and the cost model's alias is left as it is)."""
    import mlflow

    version = followed_cost_model(mlflow.MlflowClient().get_model_version(POLICY_MODEL, str(policy_version)))
    if version is not None:
        set_alias(COST_MODEL, alias, version)
    return version


def followed_cost_model(policy_version) -> str | None:
    """The registered cost model version a policy ModelVersion names, which follows its aliases (None: it names
    none in the registry, e.g. a runs:/ cost model)."""
    uri = policy_version.tags.get("cost_model_uri", "")
    version = policy_version.tags.get("cost_model_version", "")
    return str(version) if version and uri.startswith(f"models:/{COST_MODEL}") else None


def utc_now() -> str:
    """The time a registry tag records (ISO-8601 UTC, seconds)."""
    import datetime

    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def mark_replaced(version, by: str) -> None:
    """Tag a former `embshard-policy` champion with what replaced it (`by`) and when (REPLACED_TAG); its verdict
    stays (it was promoted, then)."""
    import mlflow

    mlflow.MlflowClient().set_model_version_tag(POLICY_MODEL, str(version), REPLACED_TAG,
                                                f"champion until {by}, {utc_now()}"[:500])


def set_alias(name: str, alias: str, version) -> None:
    import mlflow

    mlflow.MlflowClient().set_registered_model_alias(name, alias, str(version))


def delete_alias(name: str, alias: str) -> None:
    """Remove `name@alias` (nothing happens when it does not exist)."""
    import mlflow
    from mlflow.exceptions import MlflowException

    with contextlib.suppress(MlflowException):
        mlflow.MlflowClient().delete_registered_model_alias(name, alias)


def set_verdict(name: str, version, verdict: str, reason: str = "") -> None:
    """Tag a version with the gate's verdict (one of PENDING, FAILED_RUN, SUPERSEDED, GATE_VERDICTS) and its
    reason."""
    import mlflow

    client = mlflow.MlflowClient()
    client.set_model_version_tag(name, str(version), VERDICT_TAG, verdict)
    client.set_model_version_tag(name, str(version), VERDICT_REASON_TAG, reason[:250])


# The gate's check of the champion it measured beside the candidate (jobs.promote.record_champion_health).
HEALTH_TAG, HEALTH_REASON_TAG = "health", "health_reason"
REPLACED_TAG = "replaced_by"  # on a champion replaced by the gate or by hand: by which version, and when
HEALTH_OK, HEALTH_REGRESSED = "ok", "regressed"


def set_health(name: str, version, health: str, reason: str) -> None:
    """Tag a version with the gate's health check (HEALTH_OK or HEALTH_REGRESSED) and its reason."""
    import mlflow

    client = mlflow.MlflowClient()
    client.set_model_version_tag(name, str(version), HEALTH_TAG, health)
    client.set_model_version_tag(name, str(version), HEALTH_REASON_TAG, reason[:250])


def versions_with_verdict(name: str, verdict: str) -> list:
    """The ModelVersions of `name` whose verdict tag is `verdict` (oldest first)."""
    import mlflow

    found = mlflow.MlflowClient().search_model_versions(f"name='{name}' and tags.{VERDICT_TAG}='{verdict}'")
    return sorted(found, key=lambda mv: int(mv.version))


# A tracking server that does not answer: MLflow's own client retries a refused connection 7 times with backoff
# (about 8 minutes) and then blames the model. The server is asked here again for WAIT_ENV seconds (default
# DEFAULT_WAIT_S: a command fails in seconds; the stage pods wait longer, riding out an MLflow restart), through
# the same proxies MLflow's requests use.
WAIT_ENV = "EMBSHARD_MLFLOW_WAIT_S"
DEFAULT_WAIT_S = 10.0
CONNECT_TIMEOUT_S = 10.0
_answered: set[str] = set()  # stores that answered in this process (a failure is asked again next time)


class RegistryUnreachableError(ModelNotFoundError, StoreUnreachableError):
    """The tracking server of an http(s) store does not accept connections."""


def _unreachable(store: str) -> str | None:
    """Why the tracking server at `store` does not answer (None: it answered, with anything at all, or `store` is
    not an http(s) server)."""
    import re
    import time
    from urllib.parse import urlsplit

    url = urlsplit(store)
    if url.scheme not in ("http", "https") or not url.hostname or store in _answered:
        return None
    import requests  # MLflow's own HTTP client: the same proxy settings (HTTP(S)_PROXY, NO_PROXY)

    why, start, pause = "", time.monotonic(), 1.0
    try:
        wait_s = float(os.environ.get(WAIT_ENV) or DEFAULT_WAIT_S)
    except ValueError:
        raise EmbshardError(f"{os.environ.get(WAIT_ENV)!r} is not a number of seconds", field=WAIT_ENV,
                            fix=f"e.g. {WAIT_ENV}=60, or unset it for {DEFAULT_WAIT_S:g}") from None
    while True:
        try:
            requests.head(store, timeout=CONNECT_TIMEOUT_S, allow_redirects=False)
        except (requests.ConnectionError, requests.Timeout) as exc:  # refused, no route, unknown host, no proxy
            errno = re.search(r"\[Errno -?\d+\] [^'\")]+", str(exc))
            why = errno.group(0) if errno else type(exc).__name__
            left = wait_s - (time.monotonic() - start)
            if left <= 0:
                return why
            time.sleep(min(pause, left))
            pause = min(2 * pause, 15.0)
            continue
        except requests.RequestException:  # it answered, if oddly (a redirect loop, a bad header)
            pass
        _answered.add(store)
        return None


def _shown(store: str) -> str:
    """A store URI as errors print it: without a user:password it may carry."""
    from urllib.parse import urlsplit

    url = urlsplit(store)
    if not url.netloc:
        return store
    return url._replace(netloc=(url.hostname or "") + (f":{url.port}" if url.port else "")).geturl()


def store_error(exc: BaseException) -> EmbshardError | None:
    """One line for an MLflow store that cannot be used at all, from the exception a command met (its cause chain),
    or None when it is something else: a damaged or truncated sqlite file, a path that is a folder, a URI scheme
    MLflow has no store for, a bare path (MLflow's retired file store). Each had been a 100-180-line traceback
    (SQLAlchemy's, or MLflow's), exit 1."""
    texts: list[str] = []
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        texts.append(f"{type(e).__name__}: {e}")
        e = e.__cause__ or e.__context__
    said = " | ".join(texts)
    working = ("point MLFLOW_TRACKING_URI (and MLFLOW_REGISTRY_URI, if set) at a working store: "
               "sqlite:////ABSOLUTE/PATH/mlflow.db or http(s)://SERVER")

    def bad(message: str, fix: str = working, kind: type[EmbshardError] = EmbshardError) -> EmbshardError:
        try:  # (only once the exception is known to be the store's: an unparsable URI must not hide another one)
            store: str | None = _shown(_store_uri())
        except Exception:  # noqa: BLE001
            store = None
        return kind(message, path=store, field="MLFLOW_TRACKING_URI", fix=fix)

    for words in ("file is not a database", "database disk image is malformed"):
        if words in said:
            return bad(f"the MLflow store is damaged ({words})", f"restore it from a backup or move it away, or "
                                                                  f"{working[0].lower()}{working[1:]}")
    if "database is locked" in said:  # another process holds a write transaction on the sqlite file: try again (75)
        return bad("the MLflow store is locked by another process (database is locked, after waiting for it)",
                   "try again when the other writer is done (a pipeline's stage, `embshard champion --set`, a "
                   "notebook holding a transaction)", kind=RegistryUnreachableError)
    if "unable to open database file" in said:
        return bad("the MLflow store cannot be opened (unable to open database file: no permission on the file "
                   "or its folder, or the path is a folder)")
    if "UnsupportedModelRegistryStoreURIException" in said or "unsupported URI" in said:
        return bad("not a store URI MLflow takes")
    if "filesystem tracking backend" in said and "maintenance mode" in said:
        return bad("a path or file:// URI is MLflow's retired file store",
                   "give a sqlite file as sqlite:////ABSOLUTE/PATH/mlflow.db, or an http(s):// server (models kept in "
                   "a file store move over with `mlflow migrate-filestore`; MLFLOW_ALLOW_FILE_STORE=true keeps it)")
    return None


def check_server(store: str) -> None:
    """Fail in one line when the http(s) tracking server of `store` has not answered for WAIT_ENV seconds."""
    why = _unreachable(store)
    if why is not None:
        raise RegistryUnreachableError(f"the MLflow tracking server does not answer ({why})", path=_shown(store),
                                       fix="start the server, or point MLFLOW_TRACKING_URI (and MLFLOW_REGISTRY_URI, "
                                           "if set) at a running one")


def check_store(uri: str | None = None) -> None:
    """Fail in one line, before any work, when the store at `uri` (default: this process's tracking URI) cannot
    take writes: a local sqlite file that is read-only, or an http(s) server that does not answer (check_server).
    A stage found out after training, in a 200-line SQLAlchemy traceback or minutes of retries."""
    import sqlite3

    uri = uri or tracking_uri()
    if not uri.startswith("sqlite:///"):
        check_server(uri)
        return
    db = _sqlite_file(uri)
    if db is None:  # in memory
        return
    folder = os.path.dirname(os.path.abspath(db))
    check_sqlite_path(uri)
    try:
        if not os.path.exists(db):  # MLflow creates it, and its missing folders: the nearest existing one must
            while not os.path.exists(folder) and os.path.dirname(folder) != folder:  # take them (and the journal)
                folder = os.path.dirname(folder)
            if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
                raise sqlite3.OperationalError(f"its folder {folder} is not writable")
            return
        # a write that is rolled back: the only test that sees a file made immutable or a read-only mount
        # (permission bits do not stop root)
        with contextlib.closing(sqlite3.connect(db, timeout=60, isolation_level=None)) as con:
            version = con.execute("PRAGMA user_version").fetchone()[0]
            con.execute("BEGIN IMMEDIATE")
            con.execute(f"PRAGMA user_version = {int(version)}")
            con.execute("ROLLBACK")
    except sqlite3.Error as exc:
        raise EmbshardError(f"the MLflow store cannot be written ({first_line(exc)})", path=db,
                            fix="make the file and its folder writable (a read-only mount, chattr +i, a full disk), "
                                "or point MLFLOW_TRACKING_URI at a writable store") from None


def version_for_alias(name: str, alias: str):
    """The ModelVersion behind `name@alias`, or None when the model or the alias does not exist."""
    import mlflow
    from mlflow.exceptions import MlflowException

    check_server(mlflow.get_registry_uri())
    try:
        return mlflow.MlflowClient().get_model_version_by_alias(name, alias)
    except MlflowException as exc:
        if exc.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):  # no such model, or alias
            return None
        # Not "none": a server that stopped answering after check_server (MLflow's client gave up) had read as no
        # champion, and export_placements was skipped as "no champion yet".
        store = _shown(mlflow.get_registry_uri())
        if exc.error_code in ("PERMISSION_DENIED", "UNAUTHENTICATED"):
            raise EmbshardError(f"the registry refused to read {name}@{alias} ({first_line(exc, 120)})", path=store,
                                fix="check MLFLOW_TRACKING_USERNAME/PASSWORD or MLFLOW_TRACKING_TOKEN") from None
        raise RegistryUnreachableError(f"the registry did not answer for {name}@{alias} ({first_line(exc, 120)})",
                                       path=store, fix="try again once the MLflow server answers") from None


def pinned(uri: str) -> str:
    """`models:/name@alias` as the version it points to now, `models:/name/<version>` (what a plan records: an
    alias moves, a version does not); any other URI, or an alias that does not resolve, unchanged (loading it
    then words the error). From a local sqlite store the alias is read directly (no MLflow import)."""
    if not uri.startswith("models:/") or "@" not in uri:
        return uri
    name, alias = uri[len("models:/"):].split("@", 1)
    local, version = _from_sqlite(uri, lambda db: _alias_version(db, name, alias))
    if local:
        return f"models:/{name}/{version}" if version is not None else uri
    mv = version_for_alias(name, alias)
    return f"models:/{name}/{mv.version}" if mv is not None else uri


def version_tag(uri: str, key: str) -> str | None:
    """The tag `key` of the model version a `models:/name/<version>` URI names, or None (no such tag, another
    kind of URI, or no store). From a local sqlite store read directly, as `pinned` does."""
    if not uri.startswith("models:/") or "@" in uri:
        return None
    name, _, version = uri[len("models:/"):].partition("/")
    if not version.isdigit():
        return None
    local, rows = _from_sqlite(uri, lambda db: db.execute(
        "SELECT value FROM model_version_tags WHERE name = ? AND version = ? AND key = ?",
        (name, int(version), key)).fetchall())
    if local:
        return str(rows[0][0]) if rows else None
    import mlflow
    from mlflow.exceptions import MlflowException

    check_server(mlflow.get_registry_uri())
    try:
        return mlflow.MlflowClient().get_model_version(name, version).tags.get(key)
    except MlflowException:
        return None


def _from_sqlite(uri: str, read):
    """(True, read(db)) from this process's store when it is a local sqlite file, read-only and without importing
    MLflow; (True, None) when that store is missing or unreadable; (False, None) for another kind of store."""
    import sqlite3

    store = _store_uri()
    if not store.startswith("sqlite:///"):
        return False, None
    if no_store_error(uri, store) is not None:
        return True, None
    try:
        with _read_only(store) as db:
            return True, read(db)
    except sqlite3.Error:
        return True, None


def _read_only(store: str):
    """A read-only connection to a local sqlite store (loading a model never writes to the store)."""
    import sqlite3

    return contextlib.closing(sqlite3.connect(f"file:{store[len('sqlite:///'):]}?mode=ro", uri=True))


def _alias_version(db, name: str, alias: str) -> str | None:
    """The version `name@alias` names in a sqlite store's tables, or None."""
    rows = db.execute("SELECT version FROM registered_model_aliases WHERE name = ? AND alias = ?",
                      (name, alias)).fetchall()
    return str(rows[0][0]) if len(rows) == 1 else None


def _store_uri() -> str:
    """The registry store this process uses, without importing MLflow when it is not imported yet (MLflow's own
    order: a URI set in-process, MLFLOW_REGISTRY_URI, MLFLOW_TRACKING_URI, then sqlite mlflow.db here)."""
    import sys

    if "mlflow" in sys.modules:
        return sys.modules["mlflow"].get_registry_uri()
    return os.environ.get("MLFLOW_REGISTRY_URI") or tracking_uri()


def check_sqlite_path(store: str) -> None:
    """A sqlite store URI that names a folder is refused at once: MLflow retried opening it for 100 s, then
    printed SQLAlchemy's traceback."""
    db = _sqlite_file(store)
    if db and os.path.isdir(db):
        raise EmbshardError("the MLflow store is a folder, not a sqlite file", path=_shown(store),
                            field="MLFLOW_TRACKING_URI",
                            fix=f"name the file: sqlite:///{os.path.join(db, 'mlflow.db')}")


def no_store_error(uri: str, store: str) -> ModelNotFoundError | None:
    """A missing local store is "no model", not a reason to create an empty mlflow.db where the command runs:
    a command writes nothing outside its --out. A store that is a folder raises (check_sqlite_path)."""
    check_sqlite_path(store)
    db = _sqlite_file(store)
    # An empty file is no store either: MLflow had written its whole schema into it (a command that only reads).
    if db and (not os.path.exists(db) or (os.path.isfile(db) and os.path.getsize(db) == 0)):
        name = uri.split("/")[1].split("@")[0] if uri.startswith("models:/") else uri
        what = f"the MLflow store {db} is an empty file" if os.path.exists(db) else f"there is no MLflow store at {db}"
        # (the error starts with the URI, its path: the message does not say it again)
        return ModelNotFoundError(f"no model: {what}", path=uri,
                                  fix=f"set MLFLOW_TRACKING_URI to the store where '{name}' is registered, or "
                                      "train and register it first")
    return None


def local_artifacts(uri: str) -> dict[str, str] | None:
    """The artifact files of `models:/name@alias` or `models:/name/<version>` in a local sqlite store, read
    without MLflow: {artifact name: local path}, as the pyfunc's load_context would get them.

    The alias is resolved in the database on every call (a moved champion is seen at once), then the version's
    MLmodel file names its artifacts. Loading MLflow's pyfunc machinery for the same files costs seconds
    (imports, store migrations check, dependency checks), most of `embshard place` with the learned planner.
    None when the store is not a local sqlite file or the entry is not plainly there (a missing model or alias,
    another schema): the caller then loads through MLflow, which also words the errors."""
    import sqlite3
    from urllib.parse import unquote, urlparse

    if not uri.startswith("models:/"):
        return None
    store = _store_uri()
    if not store.startswith("sqlite:///"):
        return None
    if no_store_error(uri, store) is not None:
        return None  # MLflow's path raises it (one wording of the error)
    ref = uri[len("models:/"):]
    name, alias = ref.split("@", 1) if "@" in ref else (ref.rsplit("/", 1)[0], None)
    version = None if alias is not None else ref.rsplit("/", 1)[-1]
    if not name or (version is not None and not version.isdigit()):
        return None
    try:
        with _read_only(store) as db:
            if alias is not None:
                version = _alias_version(db, name, alias)
                if version is None:
                    return None
            rows = db.execute("SELECT storage_location, status FROM model_versions WHERE name = ? AND version = ?",
                              (name, int(str(version)))).fetchall()
    except sqlite3.Error:
        return None
    if len(rows) != 1 or rows[0][1] != "READY" or not str(rows[0][0] or "").startswith("file://"):
        return None
    folder = unquote(urlparse(rows[0][0]).path)
    found = _pyfunc_artifacts(folder)
    if found is None:  # registered and ready, but its files are gone: say which, not "train one first"
        raise ModelFilesMissingError(
            f"version {version} of '{name}' is registered but its files are missing ({_missing_file(folder)})",
            path=uri,
            fix=f"restore that folder, or point the alias at a version whose files exist (MlflowClient()."
                f"set_registered_model_alias('{name}', ALIAS, VERSION)), or train and register a new one")
    return found


def _missing_file(folder: str) -> str:
    """The first file a pyfunc model folder lacks (the folder, its MLmodel, or an artifact it names)."""
    mlmodel = os.path.join(folder, "MLmodel")
    if not os.path.isdir(folder):
        return f"no folder {folder}"
    if not os.path.isfile(mlmodel):
        return f"no {mlmodel}"
    paths = _artifact_paths(folder)
    if paths is None:
        return f"{mlmodel} is not a pyfunc model's"
    missing = [p for p in paths.values() if not os.path.isfile(p)]
    return f"no {missing[0]}" if missing else f"{mlmodel} names no artifacts"


def _artifact_paths(folder: str) -> dict[str, str] | None:
    """{artifact name: path} that the MLmodel file of a pyfunc model folder names; None when it is not one."""
    import yaml

    try:
        with open(os.path.join(folder, "MLmodel"), encoding="utf-8") as f:
            arts = yaml.safe_load(f)["flavors"]["python_function"]["artifacts"]
        return {str(k): os.path.join(folder, v["path"]) for k, v in arts.items()}
    except (OSError, yaml.YAMLError, KeyError, TypeError, AttributeError):
        return None


def _pyfunc_artifacts(folder: str) -> dict[str, str] | None:
    """{artifact name: path} of a pyfunc model folder; None when it is not one or a file it names is missing."""
    paths = _artifact_paths(folder)
    return paths if paths and all(os.path.isfile(p) for p in paths.values()) else None


def load_python_model(uri: str):
    """The unwrapped PythonModel instance behind a model URI (`models:/name@alias`, `runs:/...`)."""
    import mlflow
    from mlflow.exceptions import MlflowException

    if uri.startswith(("models:/", "runs:/")):
        store = mlflow.get_registry_uri() if uri.startswith("models:/") else mlflow.get_tracking_uri()
        if (missing := no_store_error(uri, store)) is not None:
            raise missing
        check_server(store)
    try:
        return mlflow.pyfunc.load_model(uri).unwrap_python_model()
    except MlflowException as exc:
        if (unusable := store_error(exc)) is not None:  # the store, not the model: not "train one first"
            raise unusable from None
        if not uri.startswith(("models:/", "runs:/")) and not os.path.exists(uri):
            raise ModelNotFoundError(f"no model there ({first_line(exc)})", path=uri,
                                     fix="give a registered model as models:/NAME@ALIAS or models:/NAME/VERSION "
                                         f"(e.g. {POLICY_CHAMPION_URI}), a run's runs:/RUN_ID/PATH, or a local "
                                         "model folder") from None
        name = uri.split("/")[1].split("@")[0] if uri.startswith("models:/") else uri
        raise ModelNotFoundError(f"no model there ({first_line(exc)})", path=uri,
                                 fix=_no_model_fix(uri, name)) from None


def _no_model_fix(uri: str, name: str) -> str:
    """The fix for a model URI that loads nothing. An alias that names no version, of a model that has versions,
    is set, not trained ("train and register 'embshard-policy' first" had been said with five versions there)."""
    where = f"check MLFLOW_TRACKING_URI ({tracking_uri()})"
    another = f"load models:/{name}/VERSION of another version, or {where}"
    alias = uri.split("@", 1)[1] if uri.startswith("models:/") and "@" in uri else None
    # A version that is not there (models:/NAME/99) of a model that has others: they are listed too.
    number = uri.split("/")[2] if uri.startswith("models:/") and alias is None and uri.count("/") >= 2 else None
    versions: list[int] = []
    if alias is not None or number is not None:
        try:
            if alias is not None and version_for_alias(name, alias) is not None:
                return another  # the alias is set: its version's files are what failed
            from mlflow import MlflowClient

            versions = sorted(int(v.version) for v in MlflowClient().search_model_versions(f"name = '{name}'"))
        except Exception:  # noqa: BLE001 (only the wording of an error depends on it)
            versions = []
    if not versions:
        return f"train and register '{name}' first, or {where}"
    listed = ", ".join(map(str, versions[-5:])) + (f" (and {len(versions) - 5} older)" if len(versions) > 5 else "")
    if alias is None:
        if str(number) in {str(v) for v in versions}:  # the version is there: its files are what failed
            return another
        return f"'{name}' has versions {listed}: use one of them, or {where}"
    setter = ("embshard champion --set VERSION" if (name, alias) == (POLICY_MODEL, CHAMPION) else
              f"MlflowClient().set_registered_model_alias('{name}', '{alias}', VERSION)")
    return (f"'{name}' has versions {listed} but no alias '{alias}': point it at one ({setter}), use "
            f"models:/{name}/VERSION, or {where}")
