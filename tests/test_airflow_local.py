"""`embshard ui`'s supervision, with fake components (seconds, no Airflow): a component that exits is restarted
with a line in its log and on the console, one that keeps crashing is given up on, and stop() ends every process
the components forked, task-like processes in process groups of their own and those of a dead scheduler included.
The real-Airflow version (a scheduler killed during a real run) is in tests/test_airflow_real.py."""
from __future__ import annotations

import os
import sys
import time

import pytest

from embshard import airflow_local
from embshard.airflow_local import LocalAirflow, session_members

# A component that forks a task-like process into a process group of its own (as Airflow's task supervisor does),
# writes its pid, then runs (or exits with EXIT).
FAKE = """
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], process_group=0)
with open(os.environ["FAKE_PIDS"], "a") as f:
    f.write(f"{child.pid}\\n")
code = int(os.environ.get("FAKE_EXIT", "-1"))
if code >= 0:
    sys.exit(code)
time.sleep(120)
"""


@pytest.fixture()
def fake(tmp_path, monkeypatch):
    """A LocalAirflow whose components are FAKE processes (started as start() would, in their own sessions)."""
    monkeypatch.delenv("AIRFLOW_HOME", raising=False)
    monkeypatch.setenv("FAKE_PIDS", str(tmp_path / "children"))
    lines: list[str] = []
    af = LocalAirflow(str(tmp_path / "ui"), 18080, components=("scheduler", "triggerer"), notify=lines.append)
    monkeypatch.setattr(af, "_command", lambda name: [sys.executable, "-c", FAKE])
    af.log_dir.mkdir(parents=True)

    def launch(exit_codes: dict[str, int]) -> None:
        for name in af.components:
            if name in exit_codes:
                monkeypatch.setenv("FAKE_EXIT", str(exit_codes[name]))
            else:
                monkeypatch.delenv("FAKE_EXIT", raising=False)
            af.procs[name] = af._spawn(name)
        monkeypatch.delenv("FAKE_EXIT", raising=False)

    yield af, launch, lines, tmp_path / "children"
    af.stop()


def children(path) -> list[int]:
    return [int(x) for x in path.read_text().split()] if path.exists() else []


def alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_until(cond, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def test_a_crashed_component_is_restarted_with_a_line_in_its_log_and_on_the_console(fake):
    af, launch, lines, _ = fake
    launch({"triggerer": 3})
    first = af.procs["triggerer"]
    assert wait_until(lambda: first.poll() is not None)
    assert af.supervise_once() == ["triggerer"]
    # Running again (FAKE_EXIT is unset for the restart).
    assert af.procs["triggerer"] is not first and af.procs["triggerer"].poll() is None
    assert af.procs["scheduler"].poll() is None and af.failed is None  # the others untouched
    log = (af.log_dir / "triggerer.log").read_text()
    assert "airflow triggerer exited with code 3; restarting it" in log
    assert lines and "triggerer exited with code 3" in lines[0]
    assert af.supervise_once() == []  # nothing else to do


def test_a_component_that_keeps_crashing_is_given_up_on(fake, monkeypatch):
    af, launch, lines, _ = fake
    monkeypatch.setattr(airflow_local, "MAX_RESTARTS", 2)
    launch({"triggerer": 1})
    monkeypatch.setenv("FAKE_EXIT", "1")  # every restart crashes too
    for _ in range(2):
        assert wait_until(lambda: af.procs["triggerer"].poll() is not None)
        assert af.supervise_once() == ["triggerer"]
    assert wait_until(lambda: af.procs["triggerer"].poll() is not None)
    assert af.supervise_once() == [] and af.failed_component == "triggerer"
    assert "exited 3 times" in af.failed and "not restarting it again" in (af.log_dir / "triggerer.log").read_text()


def test_the_supervisor_thread_restarts_without_being_asked(fake, monkeypatch):
    af, launch, lines, _ = fake
    monkeypatch.setattr(airflow_local, "SUPERVISE_EVERY_S", 0.1)
    launch({})
    af._stopping.clear()
    import threading

    af._supervisor = threading.Thread(target=af._supervise, daemon=True)
    af._supervisor.start()
    old = af.procs["scheduler"]
    old.kill()
    assert wait_until(lambda: af.procs["scheduler"] is not old)
    assert wait_until(lambda: bool(lines)) and "airflow scheduler exited" in lines[0]


def test_stop_ends_task_processes_in_their_own_groups_and_those_a_dead_scheduler_left(fake):
    af, launch, lines, pids_file = fake
    launch({"scheduler": 0})  # the scheduler forks a task-like process, then dies: the task runs on
    dead = af.procs["scheduler"]
    assert wait_until(lambda: dead.poll() is not None and len(children(pids_file)) == 2)
    orphan = next(p for p in children(pids_file) if os.getsid(p) == dead.pid)
    assert af.supervise_once() == ["scheduler"]
    assert alive(orphan), "a dead scheduler's task process finishes its task"
    assert wait_until(lambda: len(children(pids_file)) == 3)
    sessions = af.sessions()
    assert dead.pid in sessions and len(sessions) == 3
    af.stop()
    for pid in children(pids_file):
        assert not alive(pid), f"process {pid} (own process group) outlived stop()"
    assert all(session_members(s) == [] for s in sessions)
