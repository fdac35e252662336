"""`embshard ui` (make ui): a real local Airflow for the embedded default, and a small REST client for it.

The api-server, the scheduler (LocalExecutor), the DAG processor and the triggerer run as separate processes,
each in its own session, listening on 127.0.0.1 only, with the environment every stage needs:
AIRFLOW_HOME and the dags folder, the virtualenv's bin first on PATH (Airflow starts its parts as `airflow`),
the run data root and the one MLflow store that `make run` and `make mlflow-ui` use. Their logs go to
AIRFLOW_HOME/logs/<component>.log. The tests start the same thing and trigger the DAG through the REST API.

Supervision: a thread restarts a component that exits (a line in its log and on the console), so one crash
does not take the UI down; a component that keeps crashing (MAX_RESTARTS within RESTART_WINDOW_S) is given up
on. A dead scheduler's task processes keep running their tasks (they report to the api-server, not to the
scheduler) and finish them; the other components' leftovers are ended before the restart. Tasks retry their
calls to the api-server for minutes (`environment`), so a task does not fail while it comes back. `stop()`
ends every process of every session it started, restarted ones included: the task processes too, which
Airflow puts in process groups of their own.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from . import run_owner
from .errors import EmbshardError

COMPONENTS = ("api-server", "scheduler", "dag-processor", "triggerer")
# A component that exits is restarted, up to MAX_RESTARTS times within RESTART_WINDOW_S (then given up on).
SUPERVISE_EVERY_S, MAX_RESTARTS, RESTART_WINDOW_S = 1.0, 5, 600.0
# A dead component's session holds these still-useful processes: a scheduler's task processes finish their task.
KEEPS_ORPHANS = ("scheduler",)
USER = "admin"
DAG_ID = "embshard_pipeline"


def session_members(sid: int) -> list[int]:
    """PIDs of session `sid` that still run (zombies don't count). A component starts its own session, and every
    process it forks stays in it, the task processes included, which Airflow moves to process groups of their
    own: a session reaches them where a process group does not."""
    import psutil

    pids = []
    for proc in psutil.process_iter(["status"]):
        try:
            if proc.info["status"] != psutil.STATUS_ZOMBIE and os.getsid(proc.pid) == sid:
                pids.append(proc.pid)
        except (ProcessLookupError, psutil.Error, PermissionError):
            pass
    return pids


def _signal_session(sid: int, sig: int) -> None:
    for pid in session_members(sid):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def environment(out: str, port: int) -> dict[str, str]:
    """The environment of every Airflow component and every task of a local installation rooted at `out`."""
    from .pipeline import local_environment

    base_url = f"http://127.0.0.1:{port}"
    bin_dir = os.path.dirname(sys.executable)
    return {
        **local_environment(out),
        "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": f"{USER}:admin",
        "AIRFLOW__API__HOST": "127.0.0.1",
        "AIRFLOW__API__PORT": str(port),
        "AIRFLOW__API__BASE_URL": base_url,
        "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{base_url}/execution/",
        # A fresh DAG file is seen within seconds, not after the default 5 minutes.
        "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "30",
        # A task's calls to the api-server retry for about 3 minutes (default: 31 s), so a task that starts or
        # reports while a crashed api-server is being restarted waits for it instead of failing a try.
        "AIRFLOW__WORKERS__EXECUTION_API_RETRIES": "10",
        "AIRFLOW__WORKERS__EXECUTION_API_RETRY_WAIT_MAX": "30",
        "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""),
        "PYTHONUNBUFFERED": "1",
    }


class LocalAirflow:
    """Start, reach and stop a local Airflow: `with LocalAirflow(out, port) as af: af.trigger(conf)`."""

    def __init__(self, out: str = "runs/local", port: int = 8080, components=COMPONENTS, notify=None,
                 base_env: dict[str, str] | None = None):
        # What the components inherit under self.env: this process's environment when each starts, unless given
        # (the tests run an Airflow beside tests that change theirs).
        self.base_env = base_env
        self.out = os.path.abspath(out)
        self.port = int(port)
        self.env = environment(self.out, self.port)
        self.home = Path(self.env["AIRFLOW_HOME"])
        self.components = tuple(components)
        self.procs: dict[str, subprocess.Popen] = {}
        self._token: str | None = None
        self.notify = notify or (lambda _line: None)  # where a restart is announced besides the component's log
        self.retired: list[int] = []  # sessions of components that died: stop() ends what they still hold
        self.restarts: dict[str, list[float]] = {}  # component -> monotonic times of its restarts
        self.failed: str | None = None  # why a component was given up on (then supervision ends)
        self.failed_component: str | None = None
        self._stopping = threading.Event()
        self._supervisor: threading.Thread | None = None

    @property
    def url(self) -> str:
        return self.env["AIRFLOW__API__BASE_URL"]

    @property
    def log_dir(self) -> Path:
        return self.home / "logs"

    def password(self) -> str:
        """The admin password, generated once into Airflow's own simple-auth-manager password file."""
        path = self.home / "simple_auth_manager_passwords.json.generated"
        passwords = json.loads(path.read_text()) if path.exists() and path.read_text().strip() else {}
        if USER not in passwords:
            passwords[USER] = secrets.token_urlsafe(12)
            self.home.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(passwords) + "\n")
            path.chmod(0o600)
        return passwords[USER]

    def _airflow(self, *args: str) -> list[str]:
        return [os.path.join(os.path.dirname(sys.executable), "airflow"), *args]

    def start(self, timeout_s: float = 180.0) -> LocalAirflow:
        if _port_busy(self.port):
            raise EmbshardError(f"port {self.port} on 127.0.0.1 is in use", field="port",
                                fix="stop what listens there (an earlier `make ui`?) or pass --port")
        self.home.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._refuse_beside_another_owner()
        # said once nothing refused (it had been printed before a refusal)
        self.notify(f"starting Airflow ({', '.join(self.components)}); logs in {self.log_dir}")
        run_owner.write_ui(self.home, self.url, {})  # before anything starts: a pipeline starting now sees it
        try:
            env = self._component_env()
            self.password()
            migrate = subprocess.run(self._airflow("db", "migrate"), env=env, capture_output=True, text=True)
            if migrate.returncode != 0:
                (self.log_dir / "db-migrate.log").write_text(migrate.stdout + migrate.stderr)
                raise EmbshardError("airflow db migrate failed", path=str(self.log_dir / "db-migrate.log"),
                                    fix="read the log; remove AIRFLOW_HOME to start from a fresh database")
            self._reap(env)
            for name in self.components:
                self.procs[name] = self._spawn(name)
            self._write_pids()
            self.wait_healthy(timeout_s)
        except BaseException:
            self.stop()
            raise
        self._stopping.clear()
        self._supervisor = threading.Thread(target=self._supervise, name="embshard-ui-supervisor", daemon=True)
        self._supervisor.start()
        return self

    def _component_env(self) -> dict[str, str]:
        return {**(os.environ if self.base_env is None else self.base_env), **self.env}

    def _command(self, name: str) -> list[str]:
        args = {"api-server": ("api-server", "--host", "127.0.0.1", "--port", str(self.port)),
                # No log servers on 0.0.0.0: with one machine, the API server reads task logs from files.
                "scheduler": ("scheduler", "--skip-serve-logs"),
                "triggerer": ("triggerer", "--skip-serve-logs")}.get(name, (name,))
        return self._airflow(*args)

    def _spawn(self, name: str) -> subprocess.Popen:
        """Start one component in a session of its own: stop() ends it with everything it forked."""
        with open(self.log_dir / f"{name}.log", "ab") as log:
            return subprocess.Popen(self._command(name), env=self._component_env(), stdout=log,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)

    def _write_pids(self) -> None:
        """The UI's record (run_owner.UI): this process and its components, pids with start times."""
        run_owner.write_ui(self.home, self.url, {k: p.pid for k, p in self.procs.items()})

    def _refuse_beside_another_owner(self) -> None:
        """One owner per folder: the scheduler would also run the tasks of an `embshard pipeline`'s dag.test() run
        (and a second UI's scheduler those of the first)."""
        pipelines = run_owner.live_pipelines(self.home)
        if pipelines:
            owner = pipelines[0]
            raise EmbshardError(f"embshard pipeline (pid {owner['pid']}) is running run {owner['run_id']} on this "
                                "folder; a scheduler here would run its tasks too", path=self.out,
                                fix="wait for it to end (or stop it with Ctrl-C), or start the UI on another --out")
        what = run_owner.live_ui(self.home)
        if what:
            raise EmbshardError(what, path=self.out, fix="use that UI, or stop it first, or give another --out")

    def _reap(self, env: dict[str, str]) -> None:
        """Fail the dag.test() runs a killed `embshard pipeline` left running (run_owner.reap), before the
        scheduler starts: else max_active_runs=1 queues every run behind one that never ends. Airflow reads its
        home at import, so this runs in a process of the installation's environment."""
        res = subprocess.run([sys.executable, "-m", "embshard.run_owner", DAG_ID], env=env, capture_output=True,
                             text=True)
        lines = [line for line in res.stdout.splitlines() if line.startswith("embshard:")]
        if res.returncode != 0:
            (self.log_dir / "reap.log").write_text(res.stdout + res.stderr)
            lines.append(f"embshard ui: could not check for runs a killed embshard pipeline left running (exit "
                         f"code {res.returncode}; {self.log_dir / 'reap.log'})")
        for line in lines:
            self._log_line("scheduler", line)
            self.notify(line)

    def _supervise(self) -> None:
        while not self._stopping.wait(SUPERVISE_EVERY_S) and self.failed is None:
            try:
                self.supervise_once()
            except Exception as exc:  # never let the watcher die silently
                self.notify(f"embshard ui: supervisor error: {exc}")

    def supervise_once(self) -> list[str]:
        """Restart every component that has exited; returns their names. A component restarted MAX_RESTARTS
        times within RESTART_WINDOW_S is given up on (`failed` says which, and the supervision ends)."""
        restarted: list[str] = []
        for name, proc in list(self.procs.items()):
            code = proc.poll()
            if code is None or self._stopping.is_set():
                continue
            now = time.monotonic()
            recent = [t for t in self.restarts.get(name, []) if now - t < RESTART_WINDOW_S]
            if len(recent) >= MAX_RESTARTS:
                self.failed_component = name
                self.failed = (f"airflow {name} exited {len(recent) + 1} times within "
                               f"{RESTART_WINDOW_S / 60:.0f} min (last exit code {code})")
                self._log_line(name, f"embshard ui: {self.failed}; not restarting it again")
                return restarted
            self.retired.append(proc.pid)
            if name not in KEEPS_ORPHANS:  # e.g. an api-server's workers would hold the port
                _signal_session(proc.pid, signal.SIGKILL)
            line = (f"embshard ui: airflow {name} exited with code {code}; restarting it "
                    f"(restart {len(recent) + 1} within {RESTART_WINDOW_S / 60:.0f} min)")
            self._log_line(name, line)
            self.notify(line)
            self.procs[name] = self._spawn(name)
            self.restarts[name] = [*recent, now]
            restarted.append(name)
        if restarted:
            self._write_pids()
        return restarted

    def _log_line(self, name: str, line: str) -> None:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        with open(self.log_dir / f"{name}.log", "a", encoding="utf-8") as f:
            f.write(f"[{stamp}] {line}\n")

    def sessions(self) -> list[int]:
        """Every session this installation started: the running components' and those of components that died."""
        return [*(p.pid for p in self.procs.values()), *self.retired]

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        last = "no answer"
        while time.monotonic() < deadline:
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise EmbshardError(f"airflow {name} exited with code {p.returncode}",
                                        path=str(self.log_dir / f"{name}.log"), fix="read the component's log")
            try:
                health = self._request("GET", "/api/v2/monitor/health", auth=False)
                states = {k: (v or {}).get("status") for k, v in health.items()}
                if states.get("metadatabase") == "healthy" and states.get("scheduler") == "healthy":
                    return
                last = str(states)
            except (urllib.error.URLError, ConnectionError, TimeoutError, json.JSONDecodeError) as exc:
                last = str(exc)
            time.sleep(2)
        raise EmbshardError(f"Airflow not healthy after {timeout_s:.0f} s ({last})", path=str(self.log_dir),
                            fix="read the component logs")

    def stop(self) -> None:
        self._stopping.set()  # no restarts from here on
        if self._supervisor is not None and self._supervisor is not threading.current_thread():
            self._supervisor.join(timeout=10)
        sessions = self.sessions()
        for p in self.procs.values():
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        for p in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
        # Whatever the sessions still hold: LocalExecutor workers, uvicorn children, and the task processes,
        # which Airflow puts in process groups of their own (a process-group kill missed them, and a killed
        # task's process outlived `make ui` by seconds), also those of components that died and were restarted.
        for sid in sessions:
            _signal_session(sid, signal.SIGKILL)
        for p in self.procs.values():
            p.wait()
        # SIGKILL lands asynchronously (a worker in a disk wait dies a moment later): stop() returns once no
        # member of any session is still running, so a caller that checks right after sees them gone.
        deadline = time.monotonic() + 30
        while any(session_members(sid) for sid in sessions) and time.monotonic() < deadline:
            time.sleep(0.1)
        self.procs.clear()
        self.retired.clear()
        run_owner.remove_ui(self.home)

    def __enter__(self) -> LocalAirflow:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # --- REST API -------------------------------------------------------------------------------------------
    def _request(self, method: str, path: str, body: dict | None = None, auth: bool = True) -> dict:
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if auth:
            headers["Authorization"] = f"Bearer {self.token()}"
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        with urllib.request.urlopen(req, timeout=30) as resp:
            text = resp.read().decode()
        return json.loads(text) if text else {}

    def token(self) -> str:
        if self._token is None:
            res = self._request("POST", "/auth/token", {"username": USER, "password": self.password()}, auth=False)
            self._token = res["access_token"]
        return self._token

    def wait_for_dag(self, dag_id: str = DAG_ID, timeout_s: float = 180.0) -> dict:
        """The DAG as the API server knows it, once the DAG processor has parsed it."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return self._request("GET", f"/api/v2/dags/{dag_id}")
            except urllib.error.HTTPError as exc:
                if exc.code != 404 or time.monotonic() > deadline:
                    raise
            time.sleep(2)

    def trigger(self, conf: dict | None = None, dag_id: str = DAG_ID) -> str:
        """Unpause the DAG and start a manual run with `conf`; returns the run id."""
        self.wait_for_dag(dag_id)
        self._request("PATCH", f"/api/v2/dags/{dag_id}", {"is_paused": False})
        run = self._request("POST", f"/api/v2/dags/{dag_id}/dagRuns", {"logical_date": None, "conf": conf or {}})
        return run["dag_run_id"]

    def run_state(self, run_id: str, dag_id: str = DAG_ID) -> str:
        return self._request("GET", f"/api/v2/dags/{dag_id}/dagRuns/{urllib.parse.quote(run_id, safe='')}")["state"]

    def task_states(self, run_id: str, dag_id: str = DAG_ID) -> dict[str, str]:
        res = self._request("GET", f"/api/v2/dags/{dag_id}/dagRuns/{urllib.parse.quote(run_id, safe='')}"
                                   "/taskInstances?limit=100")
        out: dict[str, str] = {}
        for ti in res.get("task_instances", []):
            key = ti["task_id"] + (f"[{ti['map_index']}]" if ti.get("map_index", -1) >= 0 else "")
            out[key] = ti.get("state")
        return out

    def wait_run(self, run_id: str, timeout_s: float, dag_id: str = DAG_ID, progress=print) -> str:
        """Poll until the run ends; prints each task's state change; returns the final state."""
        deadline = time.monotonic() + timeout_s
        seen: dict[str, str] = {}
        while time.monotonic() < deadline:
            for task, state in sorted(self.task_states(run_id, dag_id).items()):
                if seen.get(task) != state:
                    seen[task] = state
                    progress(f"  {task}: {state}")
            state = self.run_state(run_id, dag_id)
            if state in ("success", "failed"):
                return state
            time.sleep(3)
        return "timeout"


def _port_busy(port: int) -> bool:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


# What --out holds (the local Airflow's installation, data and MLflow store): checked before any work
# (cli.check_output), so a file given as --out is one line.
OUTPUT = {"kind": "folder"}


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="runs/local", help="installation folder: airflow/, data/, mlflow.db")
    p.add_argument("--port", type=port, default=8080, help="port of the Airflow UI and API on 127.0.0.1 (1-65535)")


def port(text: str) -> int:
    """A TCP port the UI can listen on and be reached at: 1..65535 (0 would be a random port nobody knows)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port from 1 to 65535")
    return value


def main(args) -> int:
    from .signals import stop_on_sigterm

    # `kill` (SIGTERM) stops the components too, as Ctrl-C does: they run in their own sessions.
    stop_on_sigterm()
    from .pipeline import outside_out

    for line in outside_out(args.out):
        print(line, flush=True)
    af = LocalAirflow(args.out, args.port, notify=lambda line: print(line, flush=True))
    af.start()
    try:
        af.wait_for_dag()
        print("\n".join([
            "", "=" * 78,
            f"Airflow UI:   {af.url}    login: {USER} / {af.password()}",
            f"DAG:          {af.url}/dags/{DAG_ID}   (paused until unpaused; Trigger runs it now)",
            f"run data:     {af.env['EMBSHARD_DATA_ROOT']}/<run id>",
            # a command that opens this store from any folder (`make mlflow-ui` opens runs/local's alone)
            f"MLflow store: {af.env['MLFLOW_TRACKING_URI']}   (open it: "
            f"{os.path.join(os.path.dirname(sys.executable), 'mlflow')} ui --backend-store-uri "
            f"'{af.env['MLFLOW_TRACKING_URI']}')",
            f"logs:         {af.log_dir}",
            "Unpausing schedules the weekly run (next Monday 03:00 UTC); it does not start one now.",
            "The Trigger form's 'Unpause on trigger' box (ticked by default) unpauses the DAG as it triggers:",
            "that turns the weekly schedule on. Leave it ticked: a run of a paused DAG waits 'queued' until the",
            "DAG is unpaused. For one-off runs without a schedule, start the UI with EMBSHARD_SCHEDULE=none.",
            "A component that crashes is restarted (a line here and in its log); the UI stays up.",
            "Press Ctrl-C to stop.", "=" * 78], ), flush=True)
        while af.failed is None:
            time.sleep(1)
        raise EmbshardError(af.failed, path=str(af.log_dir / f"{af.failed_component}.log"),
                            fix="read the component's log")
    except KeyboardInterrupt:
        print("stopping Airflow", flush=True)
        return 0
    finally:
        af.stop()
