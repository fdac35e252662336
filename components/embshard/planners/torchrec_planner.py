"""TorchRec's planner as a baseline (optional extra `embshard[torchrec]` + `torchrec==1.8.0 --no-deps`).

Two planners:
- `torchrec_table_wise`: TorchRec's full proposer/partitioner search restricted to `table_wise` sharding.
- `torchrec_full`: also `column_wise`, `table_column_wise` (its column splits), `row_wise` and `table_row_wise`
  (its row splits over all devices or over one host's, read back as row pieces). Data-parallel is not searched
  (the baselines do not replicate; the learned planner weighs replicas against their gradient all-reduce:
  costmodel.scoring.replica_extra_ms), but a TorchRec plan holding it reads back as a replica on every device.

How TorchRec sees a task: an EmbeddingBagCollection on the meta device with one table per row (name = our
index, data type fp32/fp16 from bytes_per_element), `ParameterConstraints` per table (allowed sharding types,
the `fused` kernel, i.e. weights in HBM, and our pooling factor), `Topology(world_size=D, local_world_size=D,
compute_device="cuda", hbm_cap=memory per device)` and a local batch size (default 512, TorchRec's default).
TorchRec runs its default proposers (grid search, two greedy, uniform), its GreedyPerfPartitioner and its
analytic perf model, exactly as a TorchRec user would get.

Memory accounting. embshard counts a device's memory as the bytes of the weights it holds. TorchRec's default
estimate for training adds, per shard, the input/output buffers of a batch (input ids and pooled outputs for
all ranks), optimizer state when the model carries a fused optimizer (2x weights for Adam, ~0 for row-wise
Adagrad), only a cache fraction in HBM for UVM-caching kernels, and its HeuristicalStorageReservation keeps 15%
of HBM plus dense-model and KJT buffers aside. To compare planners on the same budget we use
`memory_model="tables"` (default): a 0% `FixedPercentageStorageReservation`, the `fused` kernel only and
TorchRec's own `EmbeddingStorageEstimator` in weights-only mode (`is_inference=True`), which counts exactly
rows x columns x bytes per shard, like us. `memory_model="torchrec"` keeps TorchRec's training estimate
(weights + IO buffers; stricter than ours). Either way the converted placement must pass `Placement.check()`;
a plan over our budget raises InfeasiblePlacementError instead of being returned.

Time. TorchRec's full search grows fast with the table count (~100 s at 200 tables). `timeout_s` (None: no limit,
as TorchRec itself; evaluations compare with its unbounded search unless told otherwise) is passed to TorchRec (it
stops proposing after that many seconds and keeps its best plan so far: `meta["torchrec_timed_out"]` is then
true); when it has no plan by then, `torchrec_full` falls back to the table-wise search and says so in
`meta["torchrec_fallback"]`. `embshard place` and the learned planner's TorchRec proposal use DEFAULT_TIMEOUT_S:
without a limit, `place --planner torchrec_full` of 2,500 tables on 64 devices ran past 10 minutes.
"""
from __future__ import annotations

import logging
import math
import time

import numpy as np

from ..checks import GiB
from ..errors import InfeasiblePlacementError
from ..placement import Placement
from ..tableset import TableSet
from ..types import DeviceTopology
from .base import Planner

log = logging.getLogger(__name__)

SEARCHES = {
    "table_wise": ["table_wise"],
    "full": ["table_wise", "column_wise", "table_column_wise", "row_wise", "table_row_wise"],
}
DEFAULT_BATCH_SIZE = 512  # TorchRec's default local batch size (constants.BATCH_SIZE)
DEFAULT_TIMEOUT_S = 60.0  # place's limit on TorchRec's search, as the learned planner's cap (docstring, "Time")
# Past OVERRUN_FACTOR x the limit + OVERRUN_SLACK_S a search is said to have overrun it (TorchRec checks its limit
# only between proposals, so a little past it is normal).
OVERRUN_FACTOR, OVERRUN_SLACK_S = 1.5, 5.0


class TorchRecPlanner(Planner):
    """TorchRec's EmbeddingShardingPlanner behind our Planner interface (see the module docstring)."""

    def __init__(self, search: str = "table_wise", timeout_s: float | None = None,
                 batch_size: int = DEFAULT_BATCH_SIZE, memory_model: str = "tables", verbose: bool = False):
        if search not in SEARCHES:
            from ..errors import EmbshardError

            raise EmbshardError(f"unknown TorchRec search {search!r}", field="search",
                                fix=f"use one of {', '.join(SEARCHES)}")
        self.search = search
        self.name = f"torchrec_{search}"
        self.timeout_s = timeout_s
        self.batch_size = int(batch_size)
        self.memory_model = memory_model
        self.verbose = verbose

    def _plan(self, tables: TableSet, topology: DeviceTopology, task_id: str) -> Placement:
        num_devices, memory_bytes_per_device = topology.count, topology.memory_bytes
        from ..torchrec_compat import require_torchrec

        require_torchrec()
        from torchrec.distributed.planner.types import PlannerError

        start = time.perf_counter()
        meta: dict = {"torchrec_search": self.search, "torchrec_batch_size": self.batch_size,
                      "torchrec_memory_model": self.memory_model}
        try:
            sharding_plan, info = self._run(tables, topology, SEARCHES[self.search], self.timeout_s)
        except PlannerError as exc:
            elapsed = time.perf_counter() - start
            timed_out = self.timeout_s is not None and elapsed >= _torchrec_timeout(self.timeout_s)
            if not (timed_out and self.search != "table_wise"):
                raise self._infeasible(exc, tables, num_devices, memory_bytes_per_device, task_id) from None
            # No plan within the time limit: TorchRec's table-wise search is much smaller and still a fair plan.
            meta["torchrec_fallback"] = (f"the {self.search} search found no plan in {self.timeout_s:g} s; "
                                         "this is TorchRec's table-wise plan")
            try:
                sharding_plan, info = self._run(tables, topology, SEARCHES["table_wise"], None)
            except PlannerError as exc2:
                raise self._infeasible(exc2, tables, num_devices, memory_bytes_per_device, task_id) from None
        elapsed = time.perf_counter() - start
        meta.update(info)
        meta["torchrec_planning_s"] = round(elapsed, 3)
        searched = float(info["torchrec_search_s"])  # the limited search (a fallback has its own note)
        if (self.timeout_s is not None and "torchrec_fallback" not in meta
                and searched > OVERRUN_FACTOR * self.timeout_s + OVERRUN_SLACK_S):
            # TorchRec checks its limit only between proposals; one proposal of 2,000 tables on 128 devices (its
            # full search) took 165 s against a 10 s limit. Said, since `place` promised to stop by the limit.
            smaller = ("torchrec_table_wise, a far smaller search" if self.search != "table_wise"
                       else "the learned planner or a greedy one")
            log.warning("%s: TorchRec's search took %.0f s against its %g s limit: TorchRec checks the limit only "
                        "between proposals, and one proposal of %d tables on %d devices took longer (fix: %s)",
                        task_id, searched, self.timeout_s, len(tables), num_devices, smaller)
        # TorchRec's limit is whole seconds and only checked between proposals: a search that ran that long
        # was stopped by it (its best plan so far is what we return).
        meta["torchrec_timed_out"] = bool(self.timeout_s is not None and "torchrec_fallback" not in meta
                                          and info["torchrec_search_s"] >= _torchrec_timeout(self.timeout_s))

        from ..torchrec_compat import placement_from_sharding_plan

        placement = placement_from_sharding_plan(sharding_plan, tables, num_devices, memory_bytes_per_device,
                                                 names=_names(len(tables)), planner=self.name, task_id=task_id,
                                                 meta=meta)
        try:
            placement.check()
        except InfeasiblePlacementError as exc:
            raise InfeasiblePlacementError(f"TorchRec's plan breaks the memory budget: {exc}", path=task_id,
                                           field="memory_bytes_per_device",
                                           fix="use memory_model='tables' or another planner") from None
        return placement

    def _run(self, tables: TableSet, devices: DeviceTopology, sharding_types: list[str], timeout_s: float | None):
        """One TorchRec planning run: (ShardingPlan, info dict). TorchRec sees our devices per host."""
        from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
        from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints
        from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
        from torchrec.distributed.planner.storage_reservations import FixedPercentageStorageReservation

        from ..torchrec_compat import FUSED, build_module, storage_estimators, topology, torchrec_hosts

        names = _names(len(tables))
        module = build_module(tables, names=names)
        num_devices, memory = devices.count, devices.memory_bytes
        if torchrec_hosts(num_devices, devices.hosts) is None:
            # TorchRec takes host h to be ranks h*L..h*L+L-1: with our hosts laid out otherwise its per-host
            # (table_row_wise) pieces would straddle hosts, so it is not searched.
            sharding_types = [t for t in sharding_types if t != "table_row_wise"]
        topo = topology(num_devices, memory, local_world_size=devices.local_world_size)
        constraints = {
            n: ParameterConstraints(sharding_types=list(sharding_types), compute_kernels=[FUSED],
                                    pooling_factors=[max(float(pf), 1e-3)])
            for n, pf in zip(names, tables.pooling_factor)
        }
        enumerator = _ordered_enumerator(EmbeddingEnumerator)(
            topology=topo, batch_size=self.batch_size, constraints=constraints,
            estimator=storage_estimators(topo, constraints, self.memory_model))
        kw: dict[str, list] = {} if self.verbose else {"stats": []}
        planner = EmbeddingShardingPlanner(
            topology=topo, batch_size=self.batch_size, enumerator=enumerator, constraints=constraints,
            storage_reservation=FixedPercentageStorageReservation(0.0), debug=self.verbose,
            timeout_seconds=None if timeout_s is None else _torchrec_timeout(timeout_s), **kw)
        t0 = time.perf_counter()
        plan = planner.plan(module, [EmbeddingBagCollectionSharder()])
        search_s = time.perf_counter() - t0
        best = planner._best_plan or []  # TorchRec's chosen sharding options, with its perf estimates
        rank_perf = np.zeros(num_devices)
        kinds: dict[str, int] = {}
        for option in best:
            kinds[option.sharding_type] = kinds.get(option.sharding_type, 0) + 1
            for shard in option.shards:
                if shard.rank is not None and shard.perf is not None:
                    rank_perf[shard.rank] += shard.perf.total
        info = {"torchrec_search_s": round(search_s, 3), "torchrec_num_proposals": int(planner._num_proposals),
                "torchrec_num_plans": int(planner._num_plans), "torchrec_sharding_types": kinds,
                # TorchRec's own analytic cost model (ms per iteration), for comparison with ours.
                "torchrec_rank_perf_ms": [round(float(x), 6) for x in rank_perf],
                "torchrec_max_rank_perf_ms": round(float(rank_perf.max()), 6)}
        return plan, info

    def _infeasible(self, exc, tables: TableSet, num_devices: int, memory: int,
                    task_id: str) -> InfeasiblePlacementError:
        """TorchRec's PlannerError as our error, with the storage numbers and how much memory is missing."""
        total = int(tables.size_bytes.sum())
        capacity = num_devices * memory
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        table, short = _largest_first_shortfall(tables, num_devices, memory)
        if table is not None:
            where = (f"packing tables largest-first, table {tables.table_ids[table]} "
                     f"({tables.size_bytes[table] / GiB:.3f} GiB) finds no device with room "
                     f"({short / GiB:.3f} GiB missing)")
        else:
            where = ("a largest-first packing fits, so TorchRec's perf-greedy partitioner is the limit "
                     "(0 GiB missing for a size-greedy plan)")
        # A table larger than one device: a table-wise plan can never hold it, whatever the device count.
        too_big = self.search == "table_wise" and int(tables.size_bytes.max()) > memory
        return InfeasiblePlacementError(
            f"TorchRec found no {self.search} plan ({first}); tables need {total / GiB:.3f} GiB of "
            f"{num_devices} x {memory / GiB:.3f} = {capacity / GiB:.3f} GiB; {where}", path=task_id,
            field="memory_bytes_per_device",
            fix=("a table-wise plan never cuts a table larger than a device: use a planner that cuts it (learned, "
                 "size_greedy or torchrec_full), or raise memory per device") if too_big
            else "add devices, raise memory per device, or use size_greedy")


def _ordered_enumerator(base):
    """TorchRec's enumerator, with the sharding types and kernels a table's constraints allow in the sharder's own
    order. TorchRec intersects them as Python sets, whose order follows the string hash, so its proposers saw the
    options in another order in each process and `torchrec_full` returned one of two plans by PYTHONHASHSEED (a
    user's 24 tables on 8 devices: 4 or 11 tables cut, measured 1.27x apart)."""

    class OrderedEnumerator(base):
        def _filter_sharding_types(self, name, allowed_sharding_types, *args, **kwargs):
            kept = set(super()._filter_sharding_types(name, allowed_sharding_types, *args, **kwargs))
            return [t for t in allowed_sharding_types if t in kept]

        def _filter_compute_kernels(self, name, allowed_compute_kernels, *args, **kwargs):
            kept = set(super()._filter_compute_kernels(name, allowed_compute_kernels, *args, **kwargs))
            return [k for k in allowed_compute_kernels if k in kept]

    return OrderedEnumerator


def _torchrec_timeout(timeout_s: float) -> int:
    return max(1, math.ceil(timeout_s))


def _names(n: int) -> list[str]:
    # Internal TorchRec table names: our ids may contain characters nn.ModuleDict refuses.
    return [f"t{i}" for i in range(n)]


def _largest_first_shortfall(tables: TableSet, num_devices: int, memory: int) -> tuple[int | None, int]:
    """Pack tables largest first onto the emptiest device; the first table that fits nowhere and by how much."""
    free = np.full(num_devices, memory, dtype=np.int64)
    for i in np.argsort(-tables.size_bytes, kind="stable"):
        d = int(np.argmax(free))
        if tables.size_bytes[i] > free[d]:
            return int(i), int(tables.size_bytes[i] - free[d])
        free[d] -= tables.size_bytes[i]
    return None, 0
