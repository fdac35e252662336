"""A placement someone already has, measured beside the planners: `embshard evaluate --plan FILE`.

FILE is a plan.json (embshard.plan/v1, v2 or v3) or the pickle-free `torchrec_plan.json` that `embshard export`
writes. `UserPlan` plans a task (`plan_task`, as a planner does) by reading that file's placement, so the ruler
measures it exactly like the planners' plans (its entry is named `user_plan`; the evaluate job hands it to the
evaluation beside the planners it builds by name). The file must be a plan of the task: the same tables,
the same number of devices, and it must fit the task's memory per device; anything else is one EmbshardError
naming the file.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import re

import pandas as pd

from ..errors import EmbshardError, InfeasiblePlacementError
from ..placement import Placement
from ..tableset import TableSet
from ..types import DeviceTopology, Task

log = logging.getLogger(__name__)

NAME = "user_plan"
MEASURED_KERNELS = ("fused", "dense")  # TorchRec's EmbeddingComputeKernel values of what the benchmark runs
_FIX = "give a plan.json or torchrec_plan.json that `embshard export` wrote for this task"


def _warn_if_other_traffic(doc: dict, tables: TableSet, path: str) -> None:
    """One warning when a table's pooling (lookups per sample) is not the one the plan.json was made for: the plan
    is still measured on the tables given (how does our old layout do on today's traffic?), but it was balanced for
    other traffic, and `export` refuses it for that."""
    from .plan_json import changed_pooling

    changed = changed_pooling(doc, tables)
    if changed:
        name, was, now = changed[0]
        more = f" and {len(changed) - 1} more" if len(changed) > 1 else ""
        log.warning("%s: table %s%s has other traffic than the plan was made for (pooling_factor %g in the plan, %g "
                    "in the tables given): it is measured on the tables given, and `embshard export` refuses it "
                    "with these tables (plan again for this traffic to export one)", path, name, more, was, now)


def _warn_if_torchrec_cannot_run(placement: Placement, path: str) -> None:
    """A plan.json's layout is measured as written, but a team comparing plans should know when TorchRec cannot run
    it (uneven row ranges, unequal slices on one device): `embshard export` refuses those, evaluate had measured them
    without a word."""
    from .torchrec_plan import require_torchrec, to_torchrec_plan

    try:
        require_torchrec()
    except EmbshardError:  # no TorchRec here: nothing to say about what it runs
        return
    try:
        to_torchrec_plan(placement, compute_device="cpu")
    except EmbshardError as exc:
        log.warning("%s: measured as written, but TorchRec cannot run this plan (embshard export refuses it): %s",
                    path, exc.message)


class UserPlan:
    """The placement in a plan file, as a planner (see the module docstring)."""

    def __init__(self, path: str | os.PathLike, name: str = NAME):
        self.path = os.fspath(path)
        self.name = name
        self._doc: dict | None = None
        self._warned: set[str] = set()  # tasks whose traffic warning was given (check_tasks, then the plan)

    def document(self) -> dict:
        """The file's JSON, read and checked once: a plan.json fully (schema and coverage), a TorchRec plan's
        structure when it is applied to a task."""
        if self._doc is None:
            from ..checks import input_file, read_json_file

            input_file(self.path, field="plan", fix=_FIX)
            if self.path.lower().endswith((".parquet", ".pq")):
                raise EmbshardError("a Parquet file (placements?), not a plan file", path=self.path, field="plan",
                                    fix="give one task's plan.json (`embshard place` writes it; `embshard export "
                                        "--placements FILE` writes one per task) or its torchrec_plan.json")
            try:
                doc = read_json_file(self.path, field="plan", fix=_FIX)
            except EmbshardError as exc:
                from .torchrec_plan import is_pickled, pickled_plan_error

                if "not UTF-8" in exc.message and is_pickled(self.path):
                    raise pickled_plan_error(self.path, "plan") from None
                raise
            schema = str(doc.get("schema", "")) if isinstance(doc, dict) else ""
            if schema.startswith("embshard.plan/"):
                from .plan_json import read_plan_json

                doc = read_plan_json(self.path)
            elif schema.startswith("embshard.torchrec_plan/"):
                self._check_torchrec_doc(doc)
            else:
                raise EmbshardError(f"schema {schema[:40]!r} is neither embshard.plan nor embshard.torchrec_plan",
                                    path=self.path, field="schema", fix=_FIX)
            self._doc = doc
        return self._doc

    def _check_torchrec_doc(self, doc: dict) -> None:
        """A TorchRec plan's structure as a training job checks it (torchrec_plan.check_plan_doc: modules, world
        size, shards; the task's tables come later, in plan_from_json), and exactly one module of named tables."""
        from .torchrec_plan import check_plan_doc, require_torchrec

        require_torchrec()
        check_plan_doc(doc, self.path)
        modules = doc["modules"]
        if not modules or not all(isinstance(m, dict) for m in modules.values()):
            raise EmbshardError("a TorchRec plan names its EmbeddingBagCollections' tables under `modules`",
                                path=self.path, field="modules", fix=_FIX)
        if len(modules) > 1:
            # A model's EBCs (its weighted features in one of their own, as TorchRec's per-EBC is_weighted asks):
            # measured as one set of tables (check_plan_doc refused a table named in two modules).
            doc["modules"] = {next(iter(modules)): {n: p for params in modules.values() for n, p in params.items()}}

    def is_torchrec(self) -> bool:
        return str(self.document().get("schema", "")).startswith("embshard.torchrec_plan/")

    def world_size(self) -> int:
        """The plan's devices: a plan.json's num_devices, a TorchRec plan's world_size, else (written without it, as
        plan_to_json allows) one past its highest rank."""
        doc = self.document()
        if not self.is_torchrec():
            return int(doc["num_devices"])
        return int(doc["world_size"]) if "world_size" in doc else self._ranks_used()

    def _ranks_used(self) -> int:
        """A TorchRec plan's ranks that hold a table: one past its highest."""
        return 1 + max(int(r) for params in self.document()["modules"].values() for p in params.values()
                       for r in p["ranks"])

    def table_ids(self) -> list[str]:
        doc = self.document()
        if not self.is_torchrec():
            return [str(t["table_id"]) for t in doc["tables"]]
        return [str(n) for n in next(iter(doc["modules"].values()))]

    def own_task_id(self) -> str | None:
        """The task a plan.json was made for (its task_id); None for a TorchRec plan (its `source` says which task
        made it, but not the task's memory: it is no task to evaluate)."""
        return None if self.is_torchrec() else str(self.document()["task_id"])

    def task_frame(self, memory_bytes: int | None = None, devices_per_host: int | None = None) -> pd.DataFrame:
        """The plan's own task as a tasks.parquet row (its tables, devices, memory and hosts): what
        `evaluate --plan` measures when no tasks file is given. `memory_bytes` (evaluate's --memory-gb) replaces
        a plan.json's memory per device; a TorchRec plan records none, so it needs one. `devices_per_host`
        (evaluate's --devices-per-host): a TorchRec plan's hosts (it records none: one host without it); a
        plan.json records its own, and another count is refused."""
        doc = self.document()
        if devices_per_host is not None:
            devices = self.world_size()
            # a flag's mistake, not the file's: named by the flag (the file only in the message)
            if int(devices_per_host) < 1 or devices % int(devices_per_host):
                raise EmbshardError(f"the plan's {devices} devices ({os.path.basename(self.path)}) do not split "
                                    f"into hosts of {devices_per_host}", field="devices_per_host",
                                    fix="give a number of devices per host that divides them")
            if not self.is_torchrec():  # a plan.json records its hosts (none: one host)
                own = self._own_devices_per_host()
                if own != int(devices_per_host):
                    raise EmbshardError(
                        f"the plan records {own} devices per host, not {devices_per_host}", path=self.path,
                        field="devices_per_host",
                        fix="leave out --devices-per-host (a plan.json records its hosts), or plan again with "
                            f"--devices-per-host {devices_per_host} (a plan written by hand: add its `hosts`)")
        if self.is_torchrec():
            if memory_bytes is None:
                raise EmbshardError("a TorchRec plan records no memory per device, so it makes no task",
                                    path=self.path, field="memory_gb",
                                    fix="give --memory-gb (what a device may hold of embedding weights), or --tasks")
            # the task is named after the file, made an id ('team plan (1).json' -> 'team_plan__1_')
            name = re.sub(r"[^A-Za-z0-9_.-]", "_", os.path.splitext(os.path.basename(self.path))[0])
            name = ("_" + name if not name or name[0] in ".-" else name)[:128]
            world = self.world_size()
            used = self._ranks_used()
            if used < world:  # the planners get the whole world: the plan's idle ranks would read as its choice
                log.warning("%s: the plan's world is %d ranks, its tables are on ranks 0-%d only: it is measured on "
                            "%d devices, %d of them idle, and the planners plan %d", self.path, world, used - 1, world,
                            world - used, world)
            row = {"task_id": name, "split": "test", "num_devices": world,
                   "memory_bytes_per_device": int(memory_bytes), "table_ids": self.table_ids()}
            if devices_per_host is not None and int(devices_per_host) < world:
                row["devices_per_host"] = int(devices_per_host)
            return pd.DataFrame([row])
        world = int(doc["num_devices"])
        used = 1 + max((int(s["device"]) for t in doc["tables"] for s in t.get("shards") or []
                        if isinstance(s, dict) and isinstance(s.get("device"), int)), default=world - 1)
        if used < world:  # as for a TorchRec plan: a num_devices typed larger than the plan's devices is said
            log.warning("%s: the plan's num_devices is %d, its tables are on devices 0-%d only: it is measured on "
                        "%d devices, %d of them idle (their all-to-all too), and the planners plan %d", self.path,
                        world, used - 1, world, world - used, world)
        row = {"task_id": str(doc["task_id"]), "split": "test", "num_devices": world,
               "memory_bytes_per_device": int(doc["memory_bytes_per_device"] if memory_bytes is None
                                              else memory_bytes), "table_ids": self.table_ids()}
        own = self._own_devices_per_host()
        if own < int(doc["num_devices"]):
            row["devices_per_host"] = own
        return pd.DataFrame([row])

    def _own_devices_per_host(self) -> int:
        """A plan.json's devices per host, from the hosts it records (none: one host of all its devices)."""
        doc = self.document()
        hosts = doc.get("hosts")
        return int(doc["num_devices"]) // len(set(hosts)) if hosts else int(doc["num_devices"])

    def plan_task(self, task: Task) -> Placement:
        """The file's placement of `task` (checked against its tables, devices and memory)."""
        return self._plan(task.tables, task.devices, task.task_id)

    def check_tasks(self, tasks: list[Task]) -> None:
        """Refuse before anything is measured: the plan must be a plan of every task evaluated."""
        for task in tasks:
            self.plan_task(task)

    def _plan(self, tables: TableSet, topology: DeviceTopology, task_id: str) -> Placement:
        ids = self.table_ids()
        task_ids = [str(t) for t in tables.table_ids]
        missing, extra = sorted(set(task_ids) - set(ids)), sorted(set(ids) - set(task_ids))
        if missing or extra or len(ids) != len(task_ids):
            what = "; ".join(p for p in (f"missing {', '.join(missing[:3])}" if missing else "",
                                         f"not in the task {', '.join(extra[:3])}" if extra else "") if p)
            raise EmbshardError(f"the plan's {len(ids)} tables are not task {task_id}'s {len(task_ids)} "
                                f"({what or 'a table listed twice'})", path=self.path, field="tables", fix=_FIX)
        doc = self.document()
        where = f"{self.path} (task {task_id})"
        world = doc.get("num_devices", doc.get("world_size"))
        if world is not None and int(world) != topology.count:
            raise EmbshardError(f"the plan is for {world} devices, task {task_id} has {topology.count}",
                                path=self.path, field="num_devices", fix=_FIX)
        if self.is_torchrec():
            from .torchrec_plan import placement_from_sharding_plan, plan_from_json, table_row_wise_host

            # A table cut table-row-wise is on one host's ranks: the task must have hosts of that many (a TorchRec
            # plan records none), else its rows would be measured as spread over another layout.
            name, ranks = table_row_wise_host(doc)
            if ranks is not None and ranks != topology.local_world_size:
                raise EmbshardError(
                    f"the plan cuts table {name} table-row-wise over hosts of {ranks} ranks, task {task_id} has "
                    f"{topology.local_world_size} devices per host", path=self.path, field="devices_per_host",
                    fix=f"give --devices-per-host {ranks} (evaluate --plan), or tasks whose devices_per_host is "
                        f"{ranks}")
            # the task's hosts, not a launcher's variables this process may have inherited (no job here)
            # Only tables held in device memory are measured (FBGEMM's fused kernel; a replica's dense one): a
            # UVM table (rows in host memory behind a cache) was counted whole against the device and measured as
            # if it were in it.
            for params in doc["modules"].values():
                for name, p in params.items():
                    if str(p.get("compute_kernel")) not in MEASURED_KERNELS:
                        raise EmbshardError(
                            f"table {name} runs compute kernel {str(p.get('compute_kernel'))[:40]!r}: embshard "
                            f"measures tables held in device memory only ({', '.join(MEASURED_KERNELS)})",
                            path=self.path, field="compute_kernel",
                            fix="plan it with the fused kernel (TorchRec: ParameterConstraints(compute_kernels="
                                "['fused'])) and the memory it then needs")
            sharding_plan = plan_from_json(doc, where=self.path, tables=tables, world_size=topology.count,
                                           local_world_size=topology.local_world_size,
                                           rename_gpus=False)  # measured by rank: GPU names do not matter here
            placement = placement_from_sharding_plan(sharding_plan, tables, topology.count, topology.memory_bytes,
                                                     names=task_ids, module_path=next(iter(doc["modules"])))
            placement.meta = {"plan_file": self.path}
        else:
            from ..torchrec_compat import TABLE_ROW_WISE
            from .plan_json import placement_from_plan

            # As for a TorchRec plan: a table cut table-row-wise is on one of the plan's hosts, measured only there.
            name = next((str(t["table_id"]) for t in doc["tables"] if t.get("sharding_type") == TABLE_ROW_WISE),
                        None)
            hosts = tuple(int(h) for h in doc.get("hosts") or ())
            if name is not None and hosts and topology.hosts != hosts:
                own = self._own_devices_per_host()
                raise EmbshardError(
                    f"the plan cuts table {name} table-row-wise over hosts of {own} devices, task {task_id} has "
                    f"{topology.local_world_size} devices per host", path=self.path, field="devices_per_host",
                    fix=f"evaluate the plan's own task (leave out --tasks), or tasks whose devices_per_host is {own}")
            theirs = placement_from_plan(doc, tables, where=where)
            if task_id not in self._warned:
                self._warned.add(task_id)
                _warn_if_other_traffic(doc, theirs.tables, self.path)
            pos = {t: k for k, t in enumerate(task_ids)}
            shards = [dataclasses.replace(s, table=pos[str(theirs.tables.table_ids[s.table])]) for s in theirs.shards]
            placement = Placement(tables, topology.count, topology.memory_bytes, shards,
                                  meta={"plan_file": self.path, "plan_planner": doc["planner"]})
        placement.planner, placement.task_id, placement.topology = self.name, task_id, topology
        try:  # the task's memory, not the file's: a plan for bigger devices breaks it
            placement.check(where)
        except InfeasiblePlacementError as exc:
            fix = "give a plan that fits this task's memory per device" if exc.field == "memory" else exc.fix
            raise InfeasiblePlacementError(exc.message, path=where, field=exc.field, fix=fix) from None
        if not self.is_torchrec() and f"torchrec:{task_id}" not in self._warned:
            self._warned.add(f"torchrec:{task_id}")
            _warn_if_torchrec_cannot_run(placement, self.path)
        return placement
