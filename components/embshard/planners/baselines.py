"""The baseline planners every result is compared with (docs/method.md, "Baselines").

random and round-robin ignore costs; each greedy sorts the tables by its proxy, largest first, and puts each on
the device with room whose running proxy sum is smallest. All of them respect memory: a table that fits on no
device raises an error that says how much memory is missing.
"""
from __future__ import annotations

import numpy as np

from ..heuristics import GREEDY_BASELINES, PROXIES, greedy_assignment
from ..placement import Placement
from ..types import DeviceTopology
from .base import Planner, no_room_error

__all__ = ["BASELINES", "GREEDY_BASELINES", "PROXIES", "GreedyPlanner", "RandomPlanner", "RoundRobinPlanner",
           "make_baseline"]


class GreedyPlanner(Planner):
    """Largest proxy first onto the feasible device with the smallest running proxy sum."""

    def __init__(self, proxy: str):
        self.proxy_name = proxy
        self.proxy = PROXIES[proxy]
        self.name = f"{proxy}_greedy"

    def _plan(self, tables, topology: DeviceTopology, task_id):
        assignment, stuck, free = greedy_assignment(tables, self.proxy_name, topology.count, topology.memory_bytes)
        if assignment is None:
            raise no_room_error(tables, stuck, free, task_id)
        return Placement.from_assignment(tables, assignment, topology.count, topology.memory_bytes)


class RandomPlanner(Planner):
    """Each table on a uniformly random device that still has room (seeded)."""

    name = "random"

    def __init__(self, seed: int = 0):
        self.seed = seed

    def _plan(self, tables, topology: DeviceTopology, task_id):
        num_devices, memory_bytes_per_device = topology.count, topology.memory_bytes
        rng = np.random.default_rng(self.seed)
        free = np.full(num_devices, memory_bytes_per_device, dtype=np.int64)
        assignment = np.empty(len(tables), dtype=np.int64)
        # Big tables first so that randomness rarely paints itself into a corner.
        for i in np.argsort(-tables.size_bytes, kind="stable"):
            fits = np.flatnonzero(free >= tables.size_bytes[i])
            if fits.size == 0:
                raise no_room_error(tables, i, free, task_id)
            d = int(rng.choice(fits))
            assignment[i] = d
            free[d] -= tables.size_bytes[i]
        return Placement.from_assignment(tables, assignment, num_devices, memory_bytes_per_device)


class RoundRobinPlanner(Planner):
    """Table i on device i mod D; when that device is full, the next one with room."""

    name = "round_robin"

    def _plan(self, tables, topology: DeviceTopology, task_id):
        num_devices, memory_bytes_per_device = topology.count, topology.memory_bytes
        free = np.full(num_devices, memory_bytes_per_device, dtype=np.int64)
        assignment = np.empty(len(tables), dtype=np.int64)
        for i in range(len(tables)):
            for k in range(num_devices):
                d = (i + k) % num_devices
                if free[d] >= tables.size_bytes[i]:
                    break
            else:
                raise no_room_error(tables, i, free, task_id)
            assignment[i] = d
            free[d] -= tables.size_bytes[i]
        return Placement.from_assignment(tables, assignment, num_devices, memory_bytes_per_device)


BASELINES = ["random", "round_robin", "dim_greedy", "size_greedy", "lookup_greedy", "size_lookup_greedy"]


def make_baseline(name: str, seed: int = 0) -> Planner:
    if name == "random":
        return RandomPlanner(seed)
    if name == "round_robin":
        return RoundRobinPlanner()
    if name.endswith("_greedy") and name[: -len("_greedy")] in PROXIES:
        return GreedyPlanner(name[: -len("_greedy")])
    raise KeyError(name)
