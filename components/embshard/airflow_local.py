"""`embshard ui` (make ui): a real local Airflow for the embedded default, and a small REST client for it.

The api-server, the scheduler (LocalExecutor), the DAG processor and the triggerer run as separate processes,
each in its own process group, listening on 127.0.0.1 only, with the environment every stage needs:
AIRFLOW_HOME and the dags folder, the virtualenv's bin first on PATH (Airflow starts its parts as `airflow`),
the run data root and the one MLflow store that `make run` and `make mlflow-ui` use. Their logs go to
AIRFLOW_HOME/logs/<component>.log; `stop()` ends them by process group. The tests start the same thing and
trigger the DAG through the REST API.
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from .errors import EmbshardError

COMPONENTS = ("api-server", "scheduler", "dag-processor", "triggerer")
USER = "admin"
DAG_ID = "embshard_pipeline"


def living_members(pgid: int) -> list[int]:
    """PIDs of process group `pgid` that still run. Zombies don't count: an orphaned worker's exit status
    waits for whoever adopted it (init, or a container's PID 1) to reap it, and it holds nothing but a PID."""
    import psutil

    pids = []
    for proc in psutil.process_iter(["status"]):
        try:
            if proc.info["status"] != psutil.STATUS_ZOMBIE and os.getpgid(proc.pid) == pgid:
                pids.append(proc.pid)
        except (ProcessLookupError, psutil.Error):
            pass
    return pids


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
        "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""),
        "PYTHONUNBUFFERED": "1",
    }


class LocalAirflow:
    """Start, reach and stop a local Airflow: `with LocalAirflow(out, port) as af: af.trigger(conf)`."""

    def __init__(self, out: str = "runs/local", port: int = 8080, components=COMPONENTS):
        self.out = os.path.abspath(out)
        self.port = int(port)
        self.env = environment(self.out, self.port)
        self.home = Path(self.env["AIRFLOW_HOME"])
        self.components = tuple(components)
        self.procs: dict[str, subprocess.Popen] = {}
        self._token: str | None = None

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

    def start(self, timeout_s: float = 180.0) -> "LocalAirflow":
        if _port_busy(self.port):
            raise EmbshardError(f"port {self.port} on 127.0.0.1 is in use", field="port",
                                fix="stop what listens there (an earlier `make ui`?) or pass --port")
        self.home.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **self.env}
        self.password()
        migrate = subprocess.run(self._airflow("db", "migrate"), env=env, capture_output=True, text=True)
        if migrate.returncode != 0:
            (self.log_dir / "db-migrate.log").write_text(migrate.stdout + migrate.stderr)
            raise EmbshardError("airflow db migrate failed", path=str(self.log_dir / "db-migrate.log"),
                                fix="read the log; remove AIRFLOW_HOME to start from a fresh database")
        for name in self.components:
            log = open(self.log_dir / f"{name}.log", "ab")
            args = {"api-server": ("api-server", "--host", "127.0.0.1", "--port", str(self.port)),
                    # No log servers on 0.0.0.0: with one machine, the API server reads task logs from files.
                    "scheduler": ("scheduler", "--skip-serve-logs"),
                    "triggerer": ("triggerer", "--skip-serve-logs")}.get(name, (name,))
            # Own process group: stop() ends the component with all the workers it forked.
            self.procs[name] = subprocess.Popen(self._airflow(*args), env=env, stdout=log, stderr=subprocess.STDOUT,
                                                stdin=subprocess.DEVNULL, start_new_session=True)
            log.close()
        (self.home / "embshard-pids.json").write_text(json.dumps({k: p.pid for k, p in self.procs.items()}))
        try:
            self.wait_healthy(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

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
        for p in self.procs.values():
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 30
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            try:  # whatever the group still holds (LocalExecutor workers, gunicorn/uvicorn children)
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
        # SIGKILL lands asynchronously (a worker in a disk wait dies a moment later): stop() returns once no
        # member of any group is still running, so a caller that checks right after sees them gone.
        deadline = time.monotonic() + 30
        while any(living_members(p.pid) for p in self.procs.values()) and time.monotonic() < deadline:
            time.sleep(0.1)
        self.procs.clear()

    def __enter__(self) -> "LocalAirflow":
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


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main(args) -> int:
    # `kill` (SIGTERM) stops the components too, as Ctrl-C does: they run in their own sessions.
    signal.signal(signal.SIGTERM, _interrupt)
    af = LocalAirflow(args.out, args.port)
    print(f"starting Airflow (api-server, scheduler, dag-processor, triggerer); logs in {af.log_dir}", flush=True)
    af.start()
    try:
        af.wait_for_dag()
        print("\n".join([
            "", "=" * 78,
            f"Airflow UI:   {af.url}    login: {USER} / {af.password()}",
            f"DAG:          {af.url}/dags/{DAG_ID}   (paused until you unpause it; Trigger runs it now)",
            f"run data:     {af.env['EMBSHARD_DATA_ROOT']}/<run id>",
            f"MLflow store: {af.env['MLFLOW_TRACKING_URI']}   (make mlflow-ui opens it)",
            f"logs:         {af.log_dir}",
            "Unpausing schedules the weekly run (next Monday 03:00 UTC); it does not start one now.",
            "Press Ctrl-C to stop.", "=" * 78], ), flush=True)
        while all(p.poll() is None for p in af.procs.values()):
            time.sleep(2)
        dead = [n for n, p in af.procs.items() if p.poll() is not None]
        raise EmbshardError(f"airflow {dead[0]} stopped", path=str(af.log_dir / f"{dead[0]}.log"),
                            fix="read the component's log")
    except KeyboardInterrupt:
        print("stopping Airflow", flush=True)
        return 0
    finally:
        af.stop()
