"""The baseline planners every result is compared with (docs/method.md, "Baselines").

random and round-robin ignore costs; each greedy sorts the tables by its proxy, largest first, and puts each on
the device with room whose running proxy sum is smallest. All of them respect memory: a table that fits on no
device raises an error that says how much memory is missing.
"""
from __future__ import annotations

import numpy as np

from ..placement import Placement
from ..tableset import TableSet
from .base import Planner, no_room_error


def proxy_dim(t: TableSet) -> np.ndarray:
    return t.dims.astype(np.float64)


def proxy_size(t: TableSet) -> np.ndarray:
    return t.size_bytes.astype(np.float64)


def proxy_lookup(t: TableSet) -> np.ndarray:
    return t.dims * t.pooling_factor


def proxy_size_lookup(t: TableSet) -> np.ndarray:
    # log10 of 10 rows is 1: tiny tables keep a positive weight.
    return t.dims * t.pooling_factor * np.log10(np.maximum(t.rows, 10))


PROXIES = {"dim": proxy_dim, "size": proxy_size, "lookup": proxy_lookup, "size_lookup": proxy_size_lookup}


class GreedyPlanner(Planner):
    """Largest proxy first onto the feasible device with the smallest running proxy sum."""

    def __init__(self, proxy: str):
        self.proxy_name = proxy
        self.proxy = PROXIES[proxy]
        self.name = f"{proxy}_greedy"

    def _plan(self, tables, num_devices, memory_bytes_per_device, task_id):
        cost = self.proxy(tables)
        order = np.argsort(-cost, kind="stable")
        load = np.zeros(num_devices)
        free = np.full(num_devices, memory_bytes_per_device, dtype=np.int64)
        assignment = np.empty(len(tables), dtype=np.int64)
        for i in order:
            fits = free >= tables.size_bytes[i]
            if not fits.any():
                raise no_room_error(tables, i, free, task_id)
            d = int(np.argmin(np.where(fits, load, np.inf)))
            assignment[i] = d
            load[d] += cost[i]
            free[d] -= tables.size_bytes[i]
        return Placement.from_assignment(tables, assignment, num_devices, memory_bytes_per_device)


class RandomPlanner(Planner):
    """Each table on a uniformly random device that still has room (seeded)."""

    name = "random"

    def __init__(self, seed: int = 0):
        self.seed = seed

    def _plan(self, tables, num_devices, memory_bytes_per_device, task_id):
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

    def _plan(self, tables, num_devices, memory_bytes_per_device, task_id):
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
GREEDY_BASELINES = ["dim_greedy", "size_greedy", "lookup_greedy", "size_lookup_greedy"]


def make_baseline(name: str, seed: int = 0) -> Planner:
    if name == "random":
        return RandomPlanner(seed)
    if name == "round_robin":
        return RoundRobinPlanner()
    if name.endswith("_greedy") and name[: -len("_greedy")] in PROXIES:
        return GreedyPlanner(name[: -len("_greedy")])
    raise KeyError(name)
